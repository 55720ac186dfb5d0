"""Sweep points on one composed config: Hydra composes once per choice of config groups, and
each point's value overrides (`layout.tp=4`, `training.micro_batch=2`) are applied to a copy
of that typed config, with the types OmegaConf would give them. A point whose overrides the
copy cannot take exactly as Hydra would (a new key `+k=v`, a deletion `~k`, an interpolation,
a value of another type, a nested mapping) is composed whole through Hydra instead, so every
point's config, and every error, is what `compose(point)` gives.
"""
from __future__ import annotations

import copy
import dataclasses
import typing
from functools import lru_cache
from typing import Any

from orchestrator.config.compose import _conform, compose, group_names, type_hints, typed
from orchestrator.config.errors import ConfigError
from orchestrator.config.schema import Config


class _Whole(Exception):
    """This point is composed whole through Hydra."""


class Points:
    """Typed configs for sweep points, composing through Hydra only per choice of groups."""

    def __init__(self, config_dir: str | None = None, config_name: str = "config"):
        self.where = dict(config_dir=config_dir, config_name=config_name)
        self.groups = group_names(config_dir)
        self.bases: dict[tuple[str, ...], Config] = {}
        self.composed = 0  # how many Hydra compositions the points took

    def typed(self, point: list[str]) -> Config:
        """The typed config of one point, as typed(compose(point)) gives it. Raises ConfigError."""
        try:
            groups, values = self._split(point)
            base = self._base(groups)
            return _apply(base, [_parse(o) for o in values])
        except _Whole:
            self.composed += 1
            return typed(compose(point, **self.where))

    def _split(self, point: list[str]) -> tuple[tuple[str, ...], list[str]]:
        groups, values = [], []
        for o in point:
            key, eq, value = o.partition("=")
            if not eq or key[:1] in "+~" or "/" in key or "@" in key or key.startswith("hydra.") or "${" in value:
                raise _Whole
            (groups if key in self.groups else values).append(o)
        return tuple(groups), values

    def _base(self, groups: tuple[str, ...]) -> Config:
        if groups not in self.bases:
            try:
                self.composed += 1
                self.bases[groups] = typed(compose(list(groups), **self.where))
            except ConfigError:
                raise _Whole from None  # the point's own composition names every problem
        return self.bases[groups]


@lru_cache(maxsize=4096)
def _parse(override: str) -> tuple[tuple[str, ...], Any]:
    """(key path, value) of one `key=value`, the value as Hydra's parser reads it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        o = OverridesParser.create().parse_override(override)
    except Exception:  # compose(point) says what is wrong with it
        raise _Whole from None
    if o.is_sweep_override() or o.is_add() or o.is_delete() or o.is_force_add():
        raise _Whole
    return tuple(o.key_or_group.split(".")), o.value()


def _apply(base: Config, values: list[tuple[tuple[str, ...], Any]]) -> Config:
    cfg = copy.deepcopy(base)
    for path, value in values:
        obj = cfg
        for part in path[:-1]:
            obj = getattr(obj, part, None) if dataclasses.is_dataclass(obj) else None
        if not dataclasses.is_dataclass(obj) or path[-1] not in {f.name for f in dataclasses.fields(obj)}:
            raise _Whole  # not a key of the schema: Hydra's error names it
        setattr(obj, path[-1], _typed_value(value, type_hints(type(obj))[path[-1]]))
    return cfg


_LEAF = (int, float, bool, str)


def _typed_value(value: Any, hint: Any) -> Any:
    """`value` as OmegaConf stores it for a field of type `hint`, or _Whole where that is not plain."""
    if isinstance(value, str) and value == "???":
        raise _Whole
    inner = _optional(hint)
    if value is None:
        if inner is hint and hint is not Any:
            raise _Whole  # null into a non-optional field: OmegaConf refuses it
        return None
    if isinstance(value, dict) or dataclasses.is_dataclass(inner) or typing.get_origin(inner) in (dict, typing.Dict):
        raise _Whole
    if isinstance(value, list):
        args = typing.get_args(inner)
        if not (inner is Any or (typing.get_origin(inner) in (list, typing.List) and args and args[0] in _LEAF + (Any,))):
            raise _Whole
        return [_typed_value(v, args[0] if args else Any) for v in value]
    if inner is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # OmegaConf's FloatNode
    ok, converted = _conform(value, inner)
    if not ok:
        raise _Whole
    return converted


def _optional(hint: Any) -> Any:
    if typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else Any
    return hint
