"""Pictures of a plan (tests/test_figures.py draws 512 GPUs): where every axis' groups sit on the cluster, and
the step budget (predicted, and measured after a run).

Each picture is first laid out as a `Scene`: panels of rectangles, line segments and
text in the panel's own coordinates (a node row is y = n, a GPU column x = g). The
scene is the one description of what is drawn; two renderers read it:

- `render_png` writes the PNGs with Pillow alone. The dry run never imports
  matplotlib (pyplot alone costs about a second of start-up, more than planning).
- `to_matplotlib` gives the same scene as a matplotlib `Figure` (`draw_cluster`,
  `draw_step_budget`), for notebooks and for tests that read patches back.

`cluster_scene` and `step_budget_scene` also return the data they drew (outlined
nodes, groups, windows, bar heights), so tests check behaviour, not pixels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator import rundir
from orchestrator.plan.report import STEP_PARTS

# ----------------------------------------------------------------------------- scene

@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str | None = None
    edge: str | None = None
    lw: float = 1.0  # pixels


@dataclass
class Segs:
    """Line segments (x0, y0, x1, y1), one colour and width (pixels)."""
    segs: list
    color: str = "#000000"
    lw: float = 1.0


@dataclass
class Text:
    x: float
    y: float
    s: str
    size: float = 10.0  # pixels (the em size)
    color: str = "#000000"
    ha: str = "center"  # left | center | right
    va: str = "center"  # top | center | bottom
    bold: bool = False


@dataclass
class Panel:
    box: tuple  # (left, top, width, height) in figure pixels
    xlim: tuple  # data x at the left and right edges
    ylim: tuple  # data y at the top and bottom edges (a node row grows downwards)
    items: list = field(default_factory=list)
    name: str = ""


@dataclass
class Scene:
    width: int
    height: int
    panels: list  # content panels first; the last one is the page (pixel coordinates)

    @property
    def page(self) -> Panel:
        return self.panels[-1]


def _page(width: float, height: float) -> Panel:
    return Panel((0, 0, width, height), (0, width), (0, height), name="page")


def text_width(s: str, size: float, bold: bool = False) -> float:
    """DejaVu Sans averages about 0.6 em per character (0.64 bold); layout only needs this."""
    return len(s) * size * (0.64 if bold else 0.6)


# ----------------------------------------------------------------------------- renderers

def _font_file(bold: bool) -> str | None:
    """DejaVu Sans from matplotlib's data folder, found without importing matplotlib."""
    import importlib.util

    spec = importlib.util.find_spec("matplotlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        f = Path(folder) / "mpl-data" / "fonts" / "ttf" / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")
        if f.exists():
            return str(f)
    return None


_FONTS: dict = {}


def _font(size: float, bold: bool):
    from PIL import ImageFont

    key = (round(size), bold)
    if key not in _FONTS:
        path = _font_file(bold)
        try:
            _FONTS[key] = ImageFont.truetype(path, key[0]) if path else ImageFont.load_default(key[0])
        except (OSError, TypeError):
            _FONTS[key] = ImageFont.load_default()
    return _FONTS[key]


class _Glyphs:
    """Short labels (rank numbers, ticks) drawn from cached glyph masks: one C call per character
    instead of Pillow's whole text layout per label, which dominated a picture's cost."""

    def __init__(self, font):
        self.font = font
        self.ascent, self.descent = font.getmetrics()
        self.cache: dict = {}

    def glyph(self, c: str):
        if c not in self.cache:
            mask, (left, top) = self.font.getmask2(c, mode="L", anchor="ls")
            self.cache[c] = (mask, left, top, self.font.getlength(c))
        return self.cache[c]

    def draw(self, draw, x: float, y: float, s: str, fill, ha: str, va: str) -> None:
        glyphs = [self.glyph(c) for c in s]
        width = sum(g[3] for g in glyphs)
        x -= {"left": 0.0, "center": width / 2, "right": width}[ha]
        base = y + {"top": self.ascent, "center": (self.ascent - self.descent) / 2, "bottom": -self.descent}[va]
        ink = draw._getink(fill)[0]
        for mask, left, top, advance in glyphs:
            if mask.size[0] and mask.size[1]:
                draw.draw.draw_bitmap((round(x + left), round(base + top)), mask, ink)
            x += advance


_GLYPHS: dict = {}


