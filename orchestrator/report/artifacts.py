"""What a plan leaves in its run directory (plan.json, plan.md, the pictures) and, after a
run, what is measured against it (`write_measured`: plan.md's measured section and the
measured bar; the rows come from rundir.metrics). Torch-free: the launcher calls both."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir.metrics import attempt_plan, measured_parts, measured_rows


def write_plan(plan, out_dir: Path, figures: bool = True, command: list[str] | None = None,
               overrides: list[str] | None = None) -> dict[str, Path]:
    """plan.json, plan.md and (optionally) the figures, next to each other.

    `command` is the argv to record in plan.md (`orchestrate` is put in front when it is
    missing); `overrides` the key=value list it amounts to (default: the key=value words of
    `command`; give them when the command does not spell them, as `orchestrate-runs resume`)."""
    from orchestrator.report.markdown import render_markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = bool(figures and plan.valid and plan.layout is not None)
    paths = {"json": out_dir / rundir.PLAN_JSON, "md": out_dir / rundir.PLAN_MD}
    paths["json"].write_text(rundir.dumps(plan.to_json(), indent=2) + "\n")  # strict: a non-finite figure is null
    paths["md"].write_text(render_markdown(plan, command, overrides, figures=drawn))
    if drawn:
        from orchestrator.report.figures import write_figures

        paths.update(write_figures(plan, out_dir))
    return paths


def write_measured(run_dir: Path, figures: bool | None = None) -> dict | None:
    """After a run: add the measured-vs-predicted section to plan.md (replacing an earlier one)
    and redraw step_budget.png with the measured bar beside the predicted one. `figures=None`
    redraws it when write_plan drew one (figures=false runs stay without pictures). Returns
    the last attempt's row and a one-line summary (`line`) for the console, or None when the
    run measured no step."""
    from orchestrator.report.markdown import MEASURED_END, MEASURED_START, render_measured

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
        from orchestrator.report.figures import write_step_budget

        label = "measured" + (f" (attempt {last['attempt']})" if last["attempt"] else "")
        out["step_budget"] = write_step_budget(plan, run_dir / rundir.STEP_BUDGET_PNG, measured=dict(last, label=label))
    from orchestrator.report.step_budget import fmt_time

    out["line"] = (f"measured {fmt_time(last['median_s'])} per step (median of {last['steps']}) vs predicted "
                   f"{fmt_time(last['predicted_s'])} on hardware={last['hardware']}: {last['ratio']:.2f}x "
                   f"(details in {md})")
    return out
