"""A plain, attribute-style view of a composed config (DictConfig, dataclass or dict).

The planner reads only this view, so it works the same from Hydra, from the
Python API and from tests, and never holds OmegaConf nodes in its hot loops.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrator.config.schema import Config


def _ns(x: Any) -> Any:
    if isinstance(x, dict):
        return SimpleNamespace(**{k: _ns(v) for k, v in x.items()})
    if isinstance(x, list):
        return [_ns(v) for v in x]
    return x


def to_container(cfg: Any) -> dict:
    """Merge `cfg` onto the schema (so types and key names are checked) and return a dict."""
    if isinstance(cfg, SimpleNamespace):
        cfg = _to_dict(cfg)
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=True)


def _to_dict(ns: Any) -> Any:
    if isinstance(ns, SimpleNamespace):
        return {k: _to_dict(v) for k, v in vars(ns).items()}
    if isinstance(ns, list):
        return [_to_dict(v) for v in ns]
    return ns


def to_spec(cfg: Any) -> SimpleNamespace:
    return _ns(to_container(cfg))


def spec_to_dict(spec: SimpleNamespace) -> dict:
    return _to_dict(spec)
