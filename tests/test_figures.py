"""The pictures and the run directory's reports (issue 15): what cluster.png and
step_budget.png show at 8, 512 and 16,384 GPUs, plan.md's command and measured section,
and orchestrate-calibrate's output. Behaviour only: the data the drawing functions
return, the PNGs' pixels and sizes, the files' contents; no timing."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, plan_of
from orchestrator.report.artifacts import write_measured, write_plan
from orchestrator.report.cluster import cluster_scene
from orchestrator.report.figures import draw_cluster, draw_step_budget, write_figures
from orchestrator.report.scene import Rect, Text, render_png
from orchestrator.report.step_budget import step_budget_scene
from orchestrator.rundir import read_steps

DEMO = ["hardware=cpu", "cluster.nodes=2", "hardware.gpus_per_node=4", "model=tiny", "layout.tp=2", "layout.pp=2",
        "layout.dp=2", "schedule=1f1b"]
LLAMA70B_512 = ["hardware=h100_sxm", "model=llama3_70b", "cluster.nodes=64", "layout.tp=8"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo():
    return plan_of(*DEMO)


@pytest.fixture(scope="module")
def llama70b_512():
    return plan_of(*LLAMA70B_512)


@pytest.fixture(scope="module")
def huge():
    return plan_of("recipe=llama3_405b_16k")


def _panel(data, axis):
    return next(p for p in data["panels"] if p["axis"] == axis)


def _red_pixels(path):
    from PIL import Image

    a = np.asarray(Image.open(path).convert("RGB"))
    return int(((a[..., 0] == 255) & (a[..., 1] == 0) & (a[..., 2] == 0)).sum())


def test_demo_has_one_panel_per_parallel_axis_with_every_rank_labelled(demo):
    scene, data = cluster_scene(demo)
    assert [p["axis"] for p in data["panels"]] == ["tp", "pp", "dp"]  # innermost first; cp and ep are 1
    assert all(p["kind"] == "detail" and p["nodes_shown"] == 2 for p in data["panels"])
    # TP and PP pairs stay inside a node; every DP pair spans both nodes
    assert _panel(data, "tp")["outlined_nodes"] == [] and _panel(data, "pp")["outlined_nodes"] == []
    assert _panel(data, "dp")["outlined_nodes"] == [0, 1] and _panel(data, "dp")["straddling_groups"] == 4
    for panel in scene.panels[:-1]:
        labels = sorted(int(t.s) for t in panel.items if isinstance(t, Text))
        assert labels == list(range(8))  # every rank numbered in every panel
    legend = " ".join(t.s for t in scene.page.items if isinstance(t, Text))
    assert "tier nvlink" in legend and "tier network" in legend and "spans more than one node" in legend


def test_red_outlines_are_drawn_where_the_data_says(demo, tmp_path):
    """The caption's promise: red outlines exist in the PNG exactly when a group straddles a node."""
    scene, data = cluster_scene(demo)
    assert _red_pixels(render_png(scene, tmp_path / "a.png")) > 0
    one_node = plan_of("hardware=cpu", "model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=8", "layout.tp=2",
                       "layout.pp=2", "layout.dp=2")
    scene, data = cluster_scene(one_node)
    assert all(p["outlined_nodes"] == [] for p in data["panels"])
    assert _red_pixels(render_png(scene, tmp_path / "b.png")) == 0


def test_matplotlib_figure_is_the_same_scene(demo):
    fig, data = draw_cluster(demo)
    assert [ax.get_label() for ax in fig.axes] == ["tp", "pp", "dp", "page"]
    dp = fig.axes[2]
    red = sorted(int(round(p.get_y() + 0.5)) for p in dp.patches
                 if tuple(np.round(p.get_edgecolor()[:3], 2)) == (1.0, 0.0, 0.0))
    assert red == _panel(data, "dp")["outlined_nodes"]
    fig, one = draw_cluster(demo, "pp")  # one axis only: its figures at the top level
    assert len(one["panels"]) == 1 and one["axis"] == "pp" and one["outlined_nodes"] == []


def test_512_gpus_every_node_drawn_and_readable(llama70b_512):
    scene, data = cluster_scene(llama70b_512)
    assert data["detailed"] == ["tp", "dp"] and data["window_ranks"] == 512
    tp, dp = _panel(data, "tp"), _panel(data, "dp")
    assert tp["nodes_shown"] == 64 and tp["outlined_nodes"] == [] and tp["groups"] == 64
    assert dp["outlined_nodes"] == list(range(64)) and dp["groups"] == 8
    w, h = data["size"]
    assert h < 1000 and w < 1200 and 0.5 < h / w < 2  # not a 495 x 1738 strip
    ranks = [t for t in scene.panels[0].items if isinstance(t, Text)]
    assert len(ranks) == 512 and min(t.size for t in ranks) >= 7  # ranks labelled where they fit


def test_16k_gpus_one_replica_drawn_and_counts_for_the_rest(huge):
    scene, data = cluster_scene(huge)
    d = huge.layout
    assert data["window_ranks"] == d.tp * d.cp * d.pp == d.replica  # one replica, rank by rank
    assert data["detailed"] == ["tp", "pp"]
    dp = _panel(data, "dp")
    assert dp["kind"] == "footprint" and dp["groups"] == 128 and dp["group0_nodes"] == 128
    assert dp["crossing"]["pod"] == 128  # every DP group leaves its pod
    w, h = data["size"]
    assert w < 1600 and h < 1400
    text = " ".join(t.s for t in scene.page.items if isinstance(t, Text))
    assert "the other 127 replicas repeat it" in text and "tier pod: 3,072 GPUs" in text
    # tier boundaries (racks of 16 GPUs = 2 nodes) are drawn across the detailed panels
    assert any(getattr(it, "color", None) == "#1f77b4" for it in scene.panels[0].items)


def test_scattered_groups_beyond_the_palette_are_not_coloured_ambiguously():
    plan = plan_of("recipe=deepseek_v3")
    _, data = cluster_scene(plan)
    edp = _panel(data, "edp")
    if edp["kind"] == "detail" and edp["groups_shown"] > 11:
        assert edp["coloured"] <= 11


def test_figures_need_neither_matplotlib_nor_torch(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from orchestrator import compose, make_plan\n"
            "from orchestrator.report.artifacts import write_plan\n"
            f"p = write_plan(make_plan(compose({DEMO!r})), __import__('pathlib').Path({str(tmp_path)!r}))\n"
            "assert 'cluster' in p and 'step_budget' in p\n"
            "bad = [m for m in ('matplotlib', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("cluster.png", "step_budget.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_step_budget_in_the_unit_that_fits_with_every_part_listed(demo):
    assert step_budget_scene([demo])[1]["unit"] == "s"  # the calibrated cpu preset: about 2 s
    fast = plan_of(*DEMO, "hardware.kernel_efficiency=0.5")  # the same roofline, about 16 ms
    scene, data = step_budget_scene([fast])
    assert data["unit"] == "ms"
    listed = " ".join(t.s for t in scene.page.items if isinstance(t, Text))
    for name in ("arithmetic", "TP collectives", "pipeline bubble", "P2P sends", "exposed DP", "predicted step"):
        assert name in listed  # P2P is 1% of the bar: too thin to see, so it is listed with its value
    assert f"{fast.step.p2p * 1e6:.3g} µs" in listed
    big = plan_of("recipe=llama3_405b")
    assert step_budget_scene([big])[1]["unit"] == "s"


def test_step_budget_measured_bar_beside_the_predicted(demo):
    measured = {"median_s": 0.030, "p10_s": 0.028, "p90_s": 0.035, "steps": 29}
    scene, data = step_budget_scene([demo], measured=measured)
    assert [b["kind"] for b in data["bars"]] == ["predicted", "measured"]
    assert data["bars"][1]["value_s"] == 0.030
    fig = draw_step_budget([demo], measured=measured)
    assert len(fig.axes[0].patches) >= 6  # five parts, the efficiency gap and the measured bar


def test_plan_md_records_the_command_and_real_units(demo, tmp_path):
    argv = ["hardware=cpu", "cluster.nodes=2", "layout.tp=2"]
    paths = write_plan(demo, tmp_path, command=argv)
    md = paths["md"].read_text()
    assert "orchestrate hardware=cpu cluster.nodes=2 layout.tp=2" in md
    assert "- `layout.tp=2`" in md
    assert "213.6K parameters" in md and "MiB" in md and "FLOP/s per GPU" in md
    assert "0.0B parameters" not in md and " 0.00 GiB" not in md and "TFLOP/s per GPU" not in md
    assert "preset hardware=cpu" in md
    assert "![cluster](cluster.png)" in md
    md = write_plan(demo, tmp_path / "nofig", figures=False)["md"].read_text()
    assert "cluster.png" not in md and "## Command" not in md


def _fake_run(plan, run, times, attempt=0, start=0):
    with open(run / "metrics.jsonl", "a") as f:
        for i, t in enumerate(times):
            f.write(json.dumps({"step": start + i, "loss": 6.0 - 0.1 * (start + i), "step_time_s": t,
                                "attempt": attempt, "dp": 2, "time": 0}) + "\n")


def test_write_measured_adds_one_section_and_the_measured_bar(demo, tmp_path):
    run = tmp_path
    write_plan(demo, run, command=DEMO)
    predicted = demo.step.wall_s
    before = (run / "step_budget.png").read_bytes()
    _fake_run(demo, run, [predicted * 10] + [predicted * 1.5] * 9)
    out = write_measured(run)
    assert out["median_s"] == pytest.approx(predicted * 1.5) and out["ratio"] == pytest.approx(1.5)
    assert out["steps"] == 9 and out["warmup_steps"] == 1
    assert "1.50x" in out["line"] and "hardware=cpu" in out["line"]
    md = (run / "plan.md").read_text()
    assert md.count("## Measured vs predicted") == 1 and "within 2x" in md and "not a GPU's" in md
    after = (run / "step_budget.png").read_bytes()
    assert after[:8] == PNG and after != before
    write_measured(run)  # again: the section is replaced, not repeated
    assert (run / "plan.md").read_text().count("## Measured vs predicted") == 1


def test_measured_steps_take_the_latest_attempt_and_its_plan(demo, tmp_path):
    run = tmp_path
    write_plan(demo, run, figures=False)
    _fake_run(demo, run, [1.0, 1.0, 1.0, 1.0])
    _fake_run(demo, run, [2.0, 2.0, 2.0], attempt=1, start=2)  # steps 2-3 redone after a failover
    steps = read_steps(run)
    assert [(s["step"], s["attempt"]) for s in steps] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 1)]
    assert len(read_steps(run, latest=False)) == 7  # what ran, for calibration
    out = write_measured(run)
    assert out["attempt"] == 1 and out["median_s"] == 2.0
    md = (run / "plan.md").read_text()
    assert "| 0 | TP2 CP1 PP2 DP2 | 3 (+1 warm-up)" in md and "| 1 | TP2 CP1 PP2 DP2 | 2 (+1 warm-up)" in md
    assert not (run / "step_budget.png").exists()  # figures=false runs stay without pictures


def test_calibrate_writes_into_the_run_not_the_tree(demo, tmp_path, capsys):
    from orchestrator.measure import main as calibrate_main

    run = tmp_path / "run"
    write_plan(demo, run, figures=False)
    _fake_run(demo, run, [demo.step.wall_s * 4] * 6)
    assert calibrate_main([str(run)]) == 0
    printed = capsys.readouterr().out
    preset = run / "hardware-cpu-calibrated.yaml"
    text = preset.read_text()
    eff = demo.spec.hardware.kernel_efficiency / 4
    assert f"kernel_efficiency: {float(f'{eff:.4g}')}" in text and "orchestrate-calibrate" in text
    assert f"hardware.kernel_efficiency={float(f'{eff:.4g}'):g}" in printed


def test_write_figures_returns_pngs_of_the_scene_size(huge, tmp_path):
    from PIL import Image

    paths = write_figures(huge, tmp_path)
    scene, _ = cluster_scene(huge)
    with Image.open(paths["cluster"]) as im:
        assert im.size == (scene.width, scene.height)
    assert paths["step_budget"].read_bytes()[:8] == PNG
    assert isinstance(scene.panels[0].items[0], Rect)
