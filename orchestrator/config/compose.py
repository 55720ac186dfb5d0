"""Hydra composition, the typed config, and where the config tree lives.

`compose(overrides)` composes like the command line does and raises `ConfigError`
(every problem with the key and a fix) instead of Hydra's own exceptions, so a
misspelled key, an unknown option or a value of the wrong type is refused the same
way as a layout that does not fit. `typed(cfg)` turns a composed config (or a plain
dict, or a `Config`) into the typed `Config` dataclass the planner works on.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.errors import ConfigError, Problem
from orchestrator.config.paths import CONF_DIR, RECIPES_DIR
from orchestrator.config.schedules import SCHEDULES
from orchestrator.config.schema import LAUNCHER_SCHEMAS, Config

_registered = False


def register() -> None:
    """The schema, one option per launcher and per schedule, and the recipes, in Hydra's ConfigStore."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    from orchestrator.config.recipes import register_recipes

    cs = ConfigStore.instance()
    cs.store(name="orchestrator_schema", node=hydra_schema())
    for name, schema in LAUNCHER_SCHEMAS.items():
        cs.store(group="launcher", name=name.value, node=schema)
    for name in SCHEDULES:
        cs.store(group="schedule", name=name, node={"name": name})
    register_recipes(cs, RECIPES_DIR)
    _registered = True


def hydra_schema(present=None) -> DictConfig:
    """The typed root config Hydra composes onto: Config, with each config group's node its bare
    class (the chosen option's preset is merged onto it, as Hydra merges a group's file) rather
    than the default preset Config() takes. `present`: only these groups (a plain mapping's)."""
    from orchestrator.config.schema import GROUPS

    node = OmegaConf.structured(Config)
    for group, cls in GROUPS.items():
        if present is None or group in present:
            node[group] = MISSING if cls is Any else OmegaConf.structured(cls)
    return node


def compose(overrides: list[str] | None = None, config_name: str = "config", hydra: bool = False,
            config_dir: str | None = None) -> DictConfig:
    """Compose as the command line would. With `hydra`, the `hydra` node (run and sweep
    directories) is kept; otherwise it is dropped. `config_dir` is `--config-dir`: a site's
    folder of more presets (DIR/hardware/*.yaml, DIR/fabric/*.yaml, ...) searched after the
    packaged tree, as Hydra searches it.

    Raises ConfigError with every bad override, not only the first: each one Hydra refuses
    is set aside and the rest composed again. The error's `partial` holds the config of
    the good overrides, so the caller can report the planner's problems in the same go."""
    todo, problems = list(overrides or []), []
    app = hydra_app(config_dir)
    bad = bool_overrides(todo)  # OmegaConf would turn 3 into true without a word
    problems += [p for _, p in bad]
    todo = [o for o in todo if o not in {line for line, _ in bad}]
    for _ in range(len(todo) + 1):
        try:
            cfg = _hydra_compose(app, todo, config_name)
            stack = trainer_stack(cfg, todo)
            if stack:  # trainer=torchtitan plans as stack=torchtitan unless stack= is given
                cfg = _hydra_compose(app, todo + [f"stack={stack}"], config_name)
            problems += unknown_keys(cfg) + bool_presets(app, cfg)
            break
        except Exception as e:  # Hydra's and OmegaConf's errors become the project's own
            p = compose_problem(e, todo)
            problems.append(p)
            culprit = [o for o in todo if o.lstrip("+~").split("=", 1)[0] in p.key.split(", ")]
            if not culprit:
                raise ConfigError(problems) from None
            todo = [o for o in todo if o not in culprit]
    else:
        raise ConfigError(problems)
    if not hydra:
        with open_dict(cfg):
            cfg.pop("hydra", None)
    if problems:
        raise ConfigError(problems, partial=cfg)
    return cfg


