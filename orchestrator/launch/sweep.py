"""`orchestrate -m ...`: sweeps that never waste the queue.

Hydra's sweep syntax (`layout.tp=2,4,8`, `range(...)`, `choice(...)`) is expanded
with Hydra's own BasicSweeper, then every point is composed and planned before
anything is submitted. Invalid points are reported in one table with their
reasons and never submitted. Valid points go to the configured launcher: with
SLURM, points that share their resources (nodes, tasks, time, partition...)
go in one job array, others in their own. `sweep.json` in the sweep directory
holds every point, its predicted step time and MFU and, once its job has
finished (`launcher.wait=true`), the measured ones.
"""
from __future__ import annotations

import json
import math
import sys
from datetime import datetime
from pathlib import Path

from orchestrator import rundir

MAX_POINTS = 100_000  # a sweep plans every point: beyond this it would not end (layout=auto searches instead)


def expand(args: list[str], config_dir: str | None = None) -> list[list[str]]:
    """The sweep's points, each a list of overrides, exactly as Hydra's BasicSweeper makes them
    for `@hydra.main` with `-m`: Hydra's parser with the config loader (so `glob(...)` lists a
    config group's options, the site's `--config-dir` ones too), then BasicSweeper.split_arguments
    (a key given twice keeps its first place and its last value). The `hydra.*` overrides are
    Hydra's, not a point's. Raises ConfigError where Hydra refuses the sweep (a parse error,
    `interval(...)`, sweeping Hydra's own config) and where a sweep would have no point."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    from orchestrator.config.compose import hydra_app, parse_problem
    from orchestrator.config.errors import ConfigError, Problem

    parser = OverridesParser.create(config_loader=hydra_app(config_dir).config_loader)
    try:
        overrides = parser.parse_overrides(list(args))
    except OverrideParseException as e:
        raise ConfigError([parse_problem(e)]) from None
    problems = [Problem(o.key_or_group, f"Sweeping over Hydra's configuration is not supported : {o.input_line!r}.",
                        f"give {o.key_or_group} one value (each point's run directory is hydra.sweep.dir/<point>).")
                for o in overrides if o.is_hydra_override() and o.is_sweep_override()]
    task = [o for o in overrides if not o.is_hydra_override()]
    for o in task:
        if o.is_sweep_override() and not o.is_discrete_sweep():
            try:
                BasicSweeper.split_arguments([o], None)
                refusal = f"{o.value_type.name} cannot be enumerated"
            except HydraException as e:  # Hydra's own words
                refusal = str(e)
            problems.append(Problem(o.get_key_element().lstrip("+~"), f"{o.input_line!r}: {refusal}: interval(a,b) "
                                    "is a continuous range, for sweepers that search (Optuna, Nevergrad), not a list "
                                    "of points.", "list the points: choice(a,b,...) or range(start,stop,step)."))
    if problems:
        raise ConfigError(problems)
    sizes = {o.get_key_element(): _size(o) for o in task}  # a key given twice: its last value counts
    if math.prod(sizes.values()) > MAX_POINTS:
        swept = {k: n for k, n in sizes.items() if n != 1}
        total = math.prod(swept.values())
        count = "infinitely many" if math.isinf(total) else f"{total:,}"
        if len(swept) > 1:
            count = f"{' x '.join('infinitely many' if math.isinf(n) else f'{n:,}' for n in swept.values())} = {count}"
        raise ConfigError([Problem(", ".join(k.lstrip("+~") for k in swept), f"the sweep would have {count} points, "
                                   f"more than {MAX_POINTS:,} can be planned.",
                                   "narrow the ranges (range(start,stop,step) with a larger step), or let layout=auto "
                                   "search the layouts.")])
    try:
        points = [point for batch in BasicSweeper.split_arguments(task, None) for point in batch]
    except (ValueError, ArithmeticError, HydraException) as e:  # e.g. range(1,5,0): Hydra's words, on the expression
        bad = next((o for o in task if o.is_sweep_override() and _raises(o)), None)
        why = "start, stop and step must be finite numbers" if isinstance(e, ArithmeticError) else e
        raise ConfigError([Problem(bad.get_key_element().lstrip("+~") if bad else "command line",
                                   f"{bad.input_line if bad else ' '.join(args)!r}: {why}.",
                                   "a range needs a non-zero step that goes from start towards stop: "
                                   "range(1,8,2), range(8,0,-2).")]) from None
    if not points:  # Hydra would launch nothing, silently: say which expression gave no value
        raise ConfigError([_no_point(o, parser) for o in task if o.is_sweep_override()
                           and not list(o.sweep_string_iterator())] or
                          [Problem("command line", "the sweep has no point.", "give each swept key a value.")])
    return points


def _size(o) -> float:
    """How many values a sweep expression gives, counted without listing them (nor shuffling)."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    v = o.value() if o.is_sweep_override() else None
    if isinstance(v, ChoiceSweep):
        return len(v.list)
    if isinstance(v, RangeSweep):
        try:
            n = (v.stop - v.start) / v.step
        except (ArithmeticError, TypeError):
            return 1  # listing it says what is wrong
        return max(math.ceil(n), 0) if math.isfinite(n) else (math.inf if n > 0 else 0)
    return 1


