"""The acceptance numbers of the worked examples: 512 H100 (64 x 8) with a Llama-3-70B shape, TP8 vs
TP16 across nodes (the collectives of Shoeybi et al. 2019, arXiv:1909.08053, section 3, on 450 vs
50 GB/s), and the GPipe bubble (p-1)/m (Huang et al. 2019, arXiv:1811.06965, section 2.3)."""
import json

import pytest

from conftest import plan_of
from orchestrator.plan.cost import bubble_fraction

LLAMA70B_512 = ["hardware=h100_sxm", "model=llama3_70b", "cluster.nodes=64", "layout.tp=8", "layout.cp=1",
         "layout.pp=1", "layout.dp=64", "training.seq_len=8192", "training.global_batch=2048",
         "training.micro_batch=1", "cost.attention_flops=false", "launcher=dry"]


def test_llama70b_512_worked_example_from_the_command_line(cli):
    r = cli(*LLAMA70B_512)
    assert r.returncode == 0, r.stderr
    plan = json.loads((cli.dir / "plan.json").read_text())
    assert plan["valid"] and plan["world_size"] == 512
    step = plan["step"]
    assert step["total_s"] == pytest.approx(19.4, rel=0.02)
    assert step["compute"] / step["total_s"] == pytest.approx(0.72, abs=0.01)
    assert step["tp"] / step["total_s"] == pytest.approx(0.28, abs=0.01)
    assert plan["model"]["params"] == pytest.approx(70.6e9, rel=0.005)
    assert plan["layout"]["microbatches"] == 32
    for key in ("valid", "errors", "warnings", "world_size", "layout", "memory", "step", "mfu", "hfu",
                "tflops_per_gpu", "tokens_per_s", "axes", "ranks", "blast_radius"):
        assert key in plan, key
    for part in ("params", "grads", "optimizer", "activations", "other", "per_gpu_bytes", "fits"):
        assert part in plan["memory"]
    for part in ("total_s", "compute", "tp", "cp", "pp_bubble", "p2p", "dp_exposed"):
        assert part in plan["step"]
    assert 0 < plan["mfu"] < 1 and 0 < plan["hfu"] < 1
    assert (cli.dir / "plan.md").read_text().startswith("# Plan")


def _tp16(*extra):
    args = [a for a in LLAMA70B_512 if not a.startswith(("layout.tp", "layout.dp", "launcher"))]
    return plan_of(*args, "layout.tp=16", "layout.dp=32", *extra)


def test_llama70b_512_tp16_moves_80_5_gb_onto_the_network():
    plan = _tp16("layout.allow_cross_node_tp=true")
    assert plan.valid
    tp = plan.axes["tp"]
    assert tp.bytes_per_microbatch == pytest.approx(80.5e9, rel=0.005)
    assert tp.gbps == 50 and tp.tier != "nvlink"
    per_mb = tp.exposed_s / plan.layout.microbatches
    assert per_mb == pytest.approx(1.61, rel=0.01)
    assert plan.step.compute_microbatch_s == pytest.approx(0.219, rel=0.01)
    assert any("WARNING" in w and "1.61 s" in w for w in plan.warnings)
    # The same TP16 inside one 16-GPU NVLink domain: 179 ms.
    nv = _tp16("hardware.gpus_per_node=16", "cluster.nodes=32")
    assert nv.valid and nv.axes["tp"].tier == "nvlink"
    assert nv.axes["tp"].exposed_s / nv.layout.microbatches == pytest.approx(0.179, rel=0.01)


def test_llama70b_512_tp16_is_rejected_by_default_and_explained():
    plan = _tp16()
    assert not plan.valid
    (err,) = [e for e in plan.errors if e.key == "layout.tp"]
    for figure in ("80.5 GB", "1.61 s", "179 ms", "219 ms", "allow_cross_node_tp"):
        assert figure in str(err), (figure, str(err))


@pytest.mark.parametrize("p,m,expected", [(4, 8, 0.273), (4, 32, 0.086)])
def test_gpipe_gpipe_bubble(p, m, expected):
    assert bubble_fraction(p, m, "gpipe") == pytest.approx(expected, abs=0.002)


def test_gpipe_smallest_m_under_10_percent_for_8_stages():
    m = next(m for m in range(1, 1000) if bubble_fraction(8, m, "1f1b") < 0.10)
    assert m == 64


def test_the_plan_reports_the_gpipe_bubble():
    plan = plan_of("hardware=h100_sxm", "model=llama3_8b", "cluster.nodes=4", "layout.tp=8", "layout.pp=4",
                   "layout.dp=1", "training.global_batch=8", "schedule=gpipe", "training.seq_len=4096")
    st = plan.step
    busy = st.compute + st.tp + st.cp + st.ep
    assert st.pp_bubble / (busy + st.pp_bubble) == pytest.approx(3 / 11, abs=0.002)
    interleaved = plan_of("hardware=h100_sxm", "model=llama3_8b", "cluster.nodes=4", "layout.tp=8",
                          "layout.pp=4", "layout.dp=1", "training.global_batch=8", "schedule=interleaved_1f1b",
                          "layout.vp=2", "training.seq_len=4096")
    assert interleaved.step.pp_bubble < st.pp_bubble
