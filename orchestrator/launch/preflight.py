"""Checks before anything is started or submitted (torch-free): fault and failover settings,
the checkpoint location, and whether a checkpoint found there may be resumed by this run."""
from __future__ import annotations

import dataclasses
import os
import sys
import typing
import uuid
from functools import lru_cache
from pathlib import Path

from orchestrator.config.compose import to_dict
from orchestrator.config.errors import Problem
from orchestrator.config.schema import RANK_KINDS, Config, FaultKind, FaultMode
from orchestrator.rundir import checkpoints as ckpt

# Local places no run may write into (a typo away from damage).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr", "/var/lib")


def fault_problems(spec: Config) -> list[Problem]:
    """fault.* and failover.* settings, checked before anything starts."""
    f, fo, out = spec.fault, spec.failover, []
    nodes, steps = spec.cluster.nodes, spec.training.steps
    if f.kind == FaultKind.slow_node:
        if f.kill_node is None or not 0 <= f.kill_node < nodes:
            out.append(Problem("fault.kill_node", f"fault.kind=slow_node needs the node to slow, 0 .. {nodes - 1}, got "
                               f"{f.kill_node}.", "set fault.kill_node=<node>."))
        if not f.slow_s > 0:
            out.append(Problem("fault.slow_s", f"fault.kind=slow_node needs extra seconds per step above 0, got "
                               f"{f.slow_s}.", "use e.g. fault.slow_s=1.0."))
        if f.at_step is None or not 0 <= f.at_step < steps:
            out.append(Problem("fault.at_step", f"fault.kind=slow_node needs the step it starts at, 0 .. {steps - 1}, "
                               f"got {f.at_step}.", f"use fault.at_step between 0 and {steps - 1}."))
    if not fo.straggler_margin > 1 or fo.straggler_steps < 1:
        out.append(Problem("failover.straggler_margin, failover.straggler_steps", f"need a margin above 1 and at least "
                           f"one step, got {fo.straggler_margin} and {fo.straggler_steps}.", "use e.g. 1.3 and 5."))
    dp, shard = spec.layout.dp, spec.layout.dp_shard
    copies = dp // (shard or dp) if isinstance(dp, int) and dp > 0 and (shard is None or shard > 0) else None
    if f.kind == FaultKind.cut_copy and copies is not None and copies < 3:
        out.append(Problem("fault.kind", f"fault.kind=cut_copy cuts one copy of the model state off from the others; "
                           f"layout.dp={dp} with layout.dp_shard={shard} holds {copies} cop{'y' if copies == 1 else 'ies'}"
                           f", and with fewer than 3 no copy can tell which one is cut.",
                           "use at least 3 copies (e.g. layout.dp=4 layout.dp_shard=1), or another fault.kind."))
    if f.kind in (*RANK_KINDS, FaultKind.cut_copy):
        world = nodes * spec.hardware.gpus_per_node
        if f.rank is None or not 0 <= f.rank < world:
            out.append(Problem("fault.rank", f"fault.kind={f.kind.value} needs a global rank 0 .. {world - 1}, got "
                               f"{f.rank}.", "set fault.rank=<rank>."))
        if f.at_step is None or not 0 < f.at_step < steps:
            out.append(Problem("fault.at_step", f"fault.kind={f.kind.value} needs a step inside 1 .. {steps - 1}, got "
                               f"{f.at_step}.", f"use fault.at_step between 1 and {steps - 1}."))
    if f.kill_node is not None and f.kind == FaultKind.kill_node:
        listed = f.nodes()
        named = (lambda i, n: f"[{i}]={n!r}") if isinstance(f.kill_node, (list, tuple)) else (lambda i, n: repr(n))
        bad = [named(i, n) for i, n in enumerate(listed)
               if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < nodes]
        twice = [named(i, n) for i, n in enumerate(listed) if n in listed[:i]]
        why = ([f"{', '.join(bad)} {'is not a node' if len(bad) == 1 else 'are not nodes'} of 0 .. {nodes - 1} "
                f"(cluster.nodes is {nodes})"] if bad else []) + \
              ([f"{', '.join(twice)} named before"] if twice else []) + \
              ([f"{len(listed)} nodes would leave none of cluster.nodes={nodes} alive"]
               if 1 < len(listed) >= nodes else [])
        if why:
            out.append(Problem("fault.kill_node", f"{f.kill_node}: " + "; ".join(why) + ".",
                               f"name distinct nodes of 0 .. {nodes - 1} that leave one alive, e.g. fault.kill_node=1"
                               + (f" or fault.kill_node=[0,{nodes - 2}]" if nodes > 2 else "") + "."))
        if f.mode != FaultMode.random and f.at_step is None:
            out.append(Problem("fault.at_step", f"fault.kill_node={f.kill_node} needs the step to kill it at.",
                               "set fault.at_step=<step>, or fault.mode=random."))
        elif f.at_step is not None and not 0 < f.at_step < steps:
            out.append(Problem("fault.at_step", f"step {f.at_step} is not inside the run's 1 .. {steps - 1} "
                               f"(training.steps={steps}): the fault would never fire.",
                               f"use fault.at_step between 1 and {steps - 1}."))
        every = spec.training.checkpoint.every
        if f.mode == FaultMode.during_save and len(f.nodes()) > 1:
            out.append(Problem("fault.kill_node, fault.mode", f"during_save kills one node inside a save, got "
                               f"{f.kill_node}.", "name one node, or use fault.mode=step for several at once."))
        if f.mode == FaultMode.during_save:
            if every <= 0:
                out.append(Problem("fault.mode, training.checkpoint.every", "during_save needs checkpoints, but "
                                   "training.checkpoint.every is 0.", "set training.checkpoint.every=<steps>."))
            elif f.at_step is not None and f.at_step % every and f.at_step != steps:
                out.append(Problem("fault.at_step, fault.mode", f"no checkpoint is saved at step {f.at_step} "
                                   f"(training.checkpoint.every={every}): during_save would never fire.",
                                   f"use a multiple of {every}, e.g. fault.at_step={max(every, f.at_step - f.at_step % every)}."))
    if (fo.max_failovers or 0) < 0 or fo.min_dp < 1 or (fo.max_failovers_per_hour or 1) <= 0 \
            or fo.no_progress_attempts < 1:
        out.append(Problem("failover.max_failovers, failover.max_failovers_per_hour, failover.min_dp, "
                           "failover.no_progress_attempts", f"need max_failovers >= 0, max_failovers_per_hour > 0, "
                           f"min_dp >= 1 and no_progress_attempts >= 1, got {fo.max_failovers}, "
                           f"{fo.max_failovers_per_hour}, {fo.min_dp} and {fo.no_progress_attempts}.",
                           "use e.g. null (no total cap), null (from the job MTBF), 1 and 3."))
    return out