def _raises(o) -> bool:
    try:
        list(o.sweep_string_iterator())
    except Exception:  # noqa: BLE001 - which expression Hydra cannot list
        return True
    return False


def _no_point(o, parser):
    """A sweep expression that gives no value (a glob matching no option, an empty range)."""
    from hydra.core.object_type import ObjectType
    from hydra.core.override_parser.types import ValueType

    from orchestrator.config.errors import Problem

    key = o.get_key_element().lstrip("+~")
    if o.value_type == ValueType.GLOB_CHOICE_SWEEP:
        options = sorted(parser.config_loader.get_group_options(o.key_or_group, results_filter=ObjectType.CONFIG))
        if not options:
            return Problem(key, f"{o.input_line!r}: glob(...) chooses among a config group's options, and "
                           f"{o.key_or_group} is not a config group.",
                           f"list the values: {o.key_or_group}=a,b or range(start,stop,step).")
        return Problem(key, f"{o.input_line!r} matches none of {o.key_or_group}'s options {options}: the sweep "
                       "would have no point.", f"use a pattern that matches one of {options}.")
    return Problem(key, f"{o.input_line!r} gives no value: the sweep would have no point.",
                   "give at least one value (a descending range needs a negative step: range(8,0,-2)).")


def run_sweep(args: list[str], config_dir: str | None = None, config_name: str = "config") -> int:
    from orchestrator.config.errors import ConfigError, Problem, print_rejection

    try:
        points = expand(args, config_dir)
    except ConfigError as e:
        return print_rejection(e.problems, "planned or launched")
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from orchestrator.launch.preflight import folder_problems

    given = [o.value() for o in OverridesParser.create().parse_overrides([a for a in args if a.startswith(
        "hydra.sweep.dir=")])]  # as Hydra reads it (quotes removed); parsed above already
    sweep_dir = str(given[-1]) if given else str(Path("outputs/multirun") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))
    refused = folder_problems("hydra.sweep.dir", sweep_dir)
    sweep_dir = Path(sweep_dir)
    if not refused:
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where a folder should be, no permission, a read-only file system
            refused = [Problem("hydra.sweep.dir", f"{str(sweep_dir)!r} cannot be created: {e.strerror or e}.",
                               "choose a directory you can write, e.g. hydra.sweep.dir=outputs/my_sweep.")]
    if refused:
        return print_rejection(refused, "planned or launched")
    rows, valid = plan_points(points, sweep_dir, config_dir, config_name)
    print_table(rows)
    launcher = valid[0][1].spec.launcher.name.value if valid else "dry"
    summary = {"sweep_dir": str(sweep_dir), "launcher": launcher, "points": rows}
    write_summary(sweep_dir, summary)
    print(f"sweep summary: {sweep_dir / rundir.SWEEP_JSON}")
    if not valid:
        print("\nno valid point: nothing was submitted.", file=sys.stderr)
        return rundir.EXIT_REJECTED
    if launcher == "slurm":
        return _submit_slurm(valid, sweep_dir, summary)
    if launcher == "local":
        return _run_local(valid, sweep_dir, summary)
    return rundir.EXIT_OK


def plan_points(points: list[list[str]], sweep_dir: Path, config_dir: str | None = None,
                config_name: str = "config") -> tuple[list[dict], list]:
    """Plan every point (each into sweep_dir/<i>/plan.json): the rows of sweep.json, and the
    (row, plan) of the valid ones. Hydra composes once per choice of config groups
    (config/points.py); a point's bad key or value is its row's error, the rest are planned."""
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.points import Points
    from orchestrator.plan import make_plan
    from orchestrator.report.artifacts import write_plan

    configs = Points(config_dir, config_name)
    rows, valid = [], []
    for i, point in enumerate(points):
        row = {"point": i, "overrides": point, "dir": str(sweep_dir / str(i))}
        rows.append(row)
        try:
            spec = configs.typed(point)
        except ConfigError as e:  # a bad key or value in this point: report it, plan the rest
            row.update(valid=False, errors=[p.to_dict() for p in e.problems])
            continue
        plan = make_plan(spec)
        write_plan(plan, sweep_dir / str(i), figures=False)
        row.update(valid=plan.valid, errors=[e.to_dict() for e in plan.errors])
        if plan.layout:
            row["layout"] = plan.layout.label()
        if plan.valid:
            row.update(predicted_step_s=plan.step.wall_s, predicted_mfu=plan.mfu)
            valid.append((row, plan))
    return rows, valid