def render_png(scene: Scene, path: Path) -> Path:
    """Draw the scene with Pillow and write it as a PNG."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (int(scene.width), int(scene.height)), "white")
    draw = ImageDraw.Draw(img)
    for panel in scene.panels:
        left, top, width, height = panel.box
        (x0, x1), (y0, y1) = panel.xlim, panel.ylim
        sx, sy = width / (x1 - x0), height / (y1 - y0)

        def px(x: float, y: float) -> tuple[float, float]:
            return left + (x - x0) * sx, top + (y - y0) * sy

        for it in panel.items:
            if isinstance(it, Rect):
                (ax, ay), (bx, by) = px(it.x, it.y), px(it.x + it.w, it.y + it.h)
                box = [round(min(ax, bx)), round(min(ay, by)), round(max(ax, bx)) - 1, round(max(ay, by)) - 1]
                if box[2] < box[0] or box[3] < box[1]:
                    continue
                draw.rectangle(box, fill=it.fill, outline=it.edge, width=max(1, round(it.lw)) if it.edge else 0)
            elif isinstance(it, Segs):
                w = max(1, round(it.lw))
                for a, b, c, d in it.segs:
                    p, q = px(a, b), px(c, d)
                    draw.line([(round(p[0]), round(p[1])), (round(q[0]), round(q[1]))], fill=it.color, width=w)
            elif isinstance(it, Text):
                font = _font(it.size, it.bold)
                if len(it.s) <= 8:
                    glyphs = _GLYPHS.get(id(font))
                    if glyphs is None or glyphs.font is not font:
                        glyphs = _GLYPHS[id(font)] = _Glyphs(font)
                    glyphs.draw(draw, *px(it.x, it.y), it.s, it.color, it.ha, it.va)
                    continue
                anchor = {"left": "l", "center": "m", "right": "r"}[it.ha] + {"top": "a", "center": "m",
                                                                              "bottom": "d"}[it.va]
                draw.text(px(it.x, it.y), it.s, fill=it.color, font=font, anchor=anchor)
    path = Path(path)
    img.save(path, format="PNG", compress_level=1)
    return path


def to_matplotlib(scene: Scene, dpi: int = 100):
    """The scene as a matplotlib Figure (no pyplot): one Axes per panel, in panel order."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    W, H = scene.width, scene.height
    pt = 72.0 / dpi  # points per pixel
    fig = Figure(figsize=(W / dpi, H / dpi), dpi=dpi)
    for panel in scene.panels:
        left, top, width, height = panel.box
        ax = fig.add_axes((left / W, 1 - (top + height) / H, width / W, height / H))
        ax.set_xlim(*panel.xlim)
        ax.set_ylim(panel.ylim[1], panel.ylim[0])
        ax.set_axis_off()
        ax.set_label(panel.name)
        for it in panel.items:
            if isinstance(it, Rect):
                ax.add_patch(Rectangle((it.x, it.y), it.w, it.h, facecolor=it.fill or "none",
                                       edgecolor=it.edge or "none", linewidth=it.lw * pt if it.edge else 0,
                                       fill=it.fill is not None))
            elif isinstance(it, Segs):
                ax.add_collection(LineCollection([[(a, b), (c, d)] for a, b, c, d in it.segs], colors=it.color,
                                                 linewidths=it.lw * pt))
            elif isinstance(it, Text):
                ax.text(it.x, it.y, it.s, fontsize=it.size * pt, color=it.color, ha=it.ha,
                        va={"top": "top", "center": "center", "bottom": "bottom"}[it.va],
                        fontweight="bold" if it.bold else "normal", clip_on=False)
    return fig


# ----------------------------------------------------------------------------- cluster

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


def _tier_colour(name: str) -> str:
    return TIER_COLOURS.get(name, "#17becf")


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


def _grid(plan, axis: str):
    from orchestrator.plan.axes import AXES

    return plan.grid() if AXES[axis].grid == "dense" else plan.expert_grid()


def _degree(plan, axis: str) -> int:
    from orchestrator.plan.axes import AXES

    g = _grid(plan, axis)
    return int(np.prod([g.sizes[m] for m in AXES[axis].members]))


def _block(plan, axis: str) -> int:
    """The ranks [0, block) hold whole groups of this axis: the product of the grid's sizes from
    the innermost axis out to the axis' outermost member."""
    from orchestrator.plan.axes import AXES

    g = _grid(plan, axis)
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


