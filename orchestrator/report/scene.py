"""How a picture is described and drawn: a `Scene` is panels of rectangles, line segments and
text in each panel's own coordinates (a node row is y = n, a GPU column x = g), the one
description of what is drawn. Two renderers read it:

- `render_png` writes PNGs with Pillow alone. The dry run never imports matplotlib (pyplot
  alone costs about a second of start-up, more than planning).
- `to_matplotlib` gives the same scene as a matplotlib `Figure`, for notebooks and for tests
  that read patches back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


def page_panel(width: float, height: float) -> Panel:
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
