"""The cluster picture of a plan: where every axis' groups sit on the nodes (`cluster_scene`),
with what it drew (outlined nodes, groups, windows), so tests check behaviour, not pixels."""
from __future__ import annotations

import math

import numpy as np

from orchestrator.report.cluster_panels import BORDER, RED, axis_grid, detail_panel, footprint_panel, tier_colour
from orchestrator.report.scene import Rect, Scene, Segs, Text, page_panel, text_width


def panel_axes(plan, axes=None) -> list[str]:
    """The axes a cluster picture shows: the given ones, or every axis with degree > 1 in the
    plan's order (innermost first), expert axes only for a model with experts."""
    from orchestrator.plan.axes import AXES

    if axes is not None:
        names = [axes] if isinstance(axes, str) else list(axes)
        unknown = [a for a in names if a not in AXES]
        if unknown:
            raise ValueError(f"unknown axis {unknown}; use one of {list(AXES)}")
        return names
    d = plan.layout
    rank = {a: i for i, a in enumerate(plan.order)}
    keyed = {"edp": "dp"}
    out = [a for a in AXES if _degree(plan, a) > 1 and (AXES[a].grid == "dense" or d.ep > 1)]
    out.sort(key=lambda a: (rank.get(keyed.get(a, a), 99), AXES[a].grid != "dense"))
    return out or ["tp"]


def _degree(plan, axis: str) -> int:
    from orchestrator.plan.axes import AXES

    g = axis_grid(plan, axis)
    return int(np.prod([g.sizes[m] for m in AXES[axis].members]))


def _block(plan, axis: str) -> int:
    """The ranks [0, block) hold whole groups of this axis: the product of the grid's sizes from
    the innermost axis out to the axis' outermost member."""
    from orchestrator.plan.axes import AXES

    g = axis_grid(plan, axis)
    last = max(g.order.index(m) for m in AXES[axis].members)
    return int(np.prod([g.sizes[a] for a in g.order[: last + 1]]))


def choose_window(plan, names: list[str], max_nodes: int) -> tuple[int, list[str]]:
    """(ranks drawn in detail, the axes drawn in detail). The whole job when it has at most
    `max_nodes` nodes; otherwise the smallest block of whole nodes that holds whole groups of as
    many axes as fit in `max_nodes` (one replica for TP/CP/PP inside DP). The other axes get a
    footprint of the whole cluster instead."""
    gpn = plan.spec.hardware.gpus_per_node
    world = plan.world_size
    if world <= max_nodes * gpn:
        return world, list(names)
    window, detailed = gpn, []
    for a in sorted(names, key=lambda a: _block(plan, a)):
        cand = math.lcm(window, _block(plan, a))
        if cand <= max_nodes * gpn:
            window = cand
            detailed.append(a)
    return window, [a for a in names if a in detailed]


def _axis_title(plan, axis: str, data: dict) -> str:
    """"TP 8: 64 groups", or "DP 128 (dp8 x cp16): ..." when a group spans more than one grid axis."""
    from orchestrator.plan.axes import AXES

    members = AXES[axis].members
    g = axis_grid(plan, axis)
    parts = [m for m in members if g.sizes[m] > 1]
    inner = f" ({' x '.join(f'{m}{g.sizes[m]}' for m in parts)})" if len(parts) > 1 else ""
    return f"{axis.upper()} {data['size']:,}{inner}: {data['groups']:,} groups"


def _tier_text(plan, axis: str) -> str:
    rep = plan.axes.get(axis)
    return f"widest tier {rep.tier} ({rep.gbps:.3g} GB/s)" if rep is not None and rep.tier else ""


def cluster_scene(plan, axes=None, max_nodes: int = 64) -> tuple[Scene, dict]:
    """The cluster picture: one panel per axis (every axis with degree > 1 unless `axes` names
    some). Up to `max_nodes` nodes every node is drawn, ranks numbered where they fit; a larger
    job draws one window (a replica, or the largest block of whole groups that fits) in detail
    and, for the axes whose groups leave it, the whole cluster node by node with one group
    highlighted, with counts for the rest."""
    from orchestrator.plan.topology import tiers_for

    spec = plan.spec
    gpn, world = spec.hardware.gpus_per_node, plan.world_size
    nodes = -(-world // gpn)
    tiers = tiers_for(spec)
    names = panel_axes(plan, axes)
    window, detailed = choose_window(plan, names, max_nodes)
    rows = window // gpn
    M = 14  # margin
    cell_h = max(11.0, min(30.0, 640.0 / rows))
    cell_w = max(14.0 if gpn <= 24 else 6.0, min(48.0, 280.0 / gpn))
    node_label_w = text_width(str(rows - 1), 9) + 10
    title1 = (f"{spec.model.name} on {world:,} x {spec.hardware.name} ({nodes:,} nodes x {gpn})   "
              f"{plan.layout.label()}   order {'-'.join(plan.order)} (innermost first)")
    if window < world:
        what = "replica" if window == plan.layout.replica else "block"
        shown = f"nodes 0-{rows - 1}" if rows > 1 else "node 0"
        title2 = (f"one {what} drawn rank by rank: {shown} (ranks 0-{window - 1}) of {nodes:,} nodes; "
                  f"the other {world // window - 1:,} {what}s repeat it, shifted")
    else:
        title2 = "every node drawn: rows are nodes, columns GPUs in a node, numbers global ranks"
    items: list = [Text(M, M, title1, 13, bold=True, ha="left", va="top"), Text(M, M + 20, title2, 11,
                                                                                  "#404040", "left", "top")]
    panels, datas = [], []
    x, top = M, M + 48
    head = 34
    for a in detailed:
        panel_w = gpn * cell_w
        col_w = panel_w + node_label_w
        left = x + node_label_w
        p, data = detail_panel(plan, a, window, tiers, cell_w, cell_h, left, top + head + 14)
        line2 = f"{data['straddling_groups']:,} cross a node; {_tier_text(plan, a)}"
        if data["coloured"] < data["groups_shown"]:
            line2 += f"; first {data['coloured']} coloured"
        title = _axis_title(plan, a, data)
        col_w = max(col_w, text_width(title, 11, True), text_width(line2, 10))
        items += [Text(x, top, title, 11, bold=True, ha="left", va="top"),
                  Text(x, top + 16, line2, 10, "#404040", "left", "top")]
        grid_top = top + head + 14
        items += [Text(left + (g + 0.5) * cell_w, grid_top - 3, str(g), 9, "#606060", "center", "bottom")
                  for g in range(gpn) if cell_w >= text_width(str(g), 9) + 2]
        every = max(1, math.ceil(11 / cell_h))
        items += [Text(left - 5, grid_top + (n + 0.5) * cell_h, str(n), 9, "#606060", "right", "center")
                  for n in range(0, rows, every)]
        panels.append(p)
        datas.append(data)
        x += col_w + 26
    width = x - 26 + M if detailed else 2 * M
    y = top + (head + 14 + rows * cell_h + 22 if detailed else 0)
    for a in [a for a in names if a not in detailed]:
        p, data = footprint_panel(plan, a, window, tiers, M, y + head)
        unit = f"one cell per {data['nodes_per_cell']} nodes" if data["nodes_per_cell"] > 1 else "one cell per node"
        blocks = "".join(f", {v:,} {k}{'s' if v != 1 else ''}" for k, v in data["group0_blocks"].items())
        cross = [f"{v:,} of {data['groups']:,} groups cross a {k}" for k, v in data["crossing"].items()]
        line2 = (f"orange: the group of rank 0 ({data['size']:,} ranks on {data['group0_nodes']:,} nodes{blocks}); "
                 f"the other groups are shifted copies")
        line3 = "; ".join(cross + [_tier_text(plan, a)] + (["framed: the nodes drawn above"] if detailed else []))
        items += [Text(M, y, f"{_axis_title(plan, a, data)}, too many to draw rank by rank: all {nodes:,} nodes, "
                             f"{unit}", 11, bold=True, ha="left", va="top"),
                  Text(M, y + 16, line2, 10, "#404040", "left", "top"),
                  Text(M, y + 30, line3, 10, "#404040", "left", "top")]
        p.box = (p.box[0], p.box[1] + 14, p.box[2], p.box[3])
        panels.append(p)
        datas.append(data)
        width = max(width, M + p.box[2] + M, M + text_width(line2, 10) + M, M + text_width(line3, 10) + M)
        y += head + 14 + p.box[3] + 18
    # Legend: what the outlines and lines mean, and the tiers.
    outlines = any(d["outlined_nodes"] for d in datas)
    legend = [("rect", RED, "node holding a member of a group that spans more than one node") if outlines else
              ("none", None, "no group drawn rank by rank spans more than one node") if detailed else None,
              ("line", BORDER, "border between groups") if detailed else None]
    legend = [x for x in legend if x is not None]
    for t in tiers:
        where = (f"one node ({t.size} GPUs)" if t.size == gpn else f"{t.size:,} GPUs" if t.size < 1 << 60
                 else "between nodes")
        legend.append(("line", tier_colour(t.name), f"tier {t.name}: {where}, {t.gbps:.3g} GB/s"))
    width = max(width, M + text_width(title1, 13, True) + M, M + text_width(title2, 11) + M, 560)
    lx, ly = M, y + 4
    for kind, colour, text in legend:
        w = 26 + text_width(text, 10) + 18
        if lx + w > width - M and lx > M:
            lx, ly = M, ly + 18
        if kind == "rect":
            items.append(Rect(lx, ly, 18, 12, fill=None, edge=colour, lw=2))
        elif kind == "line":
            items.append(Segs([(lx, ly + 6, lx + 18, ly + 6)], colour, 3))
        items.append(Text(lx + 24, ly + 6, text, 10, "#202020", "left", "center"))
        lx += w
    height = ly + 18 + M
    page = page_panel(width, height)
    page.items = items
    scene = Scene(int(math.ceil(width)), int(math.ceil(height)), panels + [page])
    first = datas[0]
    data = {**{k: first[k] for k in ("axis", "nodes_shown", "outlined_nodes", "straddling_groups", "groups")},
            "panels": datas, "window_ranks": window, "detailed": detailed, "nodes": nodes,
            "tiers": [t.name for t in tiers], "size": (scene.width, scene.height)}
    return scene, data
