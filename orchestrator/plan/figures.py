"""Pictures of a plan (seed 1's figure): the cluster coloured by group, and the step budget.

`draw_cluster` returns the figure and the data it drew, so tests check what is
outlined from the data, not from pixels.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from orchestrator.plan.report import STEP_PARTS

COLOURS = {"compute": "#4c72b0", "tp": "#dd8452", "cp": "#937860", "ep": "#8172b3", "pp_bubble": "#c44e52",
           "p2p": "#da8bc3", "dp_exposed": "#55a868"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_cluster(plan, axis: str = "tp", max_nodes: int = 64):
    """Nodes as rows, GPUs as columns, coloured by the groups of `axis`; every node a
    group straddles is outlined in red. Large clusters show their first `max_nodes` nodes."""
    from orchestrator.plan.axes import AXES

    plt = _plt()
    spec = AXES[axis]
    grid = plan.grid() if spec.grid == "dense" else plan.expert_grid()
    gpn = plan.spec.hardware.gpus_per_node
    world = grid.world
    nodes = -(-world // gpn)
    shown = min(nodes, max_nodes)
    groups = grid.groups(spec.members)
    group_of = np.empty(world, dtype=np.int64)
    for gi, members in enumerate(groups):
        group_of[members] = gi
    straddle = (groups // gpn).min(axis=1) != (groups // gpn).max(axis=1)
    outlined = sorted({int(n) for gi in np.nonzero(straddle)[0] for n in np.unique(groups[gi] // gpn)})
    outlined_shown = [n for n in outlined if n < shown]

    fig, ax = plt.subplots(figsize=(max(5.5, gpn * 0.45 + 1.5), max(2.5, shown * 0.28 + 1.4)))
    img = np.full((shown, gpn), np.nan)
    for n in range(shown):
        for g in range(gpn):
            r = n * gpn + g
            if r < world:
                img[n, g] = group_of[r]
    cmap = plt.get_cmap("tab20")
    ax.imshow(img % 20, cmap=cmap, vmin=0, vmax=19, aspect="auto", interpolation="nearest")
    from matplotlib.patches import Rectangle

    for n in outlined_shown:
        ax.add_patch(Rectangle((-0.5, n - 0.5), gpn, 1, fill=False, edgecolor="red", linewidth=2.0,
                               label="straddled" if n == outlined_shown[0] else None))
    ax.set_xlabel("GPU in node")
    ax.set_ylabel("node")
    ax.set_title(f"{axis.upper()} groups (size {groups.shape[1]}), "
                 f"order {'-'.join(plan.order)}\nred outline = a node that a group straddles"
                 + (f" (first {shown} of {nodes} nodes)" if shown < nodes else ""), fontsize=8)
    ax.set_xticks(range(gpn))
    ax.set_yticks(range(0, shown, max(1, shown // 16)))
    fig.tight_layout()
    data = {"axis": axis, "nodes_shown": shown, "outlined_nodes": outlined_shown,
            "straddling_groups": int(straddle.sum()), "groups": len(groups)}
    return fig, data


def draw_step_budget(plans: list, labels: list[str] | None = None):
    """One stacked bar per plan: arithmetic, TP, CP, EP, bubble, P2P, exposed DP."""
    plt = _plt()
    labels = labels or [_label(p) for p in plans]
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(plans) + 2), 4))
    bottoms = np.zeros(len(plans))
    for key, name in STEP_PARTS:
        vals = np.array([getattr(p.step, key) if p.step else 0.0 for p in plans])
        if not vals.any():
            continue
        ax.bar(labels, vals, bottom=bottoms, label=name, color=COLOURS.get(key))
        bottoms += vals
    ax.set_ylabel("seconds per step (roofline)")
    ax.set_title("step-time budget")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def _label(p) -> str:
    return p.layout.label() if p.layout else "invalid"


def write_figures(plan, out_dir: Path) -> dict[str, Path]:
    plt = _plt()
    out = {}
    fig, _ = draw_cluster(plan, "tp")
    out["cluster"] = out_dir / "cluster.png"
    fig.savefig(out["cluster"], dpi=90)
    plt.close(fig)
    fig = draw_step_budget([plan])
    out["step_budget"] = out_dir / "step_budget.png"
    fig.savefig(out["step_budget"], dpi=90)
    plt.close(fig)
    return out