def path_problems(key: str, path: str | Path) -> list[Problem]:
    """A local path this program will create or read (a run or sweep directory, a checkpoint
    folder): each name within the file system's NAME_MAX and the whole within its PATH_MAX, so a
    path the system cannot hold is refused naming its key instead of failing on first use."""
    text = str(path)
    if "\x00" in text:
        return [Problem(key, f"{text!r} contains a NUL character.", "use a plain path.")]
    if not text.strip():
        return [Problem(key, "is empty: the files would be written into the current folder, among yours.",
                        f"name a folder of its own, e.g. {key}=outputs/my_folder.")]
    full = Path(os.path.abspath(text))
    base = next((p for p in (full, *full.parents) if os.path.isdir(p)), Path("/"))
    name_max, path_max = _limit(base, "PC_NAME_MAX", 255), _limit(base, "PC_PATH_MAX", 4096)
    long = [part for part in full.parts if len(os.fsencode(part)) > name_max]
    if long:
        return [Problem(key, f"{_short(text)}: the name {_short(long[0])} is {len(os.fsencode(long[0]))} bytes "
                        f"long; the file system at {base} allows {name_max} bytes per name.",
                        f"use names of at most {name_max} bytes, e.g. {key}="
                        f"{Path(*(x if x not in long else x[:40] for x in full.parts))}.")]
    if len(os.fsencode(str(full))) >= path_max:
        return [Problem(key, f"{_short(text)} is {len(os.fsencode(str(full)))} bytes long; the file system at "
                        f"{base} allows paths of {path_max - 1} bytes.", "use a shorter path.")]
    return []


def folder_problems(key: str, text: str) -> list[Problem]:
    """A run's or a sweep's own folder, as typed: a local path the file system can hold (not a URL)."""
    if "://" in text:
        return [Problem(key, f"{text!r} is a URL: a run's or a sweep's directory is a local folder (plans, logs, "
                        "status).", f"give a path, e.g. {key}=outputs/my_run; checkpoints may go to a URL "
                        "(training.checkpoint.dir).")]
    return path_problems(key, text)


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else f"{text[:n // 2]}...{text[-n // 4:]}")


