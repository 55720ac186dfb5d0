"""Pictures of a plan: where every axis' groups sit on the cluster (report/cluster.py) and the
step budget, predicted and measured after a run (report/step_budget.py). Each is laid out
as a scene (report/scene.py) and drawn to a PNG with Pillow (`write_figures`, what the dry
run writes, no matplotlib import) or to a matplotlib Figure (`draw_cluster`,
`draw_step_budget`, for notebooks). The scene builders also return the data they drew
(outlined nodes, groups, windows, bar heights), so tests check behaviour, not pixels.
"""
from __future__ import annotations

from pathlib import Path

from orchestrator import rundir
from orchestrator.report.cluster import cluster_scene
from orchestrator.report.scene import render_png, to_matplotlib
from orchestrator.report.step_budget import step_budget_scene


def draw_cluster(plan, axis=None, max_nodes: int = 64):
    """(matplotlib Figure, data): the cluster picture, one panel per axis (`axis` names one axis
    or a list of them; None = every axis with degree > 1). Red outlines mark the nodes that a
    group straddles; `data` holds what was drawn, the first panel's figures at its top level."""
    scene, data = cluster_scene(plan, axis, max_nodes)
    return to_matplotlib(scene), data


def draw_step_budget(plans: list, labels: list[str] | None = None, measured: dict | None = None):
    """A matplotlib Figure: one stacked bar per plan (Plan or plan.json dict) and, given
    `measured` ({median_s, p10_s, p90_s, steps}), the measured step beside them."""
    scene, _ = step_budget_scene(plans, labels, measured)
    return to_matplotlib(scene)


def write_figures(plan, out_dir: Path) -> dict[str, Path]:
    """cluster.png and step_budget.png for a valid plan (Pillow only, no matplotlib import)."""
    out_dir = Path(out_dir)
    scene, _ = cluster_scene(plan)
    out = {"cluster": render_png(scene, out_dir / rundir.CLUSTER_PNG)}
    scene, _ = step_budget_scene([plan])
    out["step_budget"] = render_png(scene, out_dir / rundir.STEP_BUDGET_PNG)
    return out


def write_step_budget(plan_json: dict, out: Path, measured: dict | None = None) -> Path:
    """step_budget.png from a run's plan.json, with the measured bar when there is one."""
    scene, _ = step_budget_scene([plan_json], measured=measured)
    return render_png(scene, Path(out))
