"""What a plan leaves in its run directory (plan.json, plan.md, the pictures) and, after a
run, what is measured against it (`write_measured`). Torch-free: the launcher calls both."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir import read_steps  # noqa: F401 (the run's steps, read where the run dir is owned)


def write_plan(plan, out_dir: Path, figures: bool = True, command: list[str] | None = None,
               overrides: list[str] | None = None) -> dict[str, Path]:
    """plan.json, plan.md and (optionally) the figures, next to each other.

    `command` is the argv to record in plan.md (`orchestrate` is put in front when it is
    missing); `overrides` the key=value list it amounts to (default: the key=value words of
    `command`; give them when the command does not spell them, as `orchestrate-runs resume`)."""
    from orchestrator.plan.report import render_markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = bool(figures and plan.valid and plan.layout is not None)
    paths = {"json": out_dir / rundir.PLAN_JSON, "md": out_dir / rundir.PLAN_MD}
    paths["json"].write_text(rundir.dumps(plan.to_json(), indent=2) + "\n")  # strict: a non-finite figure is null
    paths["md"].write_text(render_markdown(plan, command, overrides, figures=drawn))
    if drawn:
        from orchestrator.plan.figures import write_figures

        paths.update(write_figures(plan, out_dir))
    return paths


# ----------------------------------------------------------------------------- measured

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
STEP_PARTS = {"compute": ("compute",), "tp": ("tp",), "cp": ("cp", "ep"), "dp": ("dp_exposed",),
              "pp": ("pp_bubble", "p2p")}


def measured_parts(plan: dict, profile: dict) -> list[dict]:
    """One row per part of the step: predicted (plan.json's wall_* parts) against measured (the
    profiled step's), seconds and the profiled step's outermost regions of that part."""
    step = plan.get("step") or {}
    rows = []
    for part, keys in STEP_PARTS.items():
        rows.append({"part": part, "predicted_s": sum(step.get("wall_" + k, 0.0) for k in keys),
                     "measured_s": profile["parts_s"].get(part, 0.0), "regions": profile["regions"].get(part, 0)})
    rows.append({"part": "step", "predicted_s": step.get("wall_s", 0.0), "measured_s": profile["step_s"],
                 "regions": None, "profiled_step": profile.get("step")})
    return rows


def measured_rows(run_dir: Path) -> list[dict]:
    """One row per attempt: the steps it ran (counted or later redone) against the plan it ran."""
    from orchestrator.plan.metrics import measured_mfu

    run_dir = Path(run_dir)
    steps = read_steps(run_dir, latest=False)
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


def write_measured(run_dir: Path, figures: bool | None = None) -> dict | None:
    """After a run: add the measured-vs-predicted section to plan.md (replacing an earlier one)
    and redraw step_budget.png with the measured bar beside the predicted one. `figures=None`
    redraws it when write_plan drew one (figures=false runs stay without pictures). Returns
    the last attempt's row and a one-line summary (`line`) for the console, or None when the
    run measured no step."""
    from orchestrator.plan.report import MEASURED_END, MEASURED_START, render_measured

    run_dir = Path(run_dir)
    if not (run_dir / rundir.PLAN_JSON).exists():
        return None
    rows = measured_rows(run_dir)
    if not rows:
        return None
    last = rows[-1]
    md = run_dir / rundir.PLAN_MD
    text = md.read_text() if md.exists() else "# Plan\n"
    if MEASURED_START in text:
        head, _, rest = text.partition(MEASURED_START)
        text = head + (rest.partition(MEASURED_END)[2].lstrip("\n"))
    plan = attempt_plan(run_dir, last["attempt"])
    prof = run_dir / rundir.PROFILE_JSON
    parts = measured_parts(plan, json.loads(prof.read_text())) if prof.exists() else None
    md.write_text(text.rstrip("\n") + "\n\n" + render_measured(rows, last["device"], parts))
    if figures is None:  # redraw the picture the plan left, if it left one
        figures = (run_dir / rundir.STEP_BUDGET_PNG).exists()
    out = dict(last, plan_md=md)
    if figures and plan.get("valid"):
        from orchestrator.plan.figures import write_step_budget

        label = "measured" + (f" (attempt {last['attempt']})" if last["attempt"] else "")
        out["step_budget"] = write_step_budget(plan, run_dir / rundir.STEP_BUDGET_PNG, measured=dict(last, label=label))
    from orchestrator.plan.figures import fmt_time

    out["line"] = (f"measured {fmt_time(last['median_s'])} per step (median of {last['steps']}) vs predicted "
                   f"{fmt_time(last['predicted_s'])} on hardware={last['hardware']}: {last['ratio']:.2f}x "
                   f"(details in {md})")
    return out