def _detail_panel(plan, axis: str, window: int, tiers, cell_w: float, cell_h: float, left: float, top: float):
    """Nodes as rows and GPUs as columns of the drawn window, coloured by the axis' groups."""
    from orchestrator.plan.axes import AXES

    gpn = plan.spec.hardware.gpus_per_node
    rows = window // gpn
    groups = _grid(plan, axis).groups(AXES[axis].members)
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
        items.append(Segs([(-0.5, r - 0.5, gpn - 0.5, r - 0.5)], _tier_colour(t.name), 3.0))
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


def _footprint_panel(plan, axis: str, window: int, tiers, left: float, top: float):
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
    groups = _grid(plan, axis).groups(AXES[axis].members)
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


def _axis_title(plan, axis: str, data: dict) -> str:
    """"TP 8: 64 groups", or "DP 128 (dp8 x cp16): ..." when a group spans more than one grid axis."""
    from orchestrator.plan.axes import AXES

    members = AXES[axis].members
    g = _grid(plan, axis)
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
        p, data = _detail_panel(plan, a, window, tiers, cell_w, cell_h, left, top + head + 14)
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
        p, data = _footprint_panel(plan, a, window, tiers, M, y + head)
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
        legend.append(("line", _tier_colour(t.name), f"tier {t.name}: {where}, {t.gbps:.3g} GB/s"))
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
    page = _page(width, height)
    page.items = items
    scene = Scene(int(math.ceil(width)), int(math.ceil(height)), panels + [page])
    first = datas[0]
    data = {**{k: first[k] for k in ("axis", "nodes_shown", "outlined_nodes", "straddling_groups", "groups")},
            "panels": datas, "window_ranks": window, "detailed": detailed, "nodes": nodes,
            "tiers": [t.name for t in tiers], "size": (scene.width, scene.height)}
    return scene, data


def draw_cluster(plan, axis=None, max_nodes: int = 64):
    """(matplotlib Figure, data): the cluster picture, one panel per axis (`axis` names one axis
    or a list of them; None = every axis with degree > 1). Red outlines mark the nodes that a
    group straddles; `data` holds what was drawn, the first panel's figures at its top level."""
    scene, data = cluster_scene(plan, axis, max_nodes)
    return to_matplotlib(scene), data


# ----------------------------------------------------------------------------- step budget

COLOURS = {"compute": "#4c72b0", "tp": "#dd8452", "cp": "#937860", "ep": "#8172b3", "pp_bubble": "#c44e52",
           "p2p": "#da8bc3", "dp_exposed": "#55a868", "efficiency": "#d9d9d9", "measured": "#8c8c8c"}


