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
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path


def expand(args: list[str]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(args)
    return [point for batch in BasicSweeper.split_arguments(overrides, None) for point in batch]


def _resources(cfg) -> tuple:
    lc = cfg.launcher
    return (cfg.cluster.nodes, cfg.hardware.gpus_per_node, lc.time_min, lc.partition, lc.account, lc.qos,
            lc.constraint, lc.exclude, tuple(lc.setup or []), json.dumps(dict(lc.additional_parameters or {})))


def run_sweep(args: list[str]) -> int:
    from orchestrator.cli import compose, write_plan
    from orchestrator.plan import make_plan

    sweep_dir = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("hydra.sweep.dir=")), None)
    args = [a for a in args if not a.startswith(("hydra.sweep.dir=", "hydra.run.dir="))]
    sweep_dir = sweep_dir or Path("outputs/multirun") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    rows, valid = [], []
    for i, point in enumerate(expand(args)):
        row = {"point": i, "overrides": point, "dir": str(sweep_dir / str(i))}
        try:
            cfg = compose(point)
        except Exception as e:  # a bad key or value in this point: report it, plan the rest
            row.update(valid=False, errors=[{"key": "config", "message": str(e).splitlines()[0], "fix": ""}])
            rows.append(row)
            continue
        plan = make_plan(cfg)
        write_plan(plan, sweep_dir / str(i), figures=False)
        row.update(valid=plan.valid, errors=[e.to_dict() for e in plan.errors])
        if plan.degrees:
            d = plan.degrees
            row["layout"] = f"TP{d.tp} CP{d.cp} PP{d.pp} DP{d.dp}"
        if plan.valid:
            row.update(predicted_step_s=plan.step.wall_s, predicted_mfu=plan.mfu)
            valid.append((row, cfg, plan))
        rows.append(row)
    _print_table(rows)
    launcher = valid[0][1].launcher.name if valid else "dry"
    summary = {"sweep_dir": str(sweep_dir), "launcher": launcher, "points": rows}
    _write(sweep_dir, summary)
    if not valid:
        print("\nno valid point: nothing was submitted.", file=sys.stderr)
        return 2
    if launcher == "slurm":
        return _submit_slurm(valid, sweep_dir, summary)
    if launcher == "local":
        from orchestrator.launch.failover import run_with_failover

        code = 0
        for row, cfg, plan in valid:
            code = run_with_failover(cfg, plan, Path(row["dir"])) or code
            _measure(row)
        _write(sweep_dir, summary)
        _print_table(rows)
        return code
    return 0


def _submit_slurm(valid, sweep_dir: Path, summary: dict) -> int:
    from orchestrator.launch.failover import preflight
    from orchestrator.launch.slurm import TrainingJob, make_executor, safety_problems

    problems = [p for _, cfg, _ in valid for p in safety_problems(cfg.launcher)]
    problems += [p for row, cfg, _ in valid for p in preflight(cfg, Path(row["dir"]))]
    if problems:
        print("\nREJECTED: nothing was submitted.", file=sys.stderr)
        for p in dict.fromkeys(str(p) for p in problems):
            print(f"  - {p}", file=sys.stderr)
        return 2
    groups: dict[tuple, list] = {}
    for item in valid:
        groups.setdefault(_resources(item[1]), []).append(item)
    jobs = []
    for g, items in enumerate(groups.values()):
        cfg = items[0][1]
        ex = make_executor(cfg, sweep_dir / "slurm" / f"group{g}")
        with ex.batch():  # one job array for the points that share resources
            submitted = [ex.submit(TrainingJob(row["dir"], row["dir"], 0, cfg.launcher.max_requeues))
                         for row, _, _ in items]
        for (row, _, _), job in zip(items, submitted):
            row["job_id"] = job.job_id
            jobs.append((row, job))
        print(f"submitted job array {submitted[0].job_id.split('_')[0]} with {len(items)} point(s)", flush=True)
    _write(sweep_dir, summary)
    if not valid[0][1].launcher.wait:
        print(f"sweep summary: {sweep_dir / 'sweep.json'}")
        return 0
    code = 0
    for row, job in jobs:
        while job.watcher.get_state(job.job_id, mode="force") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING",
                                                                    "CONFIGURING", "UNKNOWN", "SUSPENDED"):
            time.sleep(2)
        row["state"] = job.watcher.get_state(job.job_id, mode="force")
        code = code or (0 if row["state"] == "COMPLETED" else 1)
        _measure(row)
    _write(sweep_dir, summary)
    _print_table(summary["points"])
    print(f"sweep summary: {sweep_dir / 'sweep.json'}")
    return code


def _measure(row: dict) -> None:
    m = Path(row["dir"]) / "metrics.json"
    if not m.exists():
        return
    metrics = json.loads(m.read_text())
    plan = json.loads((Path(row["dir"]) / "plan.json").read_text())
    steps = metrics["step_time_s"][1:] or metrics["step_time_s"]
    step = statistics.median(steps)
    row["measured_step_s"] = step
    row["measured_mfu"] = plan["model_flops_per_step"] / (plan["world_size"] * plan["config"]["hardware"]
                                                          ["peak_tflops"] * 1e12 * step)
    row["final_loss"] = metrics["loss"][-1]


def _write(sweep_dir: Path, summary: dict) -> None:
    (sweep_dir / "sweep.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")


def _print_table(rows: list[dict]) -> None:
    varying = {o.split("=", 1)[0] for r in rows for o in r["overrides"]
               if sum(o in x["overrides"] for x in rows) < len(rows)}
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
