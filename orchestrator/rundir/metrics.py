"""Measured against predicted: the one formula for a measured MFU, the spread of one attempt's
steps, and one row per attempt (its steps against the plan it ran). Torch-free."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator import rundir


def measured_mfu(plan_json: dict, step_s: float) -> float:
    """Model FLOPs of one step over (GPUs x peak x the measured step time)."""
    peak = plan_json["config"]["hardware"]["peak_tflops"] * 1e12
    return plan_json["model_flops_per_step"] / (plan_json["world_size"] * peak * step_s)


def step_stats(times: list[float], warmup: int = rundir.WARMUP_STEPS) -> dict:
    """Median and p10/p90 of one attempt's step times after the warm-up (rundir.measured)."""
    if not times:
        raise ValueError("no measured step times")
    kept = rundir.measured(times, warmup)
    q = sorted(kept)

    def pct(p: float) -> float:
        i = p * (len(q) - 1)
        lo = int(i)
        return q[lo] + (q[min(lo + 1, len(q) - 1)] - q[lo]) * (i - lo)

    return {"median_s": rundir.measured_step_s(times, warmup), "p10_s": pct(0.1), "p90_s": pct(0.9), "mean_s": sum(kept) / len(kept),
            "steps": len(kept), "warmup_steps": len(times) - len(kept)}


def attempt_plan(run_dir: Path, attempt: int) -> dict:
    """The plan an attempt ran: attemptN/plan.json after a failover re-plan, else plan.json."""
    return json.loads(rundir.attempt_plan_path(run_dir, attempt).read_text())


# The profiled parts of a step (train/profile.py) and the plan's parts each is measured against.
PROFILED_PARTS = {"compute": ("compute",), "tp": ("tp",), "cp": ("cp", "ep"), "dp": ("dp_exposed",),
                  "pp": ("pp_bubble", "p2p")}


def measured_parts(plan: dict, profile: dict) -> list[dict]:
    """One row per part of the step: predicted (plan.json's wall_* parts) against measured (the
    profiled step's), seconds and the profiled step's outermost regions of that part."""
    step = plan.get("step") or {}
    rows = []
    for part, keys in PROFILED_PARTS.items():
        rows.append({"part": part, "predicted_s": sum(step.get("wall_" + k, 0.0) for k in keys),
                     "measured_s": profile["parts_s"].get(part, 0.0), "regions": profile["regions"].get(part, 0)})
    rows.append({"part": "step", "predicted_s": step.get("wall_s", 0.0), "measured_s": profile["step_s"],
                 "regions": None, "profiled_step": profile.get("step")})
    return rows


def measured_rows(run_dir: Path) -> list[dict]:
    """One row per attempt: the steps it ran (counted or later redone) against the plan it ran."""
    run_dir = Path(run_dir)
    steps = rundir.read_steps(run_dir, latest=False)
    attempts: dict[int, list[dict]] = {}
    for rec in steps:
        attempts.setdefault(int(rec.get("attempt", 0)), []).append(rec)
    rows = []
    for attempt, recs in sorted(attempts.items()):
        plan = attempt_plan(run_dir, attempt)
        if not plan.get("step"):
            continue
        stats = step_stats([float(r["step_time_s"]) for r in rundir.timed(recs)])
        hw = plan["config"]["hardware"]
        tr = plan["config"]["training"]
        losses = [r.get("loss") for r in recs if r.get("loss") is not None]
        predicted = plan["step"]["wall_s"]
        rows.append({
            "attempt": attempt, "layout": plan["layout"]["label"], **stats,
            "first_step": recs[0].get("step"), "predicted_s": predicted, "ratio": stats["median_s"] / predicted,
            "measured_mfu": measured_mfu(plan, stats["median_s"]), "predicted_mfu": plan["mfu"],
            "tokens_per_s": tr["global_batch"] * tr["seq_len"] / stats["median_s"],
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "hardware": hw["name"], "kernel_efficiency": hw["kernel_efficiency"], "device": hw.get("device", "cuda"),
        })
    return rows