def budget_of(plan) -> dict:
    """The step budget of a Plan or of a plan.json dict: the roofline parts, the total, the
    predicted wall-clock step and the efficiency between them."""
    if isinstance(plan, dict):
        st = plan.get("step") or {}
        eff = plan.get("config", {}).get("hardware", {}).get("kernel_efficiency")
        label = (plan.get("layout") or {}).get("label", "invalid")
        hw = plan.get("config", {}).get("hardware", {}).get("name") or plan.get("hardware", "?")
        parts = {k: float(st.get(k, 0.0)) for k, _ in STEP_PARTS}
        return {"label": label, "parts": parts, "total_s": float(st.get("total_s", 0.0)),
                "wall_s": float(st.get("wall_s", 0.0)), "efficiency": eff, "hardware": hw}
    st = plan.step
    return {"label": plan.layout.label() if plan.layout else "invalid",
            "parts": {k: float(getattr(st, k)) if st else 0.0 for k, _ in STEP_PARTS},
            "total_s": st.total_s if st else 0.0, "wall_s": st.wall_s if st else 0.0,
            "efficiency": plan.spec.hardware.kernel_efficiency if plan.spec else None,
            "hardware": plan.spec.hardware.name if plan.spec else "?"}


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit a chart whose largest value is `seconds` reads best in: (name, seconds per unit)."""
    if seconds >= 1.0:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e-3
    return "µs", 1e-6


def fmt_time(seconds: float) -> str:
    """A time in the unit it reads best in, three significant digits: 0.102 ms, 15.8 ms, 4.27 s."""
    if seconds == 0:
        return "0"
    unit, k = time_unit(seconds)
    return f"{_num(seconds / k)} {unit}"


def _num(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def nice_ticks(top: float, n: int = 5) -> list[float]:
    if top <= 0:
        return [0.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def step_budget_scene(plans: list, labels: list[str] | None = None, measured: dict | None = None
                      ) -> tuple[Scene, dict]:
    """One stacked bar per plan (the roofline parts, then what the kernel efficiency adds to reach
    the predicted wall-clock step) and, after a run, a measured bar (median, p10-p90 whiskers)
    beside them. Every part is listed with its value under the chart, so a slice too thin to see
    is still read."""
    budgets = [budget_of(p) for p in plans]
    labels = list(labels) if labels else [b["label"] for b in budgets]
    keys = [(k, name) for k, name in STEP_PARTS if any(b["parts"][k] > 0 for b in budgets) or k == "compute"]
    effs = [b["efficiency"] for b in budgets]
    show_gap = any(b["wall_s"] > b["total_s"] * (1 + 1e-9) for b in budgets)
    bars = [{"label": lab, "kind": "predicted", "top": max(b["wall_s"], b["total_s"]), "budget": b}
            for lab, b in zip(labels, budgets)]
    if measured:
        bars.append({"label": measured.get("label", "measured"), "kind": "measured",
                     "top": max(measured["median_s"], measured.get("p90_s", 0.0)), "measured": measured})
    ymax_s = max([b["top"] for b in bars] + [1e-12])
    unit, k = time_unit(ymax_s)
    ticks = nice_ticks(ymax_s / k)
    ymax = max(ticks[-1], ymax_s / k * 1.08)
    M = 14
    slot = max([110.0] + [text_width(b["label"], 9) + 14 for b in bars])
    bar_px, left_px, chart_h = 64.0, 62, 260
    gap_px = slot - bar_px
    chart_w = len(bars) * slot
    top = M + 62
    panel = Panel((M + left_px, top, chart_w, chart_h), (0, len(bars)), (ymax, 0), name="budget")
    items = panel.items
    frac = bar_px / (bar_px + gap_px)
    heights = []
    for i, bar in enumerate(bars):
        x = i + (1 - frac) / 2
        if bar["kind"] == "predicted":
            b, bottom, h_parts = bar["budget"], 0.0, {}
            for key, _ in keys:
                v = b["parts"][key] / k
                if v > 0:
                    items.append(Rect(x, bottom, frac, v, fill=COLOURS[key]))
                    h_parts[key] = v
                bottom += v
            if show_gap and b["wall_s"] > b["total_s"]:
                items.append(Rect(x, bottom, frac, b["wall_s"] / k - bottom, fill=COLOURS["efficiency"],
                                  edge="#a0a0a0"))
                h_parts["efficiency"] = b["wall_s"] / k - bottom
            value = b["wall_s"] / k
            heights.append(h_parts)
        else:
            m = bar["measured"]
            value = m["median_s"] / k
            items.append(Rect(x, 0, frac, value, fill=COLOURS["measured"], edge="#404040"))
            if "p10_s" in m and "p90_s" in m:
                c = i + 0.5
                lo, hi = m["p10_s"] / k, m["p90_s"] / k
                items.append(Segs([(c, lo, c, hi), (c - frac / 4, lo, c + frac / 4, lo),
                                   (c - frac / 4, hi, c + frac / 4, hi)], "#000000", 1.5))
            heights.append({"measured": value})
        items.append(Text(i + 0.5, max(value, bar["top"] / k), _num(value) + f" {unit}", 10, ha="center",
                          va="bottom", bold=True))
    # Axis, ticks and grid (in the chart's own units).
    items.insert(0, Segs([(0, t, len(bars), t) for t in ticks[1:]], "#ececec", 1))
    items.append(Segs([(0, 0, len(bars), 0), (0, 0, 0, ymax)], "#000000", 1))
    page_items: list = []
    px_of = lambda v: top + chart_h * (1 - v / ymax)  # noqa: E731
    for t in ticks:
        page_items.append(Text(M + left_px - 6, px_of(t), _num(t), 9, "#404040", "right", "center"))
    page_items.append(Text(M + left_px - 10, top - 14, unit, 10, "#404040", "right", "center", bold=True))
    for i, bar in enumerate(bars):
        cx = M + left_px + (i + 0.5) * (bar_px + gap_px)
        page_items.append(Text(cx, top + chart_h + 6, bar["label"], 9, ha="center", va="top"))
        sub = bar["kind"] if bar["kind"] == "predicted" else (
            f"median of {bar['measured']['steps']} steps" if "steps" in bar["measured"] else "median")
        page_items.append(Text(cx, top + chart_h + 20, sub, 9, "#505050", "center", "top"))
    # The table: every part with its value per predicted bar, then the measured step.
    hw = {b["hardware"] for b in budgets}
    eff_text = ", ".join(sorted({f"{e:.3g}" for e in effs if e is not None}))
    title = f"step-time budget per step ({unit})"
    sub = (f"roofline parts, then what kernel efficiency {eff_text} adds (hardware={', '.join(sorted(hw))})"
           if show_gap else f"roofline parts (hardware={', '.join(sorted(hw))})")
    if measured:
        sub += "; measured: median step, whiskers p10-p90"
    tx = M + left_px + chart_w + 24
    col_w = max(96.0, max(text_width(lab, 9) for lab in labels) + 12)
    name_w = 200.0
    single = len(budgets) == 1
    rows = [(key, name, [b["parts"][key] for b in budgets]) for key, name in keys]
    rows.append((None, "roofline total", [b["total_s"] for b in budgets]))
    if show_gap:
        rows.append(("efficiency", f"kernels at {eff_text} of roofline", [max(0.0, b["wall_s"] - b["total_s"])
                                                                     for b in budgets]))
        rows.append((None, "predicted step", [b["wall_s"] for b in budgets]))
    ty = top
    if not single:
        for j, lab in enumerate(labels):
            page_items.append(Text(tx + 22 + name_w + (j + 1) * col_w, ty, lab, 9, "#404040", "right", "top"))
        ty += 16
    for key, name, values in rows:
        if key is not None:
            page_items.append(Rect(tx, ty, 14, 12, fill=COLOURS[key], edge="#808080" if key == "efficiency" else None))
        page_items.append(Text(tx + 22, ty + 6, name, 10, "#202020", "left", "center", bold=key is None))
        for j, v in enumerate(values):
            # shares of the roofline total, as the printed table gives them
            share = (f" ({v / budgets[j]['total_s']:.1%})" if single and key not in (None, "efficiency")
                     and budgets[j]["total_s"] > 0 else "")
            page_items.append(Text(tx + 22 + name_w + (j + 1) * col_w, ty + 6, f"{fmt_time(v)}{share}", 10,
                                   "#202020", "right", "center", bold=key is None))
        ty += 18
    if measured:
        page_items.append(Rect(tx, ty, 14, 12, fill=COLOURS["measured"], edge="#404040"))
        ratio = measured["median_s"] / budgets[-1]["wall_s"] if budgets[-1]["wall_s"] > 0 else float("nan")
        page_items.append(Text(tx + 22, ty + 6, "measured step (median)", 10, "#202020", "left", "center", bold=True))
        page_items.append(Text(tx + 22 + name_w + len(budgets) * col_w, ty + 6, fmt_time(measured["median_s"]),
                               10, "#202020", "right", "center", bold=True))
        ty += 18
        page_items.append(Text(tx + 22, ty + 6, f"measured / predicted = {ratio:.2f}x", 10, "#404040", "left",
                               "center"))
        ty += 18
    table_w = 22 + name_w + len(budgets) * col_w + (24 if single else 0)
    width = max(tx + table_w + M, M + text_width(title, 13, True) + M, M + text_width(sub, 10) + M)
    height = max(top + chart_h + 40, ty) + M
    page_items = [Text(M, M, title, 13, ha="left", va="top", bold=True),
                  Text(M, M + 20, sub, 10, "#404040", "left", "top")] + page_items
    page = _page(width, height)
    page.items = page_items
    scene = Scene(int(math.ceil(width)), int(math.ceil(height)), [panel, page])
    data = {"unit": unit, "bars": [{"label": b["label"], "kind": b["kind"], "value_s": (
        b["budget"]["wall_s"] if b["kind"] == "predicted" else b["measured"]["median_s"])} for b in bars],
        "parts": [name for _, name, _ in rows], "heights": heights}
    return scene, data


def draw_step_budget(plans: list, labels: list[str] | None = None, measured: dict | None = None):
    """A matplotlib Figure: one stacked bar per plan (Plan or plan.json dict) and, given
    `measured` ({median_s, p10_s, p90_s, steps}), the measured step beside them."""
    scene, _ = step_budget_scene(plans, labels, measured)
    return to_matplotlib(scene)


# ----------------------------------------------------------------------------- files

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