def trainer_stack(cfg: DictConfig, overrides: list[str]) -> str | None:
    """The stack the chosen trainer plans on, when the command line names none (a recipe's
    stack gives way to the trainer's: it is the framework that will run)."""
    stack = OmegaConf.select(cfg, "trainer.stack", default=None)
    given = any(o.lstrip("+~").split("=", 1)[0] == "stack" for o in overrides)
    return None if given or not stack or stack == OmegaConf.select(cfg, "stack.name") else str(stack)


_app: dict = {}  # the Hydra this process made for the config tree, and the --config-dir it was made with


def hydra_app(config_dir: str | None = None):
    """Hydra (its config loader, search path and plugins) over the packaged tree and a site's
    `--config-dir`, made once per process and per config dir, as `@hydra.main` makes it:
    the packaged conf/ is the primary search path, the extra dir comes after it (Hydra's
    `--config-dir` semantics: a site adds new options; a same-named packaged file wins)."""
    import os

    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    register()
    extra = os.path.abspath(config_dir) if config_dir else None
    if "hydra" in _app and _app["dir"] == extra:
        return _app["hydra"]
    if extra and not os.path.isdir(extra):
        raise ConfigError([Problem("--config-dir", f"{config_dir!r} is not a directory ({extra}).",
                                   "give a folder holding group folders, e.g. DIR/hardware/my_gpu.yaml.")])
    search = create_config_search_path(str(CONF_DIR))
    if extra:
        search.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    gh = GlobalHydra.instance()
    before = gh.hydra if gh.is_initialized() else None
    gh.clear()
    _app.update(dir=extra, hydra=Hydra.create_main_hydra2(task_name="orchestrate", config_search_path=search))
    gh.clear()  # kept here, not global: a caller's own hydra.initialize() still works after compose()
    if before is not None:
        gh.initialize(before)
    return _app["hydra"]


def _hydra_compose(app, overrides: list[str], config_name: str) -> DictConfig:
    from hydra.types import RunMode

    return app.compose_config(config_name=config_name, overrides=list(overrides), run_mode=RunMode.RUN,
                              from_shell=False, with_log_configuration=False)


def group_names(config_dir: str | None = None) -> set[str]:
    """Every config group of the search path (packaged, registered and the site's)."""
    loader = hydra_app(config_dir).config_loader
    return {g for g in loader.list_groups("") if g != "hydra"}


def unknown_keys(cfg: DictConfig) -> list[Problem]:
    """Keys the schema does not have (Hydra's `+key=value` adds them without a word)."""
    out: list[Problem] = []

    def walk(node: Any, schema: Any, path: str) -> None:
        if not (dataclasses.is_dataclass(schema) and isinstance(node, DictConfig)):
            return
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for key in node.keys():
            full = f"{path}{key}"
            if key not in fields:
                near = difflib.get_close_matches(str(key), list(fields), n=1)
                out.append(Problem(full, f"is not a key of {path.rstrip('.') or 'the config'}.",
                                   f"did you mean {path}{near[0]}?" if near else
                                   f"use one of {sorted(fields)}."))
                continue
            child = node._get_node(key)
            sub = OmegaConf.get_type(child) if isinstance(child, DictConfig) else None
            walk(child, sub, full + ".")

    for key in cfg.keys():
        if key == "hydra":
            continue
        walk(cfg._get_node(key), OmegaConf.get_type(cfg._get_node(key)), f"{key}.")
    top = {f.name for f in dataclasses.fields(Config)} | {"hydra"}
    out += [Problem(str(k), "is not a key of the config.", f"use one of {sorted(top - {'hydra'})}.")
            for k in cfg.keys() if k not in top]
    return out


def bool_problem(key: str, value: Any, where: str = "") -> Problem | None:
    """A value for one of the schema's booleans that is not true or false (OmegaConf would take
    3 or 'on' as true and 0 or 'no' as false); None when it is one, or the key is no boolean.
    `where`: the preset it came from, when not the command line."""
    if isinstance(value, bool) or value is None or not _is_bool_key(key):
        return None
    if isinstance(value, str) and (value.strip().lower() in ("true", "false") or "${" in value):
        return None  # a quoted true/false, or an interpolation OmegaConf resolves and checks
    return Problem(key, f"is a boolean, got {value!r}{where}.", f"set {key}=true or {key}=false.")