def _run_local(valid, sweep_dir: Path, summary: dict) -> int:
    from orchestrator.launch.base import launcher_for

    code = 0
    for row, plan in valid:
        code = launcher_for(plan, Path(row["dir"])).submit() or code
        measure(row)
    write_summary(sweep_dir, summary)
    print_table(summary["points"])
    print(f"sweep summary: {sweep_dir / rundir.SWEEP_JSON}")
    return code


def _submit_slurm(valid, sweep_dir: Path, summary: dict) -> int:
    """Sweep points that share their resources go in one job array, one supervisor per point."""
    from orchestrator.config.errors import print_rejection
    from orchestrator.launch.base import launcher_for
    from orchestrator.launch.slurm import make_executor, snapshot, submit_jobs

    problems = [p for row, plan in valid for p in launcher_for(plan, Path(row["dir"])).preflight()]
    if problems:
        return print_rejection(problems, "submitted")
    if not valid[0][1].spec.launcher.submit:  # preview: each point's batch script and srun line
        for row, plan in valid:
            launcher_for(plan, Path(row["dir"])).submit()
        return rundir.EXIT_OK
    groups: dict[str, list] = {}
    for row, plan in valid:
        key = json.dumps([plan.spec.cluster.nodes, plan.spec.hardware.gpus_per_node,
                          {k: v for k, v in vars(plan.spec.launcher).items() if k != "job_name"}], default=str)
        groups.setdefault(key, []).append((row, plan))
    code_dir = snapshot(sweep_dir)[0] if valid[0][1].spec.launcher.snapshot else None
    jobs = []
    for g, items in enumerate(groups.values()):
        folder = sweep_dir / rundir.SLURM_DIR / f"group{g}"
        ids = submit_jobs(make_executor(items[0][1].spec, folder), [(plan.spec, Path(row["dir"])) for row, plan in items],
                          folder, code_dir)  # one job array for the points that share resources
        for (row, _), job_id in zip(items, ids):
            row["job_id"] = job_id
            jobs.append(row)
        print(f"submitted job array {ids[0].split('_')[0]} with {len(items)} point(s)", flush=True)
    write_summary(sweep_dir, summary)
    if not valid[0][1].spec.launcher.wait:
        print(f"sweep summary: {sweep_dir / rundir.SWEEP_JSON}")
        return rundir.EXIT_OK
    from orchestrator.launch.runs import wait_for

    code = rundir.EXIT_OK
    for row in jobs:
        row["state"] = wait_for(Path(row["dir"]))
        code = code or (rundir.EXIT_OK if row["state"] == "completed" else rundir.EXIT_FAILED)
        measure(row)
    write_summary(sweep_dir, summary)
    print_table(summary["points"])
    print(f"sweep summary: {sweep_dir / rundir.SWEEP_JSON}")
    return code


def measure(row: dict) -> None:
    """A finished point's measured step time and MFU, next to its prediction."""
    from orchestrator.rundir.metrics import measured_mfu

    times = rundir.last_attempt_times(Path(row["dir"]))
    if not times:
        return
    plan = json.loads((Path(row["dir"]) / rundir.PLAN_JSON).read_text())
    step = rundir.measured_step_s(times)
    loss = [r.get("loss") for r in rundir.read_steps(Path(row["dir"])) if r.get("loss") is not None]
    row.update(measured_step_s=step, measured_mfu=measured_mfu(plan, step), final_loss=loss[-1] if loss else None)


def write_summary(sweep_dir: Path, summary: dict) -> None:
    rundir.write_json(sweep_dir / rundir.SWEEP_JSON, summary, default=str)


def print_table(rows: list[dict]) -> None:
    from collections import Counter

    seen = Counter(o for r in rows for o in dict.fromkeys(r["overrides"]))
    varying = {o.split("=", 1)[0] for o, n in seen.items() if n < len(rows)}
    print(f"\n{'#':>3} {'ok':<4} {'layout':<20} {'pred step':>10} {'pred MFU':>9} {'meas step':>10} {'meas MFU':>9}  "
          f"overrides / reason")
    for r in rows:
        ov = " ".join(o for o in r["overrides"] if o.split("=", 1)[0] in varying)
        if r["valid"]:
            meas = (f"{r['measured_step_s']:10.3f} {r['measured_mfu']:9.2%}" if "measured_step_s" in r
                    else f"{'':>10} {'':>9}")
            print(f"{r['point']:>3} {'yes':<4} {r.get('layout', ''):<20} {r['predicted_step_s']:10.3f} "
                  f"{r['predicted_mfu']:9.2%} {meas}  {ov}")
        else:
            why = "; ".join(f"[{e['key']}] {e['message']}" for e in r["errors"])
            print(f"{r['point']:>3} {'NO':<4} {r.get('layout', ''):<20} {'':>10} {'':>9} {'':>10} {'':>9}  {ov}"
                  f"\n{'':>9}-> {why}")
