"""The step-budget picture: the roofline parts of a predicted step, what the kernel efficiency
adds, and after a run the measured step beside them (`step_budget_scene`, with the bar
heights it drew)."""
from __future__ import annotations

import math

from orchestrator.report.markdown import STEP_PARTS
from orchestrator.report.scene import Panel, Rect, Scene, Segs, Text, page_panel, text_width

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
    page = page_panel(width, height)
    page.items = page_items
    scene = Scene(int(math.ceil(width)), int(math.ceil(height)), [panel, page])
    data = {"unit": unit, "bars": [{"label": b["label"], "kind": b["kind"], "value_s": (
        b["budget"]["wall_s"] if b["kind"] == "predicted" else b["measured"]["median_s"])} for b in bars],
        "parts": [name for _, name, _ in rows], "heights": heights}
    return scene, data