def location_problems(url: str, writes: bool) -> list[Problem]:
    """The checkpoint URL: a known protocol, no path tricks, not a system directory, and
    (when the run saves) writable: a probe file is written, read back and removed."""
    import fsspec

    key = "training.checkpoint.dir"
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in fsspec.available_protocols():
        return [Problem(key, f"{url!r} uses the unknown protocol {protocol!r}.",
                        "use a path, file://, s3://, gs:// or another fsspec protocol that is installed.")]
    path = url.split("://", 1)[1] if "://" in url else url
    if ".." in Path(path).parts or "\n" in url or "\x00" in url:
        return [Problem(key, f"{url!r} contains '..' or a control character.", "use a plain, absolute location.")]
    if protocol in ("file", "local"):
        too_long = path_problems(key, path)
        if too_long:
            return too_long
        p = Path(path).resolve()
        if p == Path("/") or any(p == Path(d) or Path(d) in p.parents for d in SYSTEM_DIRS):
            return [Problem(key, f"{url!r} is a system location ({p}).", "point it at a directory of your own.")]
        if p.exists() and not p.is_dir():
            return [Problem(key, f"{url!r} exists and is not a directory.", "point it at a directory.")]
    try:
        fs, root = ckpt.fs_of(url)
        if not writes:
            fs.exists(root)
            return []
        fs.makedirs(root, exist_ok=True)
        probe = f"{root}/.orchestrator-probe-{uuid.uuid4().hex}"
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        with fs.open(probe, "rb") as f:
            ok = f.read() == b"ok"
        fs.rm(probe)
        if not ok:
            raise OSError("the probe file read back differently")
    except Exception as e:  # any backend's error: say where and what
        return [Problem(key, f"{url!r} is not {'writable' if writes else 'reachable'}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "),
                        "fix the permissions or credentials, or choose another location.")]
    return []


def resume_problems(spec: Config, url: str) -> list[Problem]:
    """A checkpoint this run would resume from must fit its model, batch and data. Saves whose
    meta.json cannot be read are damaged: the runtime skips them (and says so), so they are
    no reason to refuse here."""
    meta = None
    for step in ckpt.complete_steps(url):
        try:
            meta = ckpt.read_meta(url, step)
            break
        except Exception as e:  # noqa: PERF203 - damaged saves are rare
            print(f"warning: the checkpoint at step {step} in {url} has no readable meta.json "
                  f"({type(e).__name__}); it will be skipped.", file=sys.stderr)
    if meta is None:
        return []
    return [Problem(k, m + ".", "point training.checkpoint.dir at a new location, restore the setting, or allow "
                    f"the change on purpose with training.resume.allow=[{k}]" +
                    (" (or training.resume.allow_batch_change=true)" if k in ckpt.BATCH_KEYS else "") + ".")
            for k, m in ckpt.compatibility_problems(meta, to_dict(spec.model), to_dict(spec.training))]


@lru_cache(maxsize=1)
def resume_keys() -> tuple[str, ...]:
    """What `training.resume.allow` may name: every model key (but its name) and the data stream's."""
    from orchestrator.config.schema import ModelConfig

    def leaves(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            inner = [a for a in typing.get_args(t) if a is not type(None)] if typing.get_origin(t) is typing.Union else [t]
            t = inner[0] if len(inner) == 1 else t
            yield from leaves(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else [f"{prefix}{f.name}"]

    return tuple(k for k in leaves(ModelConfig, "model.") if k != "model.name") + ckpt.DATA_KEYS


def allow_problems(spec: Config) -> list[Problem]:
    """training.resume.allow entries a resume does not check would allow nothing: named, by index."""
    import difflib

    known = list(resume_keys())
    out = []
    for i, k in enumerate(spec.training.resume.allow or []):
        if k not in known:
            near = difflib.get_close_matches(str(k), known, n=1)
            out.append(Problem(f"training.resume.allow[{i}]", f"{k!r} is not a key a resume checks: it would allow "
                               "nothing.", f"did you mean {near[0]}?" if near else
                               f"name model keys (e.g. model.rope_theta) or {', '.join(known[-3:])}."))
    return out


def preflight(spec: Config, run_dir: Path) -> list[Problem]:
    """Everything a launcher checks before it starts or submits anything."""
    problems = fault_problems(spec) + allow_problems(spec)
    url = ckpt.url_for(spec.training.checkpoint.dir, run_dir)
    problems += location_problems(url, writes=spec.training.checkpoint.every > 0)
    if problems:
        return problems
    return resume_problems(spec, url)