def _is_bool_key(key: str) -> bool:
    """Whether the dotted key is a boolean of the schema (a launcher's: of any launcher that has it)."""
    schema: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(schema):
            return False
        hint = _unwrap(type_hints(schema).get(part))
        if hint is Any and schema is Config and part == "launcher" and i + 1 < len(parts):
            return len(parts) == i + 2 and any(_unwrap(type_hints(sch).get(parts[i + 1])) is bool
                                               for sch in LAUNCHER_SCHEMAS.values())
        schema = hint
    return schema is bool


def _unwrap(hint: Any) -> Any:
    """Optional[X] -> X."""
    import typing

    if typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _leaves(node: Any, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested dict (lists are leaves)."""
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def bool_overrides(overrides: list[str]) -> list[tuple[str, Problem]]:
    """(override, problem) for each command-line override that gives a boolean a non-boolean value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for line in overrides:
        try:
            o = parser.parse_override(line)
        except Exception:  # noqa: BLE001 - Hydra's own composition reports it
            continue
        if o.is_delete() or o.is_sweep_override():
            continue
        value = o.value()
        found = ([bool_problem(f"{o.key_or_group}.{k}", v) for k, v in _leaves(value)]
                 if isinstance(value, dict) else [bool_problem(o.key_or_group, value)])
        out += [(line, p) for p in found if p is not None]
    return out


def bool_presets(app, cfg: DictConfig) -> list[Problem]:
    """The same for the presets the composition chose (packaged, a recipe, a site's --config-dir),
    read as written, before OmegaConf merged them onto the schema's booleans."""
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {}
    return [p for group, option in choices.items() if not group.startswith("hydra/") and option is not None
            for p in _preset_bools(app, group, option)]


_preset_checked: dict = {}  # (--config-dir, group, option) -> its problems: a preset is read once per process


def _preset_bools(app, group: str, option: str) -> list[Problem]:
    key = (_app["dir"], group, option) if _app.get("hydra") is app else None
    if key in _preset_checked:
        return _preset_checked[key]
    out = []
    try:
        loaded = app.config_loader.repository.load_config(f"{group}/{option}")
    except Exception:  # noqa: BLE001 - a preset it composed from, read again: nothing new to say
        loaded = None
    if loaded is not None and isinstance(loaded.config, DictConfig):
        package = (loaded.header or {}).get("package") or "_group_"
        prefix = "" if package == "_global_" else f"{group.replace('/', '.')}." if package == "_group_" else \
            f"{package.replace('_group_', group)}."
        for k, value in _leaves(OmegaConf.to_container(loaded.config, resolve=False), prefix):
            p = bool_problem(k, value, f" in the preset {group}={option}")
            if p is not None:
                out.append(p)
    if key is not None:
        _preset_checked[key] = out
    return out


def compose_problem(e: Exception, overrides: list[str]) -> Problem:
    """One Problem from a Hydra/OmegaConf composition error: the key, what is wrong, a fix."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(e).strip()
    cause = e.__cause__ or e.__context__
    if isinstance(e, MissingConfigException):
        group = (getattr(e, "missing_cfg_file", "") or "").split("/")[0] or "config"
        options = getattr(e, "options", None) or []
        bad = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == group), "?")
        return Problem(group, f"has no option {bad!r}.", f"use one of {options}." if options else
                       "check the option's name (orchestrate --help lists them).")
    if isinstance(e, OverrideParseException):
        return parse_problem(e)
    if text.startswith(("Sweep parameters '", "Ambiguous value for argument '")):  # a sweep without -m
        line = text.split("'")[1]
        key = line.split("=", 1)[0].lstrip("+~")
        return Problem(key, f"{line!r} is a sweep: it needs -m (--multirun).",
                       f"sweep it with orchestrate -m ..., or give one value; a list is {key}=[a,b], a string with "
                       f"a comma is quoted: {key}='a,b'.")
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

    key = getattr(e, "full_key", None) or getattr(cause, "full_key", None)
    if not key and text.startswith(("Could not override", "Error merging override", "Could not append")):
        key = text.split("'")[1] if "'" in text else text.split()[-1]
        key = key.split("=", 1)[0].lstrip("+~")
    detail = str(cause).splitlines()[0] if isinstance(cause, OmegaConfBaseException) else text.splitlines()[0]
    if isinstance(e, InterpolationResolutionError) or isinstance(cause, InterpolationResolutionError):
        return Problem(key or "config", f"its interpolation cannot be resolved: {detail}",
                       "use a plain value, or ${other.key} naming a key that exists.")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or text.startswith("Could not override"):
        parent, _, leaf = (key or "").rpartition(".")
        fields = _fields_at(parent)
        near = difflib.get_close_matches(leaf, fields, n=1) if fields else []
        owners = [n.value for n, sch in LAUNCHER_SCHEMAS.items()
                  if leaf in {f.name for f in dataclasses.fields(sch)}] if parent == "launcher" else []
        fix = (f"{key} belongs to launcher={' or '.join(owners)}: select it, e.g. launcher={owners[0]}." if owners else
               f"did you mean {parent + '.' if parent else ''}{near[0]}?" if near else
               f"use one of {fields}." if fields else "check the key's spelling.")
        return Problem(key or "config", f"is not a key of {parent or 'the config'}.", fix)
    if isinstance(e, ValueError) and "Config group override must be" in text:
        group = next((o.split("=", 1)[0] for o in overrides if o.endswith("=null")), "config group")
        return Problem(group, "a config group cannot be null.", f"choose an option, e.g. {group}=<name>.")
    if "missing mandatory value" in (text + detail).lower():
        return Problem(key or "config", "has no value ('???').", "set it on the command line, e.g. key=value.")
    return Problem(key or "config", detail, _value_fix(key))


def parse_problem(e: Exception) -> Problem:
    """Hydra's override parser refused a command-line override: the key, Hydra's reason, the grammar."""
    import re

    text = str(e).strip()
    line = getattr(e, "override", None) or ""
    m = re.match(r"\s*([+~]{0,2}[A-Za-z_][\w.\-/@]*)\s*=", line) or re.search(r"([A-Za-z_+~][\w.\-/@]*)=", text)
    reason = " ".join(x.strip() for x in text.splitlines()
                      if x.strip() and not x.startswith(("Error parsing override", "See https://")))
    return Problem(m.group(1).lstrip("+~") if m else "command line",
                   f"{line!r} cannot be parsed: {reason or text.splitlines()[0]}" if line else f"cannot be parsed: {reason}",
                   "write overrides as key=value, quoting values with spaces, commas, brackets or newlines ('...'); a sweep "
                   "is a,b or choice(a,b), range(start,stop[,step]), glob(pattern[,exclude=[...]]), sort(...), "
                   "shuffle(...) or tag(name,...,sweep) (Hydra's override grammar).")


def _fields_at(dotted: str) -> list[str]:
    schema: Any = Config
    for part in [p for p in dotted.split(".") if p]:
        f = {x.name: x for x in dataclasses.fields(schema)}.get(part) if dataclasses.is_dataclass(schema) else None
        if f is None:
            return []
        schema = f.type if isinstance(f.type, type) else _resolve(schema, f)
    return sorted(x.name for x in dataclasses.fields(schema)) if dataclasses.is_dataclass(schema) else []


def _resolve(owner: Any, f: dataclasses.Field) -> Any:
    return type_hints(owner).get(f.name)


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """A schema class's field types (typing.get_type_hints, evaluated once per class)."""
    import typing

    return typing.get_type_hints(cls)


def _value_fix(key: str | None) -> str:
    if not key:
        return "check the value's type."
    parent, _, leaf = key.rpartition(".")
    schema: Any = Config
    for part in [p for p in parent.split(".") if p]:
        if not dataclasses.is_dataclass(schema):
            break
        schema = _resolve(schema, {x.name: x for x in dataclasses.fields(schema)}[part])
    if dataclasses.is_dataclass(schema):
        t = _resolve(schema, {x.name: x for x in dataclasses.fields(schema)}.get(leaf, dataclasses.fields(schema)[0]))
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return f"use one of {[m.value for m in t]}."
        if t in (int, float, bool):
            return f"{key} takes a value of type {t.__name__}."
    return "check the value's type."


def typed(cfg: Any) -> Config:
    """The typed config: a composed DictConfig, a plain dict or a Config. Raises ConfigError."""
    if isinstance(cfg, Config):
        problems = check_types(cfg)
        if problems:
            raise ConfigError(problems)
        return cfg
    try:
        if not (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is Config):
            raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
            problems = [p for k, v in (_leaves(raw) if isinstance(raw, dict) else ()) if (p := bool_problem(k, v))]
            if problems:  # before the merge turns them into booleans
                raise ConfigError(problems)
            present = ["launcher", *cfg.keys()] if isinstance(cfg, (dict, DictConfig)) else ["launcher"]
            cfg = OmegaConf.merge(hydra_schema(present), _with_launcher_schema(cfg))  # the launcher: typed by name
        problems = unknown_keys(cfg)
        if problems:
            raise ConfigError(problems)
        if "hydra" in cfg:  # leave the caller's config as it was
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.pop("hydra")
        return OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError([compose_problem(e, [])]) from None


def check_types(obj: Any, path: str = "") -> list[Problem]:
    """Every field of a Config built in Python has its declared type (OmegaConf checks the
    composed ones); a name of an enum member becomes the member."""
    out: list[Problem] = []
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value, hint = f"{path}{f.name}", getattr(obj, f.name), hints[f.name]
        ok, value = _conform(value, hint)
        if not ok:
            out.append(Problem(key, f"{value!r} is not a {getattr(hint, '__name__', hint)}.",
                               _value_fix(key) if path else "use the schema's type."))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += check_types(value, key + ".")
        else:
            setattr(obj, f.name, value)
    return out


def _conform(value: Any, hint: Any) -> tuple[bool, Any]:
    import typing

    if hint is Any:
        return True, value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        return (True, None) if value is None else _conform(value, next(a for a in args if a is not type(None)))
    if origin in (list, typing.List):
        if not isinstance(value, (list, tuple)):
            return False, value
        items = [_conform(v, args[0] if args else Any) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin in (dict, typing.Dict):
        return isinstance(value, dict), value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return True, value
        return (True, hint[value]) if isinstance(value, str) and value in hint.__members__ else (False, value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, hint), value


def _with_launcher_schema(cfg: Any) -> Any:
    """A plain mapping's `launcher` typed by its name (dry when there is none)."""
    launcher = cfg.get("launcher") if isinstance(cfg, (dict, DictConfig)) else None
    if launcher is not None and not isinstance(launcher, (dict, DictConfig)):
        raise ConfigError([Problem("launcher", f"must be a mapping with a name, got {launcher!r}.",
                                   "use launcher=dry, launcher=local or launcher=slurm.")])
    if isinstance(launcher, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(launcher)):
        return cfg
    name = str((launcher or {}).get("name", "dry"))
    schema = {k.value: v for k, v in LAUNCHER_SCHEMAS.items()}.get(name)
    if schema is None:
        raise ConfigError([Problem("launcher.name", f"unknown launcher {name!r}.",
                                   f"use one of {[k.value for k in LAUNCHER_SCHEMAS]}.")])
    typed_launcher = OmegaConf.merge(OmegaConf.structured(schema), launcher or {})
    return OmegaConf.merge(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg), {"launcher": typed_launcher})


def to_dict(obj: Any) -> Any:
    """A typed config (or any part of it) as plain JSON-able data: enums become their values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple, ListConfig)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, (dict, DictConfig)):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj
