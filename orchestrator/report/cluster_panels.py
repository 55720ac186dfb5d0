"""The panels of the cluster picture: one axis' groups drawn rank by rank over a window of
nodes (`detail_panel`), or the whole cluster node by node with the group of rank 0
highlighted (`footprint_panel`), and the colours they share with the legend."""
from __future__ import annotations

import math

import numpy as np

from orchestrator.report.scene import Panel, Rect, Segs, Text, text_width

# Light qualitative colours (ColorBrewer Set3 without its red, which marks straddled nodes):
# black rank numbers stay readable on every one.
GROUP_COLOURS = ("#8dd3c7", "#ffffb3", "#bebada", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#d9d9d9",
                 "#bc80bd", "#ccebc5", "#ffed6f")
RED = "#ff0000"
BORDER = "#303030"
HIGHLIGHT = "#e6550d"
PALE = "#f0f0f0"
TIER_COLOURS = {"nvlink": "#2ca02c", "rack": "#1f77b4", "pod": "#9467bd", "cluster": "#8c564b",
                "network": "#7f7f7f"}


def tier_colour(name: str) -> str:
    return TIER_COLOURS.get(name, "#17becf")


def axis_grid(plan, axis: str):
    from orchestrator.plan.axes import AXES

    return plan.grid() if AXES[axis].grid == "dense" else plan.expert_grid()


def _colour_groups(group_of: np.ndarray) -> list[str]:
    """A colour per group such that groups that touch (left-right or up-down) differ."""
    n = int(group_of.max()) + 1 if group_of.size else 0
    near: list[set] = [set() for _ in range(n)]
    for a, b in ((group_of[:, :-1], group_of[:, 1:]), (group_of[:-1, :], group_of[1:, :])):
        diff = (a != b) & (a >= 0) & (b >= 0)
        for x, y in zip(a[diff].tolist(), b[diff].tolist()):
            near[x].add(y)
            near[y].add(x)
    K = len(GROUP_COLOURS)
    chosen = [-1] * n
    for gi in range(n):
        used = {chosen[j] for j in near[gi] if chosen[j] >= 0}
        chosen[gi] = next(((gi + k) % K for k in range(K) if (gi + k) % K not in used), gi % K)
    return [GROUP_COLOURS[c] for c in chosen]


def _tier_lines(tiers, gpn: int, rows: int) -> list[tuple]:
    """(tier, row boundary) for every tier block edge that falls between node rows."""
    out = []
    for t in tiers[1:] if tiers[0].size == gpn else tiers:
        if t.size % gpn or t.size // gpn >= rows:
            continue
        per = t.size // gpn
        out += [(t, r) for r in range(per, rows, per)]
    return out


def detail_panel(plan, axis: str, window: int, tiers, cell_w: float, cell_h: float, left: float, top: float):
    """Nodes as rows and GPUs as columns of the drawn window, coloured by the axis' groups."""
    from orchestrator.plan.axes import AXES

    gpn = plan.spec.hardware.gpus_per_node
    rows = window // gpn
    groups = axis_grid(plan, axis).groups(AXES[axis].members)
    inside = groups[groups.max(axis=1) < window]
    group_of = np.full(window, -1, dtype=np.int64)
    for gi, members in enumerate(inside):
        group_of[members] = gi
    cells = group_of.reshape(rows, gpn)
    node_sets = inside // gpn
    straddle = node_sets.min(axis=1) != node_sets.max(axis=1)
    outlined = sorted({int(n) for gi in np.nonzero(straddle)[0] for n in set(node_sets[gi].tolist())})
    K = len(GROUP_COLOURS)
    # Groups that are not one block of cells can only be told apart by colour: when there are
    # more of them than colours, colour the first K and leave the rest (the same pattern) grey.
    scattered = len(inside) > K and not _contiguous(cells, len(inside))
    colours = list(GROUP_COLOURS[:K]) + [PALE] * (len(inside) - K) if scattered else _colour_groups(cells)

    panel = Panel((left, top, gpn * cell_w, rows * cell_h), (-0.5, gpn - 0.5), (-0.5, rows - 0.5), name=axis)
    items = panel.items
    for n in range(rows):
        for g in range(gpn):
            gi = cells[n, g]
            items.append(Rect(g - 0.5, n - 0.5, 1, 1, fill=colours[gi] if gi >= 0 else "#ffffff",
                              edge="#ffffff" if min(cell_w, cell_h) >= 8 else None))
    label = max(7.0, min(11.0, cell_h - 3))
    if cell_w >= text_width(str(window - 1), label) + 3 and cell_h >= label + 1:
        items += [Text(g, n, str(n * gpn + g), label, "#202020") for n in range(rows) for g in range(gpn)]
    # Group borders: wherever two neighbouring cells belong to different groups.
    right = np.nonzero(cells[:, :-1] != cells[:, 1:])
    down = np.nonzero(cells[:-1, :] != cells[1:, :])
    segs = [(g + 0.5, n - 0.5, g + 0.5, n + 0.5) for n, g in zip(*right)]
    segs += [(g - 0.5, n + 0.5, g + 0.5, n + 0.5) for n, g in zip(*down)]
    if segs:
        items.append(Segs(segs, BORDER, 2.0 if min(cell_w, cell_h) >= 8 else 1.0))
    for t, r in _tier_lines(tiers, gpn, rows):
        items.append(Segs([(-0.5, r - 0.5, gpn - 0.5, r - 0.5)], tier_colour(t.name), 3.0))
    for n in outlined:
        items.append(Rect(-0.5, n - 0.5, gpn, 1, fill=None, edge=RED, lw=2.0 if cell_h >= 14 else 1.5))
    all_nodes = groups // gpn
    data = {"axis": axis, "kind": "detail", "size": int(groups.shape[1]), "groups": int(len(groups)),
            "groups_shown": int(len(inside)), "coloured": K if scattered else int(len(inside)),
            "straddling_groups": int((all_nodes.min(axis=1) != all_nodes.max(axis=1)).sum()),
            "outlined_nodes": outlined, "nodes_shown": rows}
    return panel, data


def _contiguous(cells: np.ndarray, n: int) -> bool:
    """Is every group one 4-connected block of cells?"""
    seen = np.zeros(n, dtype=bool)
    rows, cols = cells.shape
    done = np.zeros(cells.shape, dtype=bool)
    for r0 in range(rows):
        for c0 in range(cols):
            gi = cells[r0, c0]
            if done[r0, c0] or gi < 0:
                continue
            if seen[gi]:
                return False  # a second block of a group already met
            seen[gi] = True
            stack = [(r0, c0)]
            done[r0, c0] = True
            while stack:
                r, c = stack.pop()
                for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                    if 0 <= rr < rows and 0 <= cc < cols and not done[rr, cc] and cells[rr, cc] == gi:
                        done[rr, cc] = True
                        stack.append((rr, cc))
    return True


def footprint_panel(plan, axis: str, window: int, tiers, left: float, top: float):
    """The whole cluster, one cell per node (or per block of nodes on the largest jobs), with the
    nodes that hold the group of rank 0 highlighted and the detailed window framed."""
    from orchestrator.plan.axes import AXES

    gpn = plan.spec.hardware.gpus_per_node
    nodes = -(-plan.world_size // gpn)
    unit = max(1, -(-nodes // 4096))  # nodes per cell
    cells = -(-nodes // unit)
    cols = min(64, max(8, int(math.ceil(math.sqrt(cells * 2)))))
    rows = -(-cells // cols)
    size = max(4.0, min(14.0, 512.0 / cols))
    groups = axis_grid(plan, axis).groups(AXES[axis].members)
    g0 = groups[0]
    g0_nodes = np.array(sorted(set((g0 // gpn).tolist())))  # (np.unique imports numpy.ma: 0.1 s)
    hit = np.zeros(cells, dtype=bool)
    hit[g0_nodes // unit] = True
    shade = [t for t in tiers if t.size % gpn == 0 and gpn < t.size < plan.world_size]
    block = shade[-1].size // gpn if shade else None  # shade the largest tier block (pods)
    panel = Panel((left, top, cols * size, rows * size), (0, cols), (0, rows), name=axis)
    for c in range(cells):
        r, k = divmod(c, cols)
        base = "#e3e3e3" if block is None or (c * unit // block) % 2 == 0 else "#c6c6c6"
        panel.items.append(Rect(k, r, 1, 1, fill=HIGHLIGHT if hit[c] else base,
                                edge="#ffffff" if size >= 6 else None))
    if window < plan.world_size:
        wcells = -(-(window // gpn) // unit)
        for c in range(wcells):
            r, k = divmod(c, cols)
            panel.items.append(Rect(k, r, 1, 1, fill=None, edge="#000000", lw=1.0))
    blocks_hit = {t.name: len(set((g0 // t.size).tolist())) for t in shade}
    crossing = {t.name: int(((groups // t.size).min(axis=1) != (groups // t.size).max(axis=1)).sum()) for t in shade}
    data = {"axis": axis, "kind": "footprint", "size": int(groups.shape[1]), "groups": int(len(groups)),
            "nodes_per_cell": unit, "group0_nodes": int(len(g0_nodes)), "group0_blocks": blocks_hit,
            "crossing": crossing,
            "straddling_groups": int(((groups // gpn).min(axis=1) != (groups // gpn).max(axis=1)).sum()),
            "outlined_nodes": [], "nodes_shown": nodes}
    return panel, data
