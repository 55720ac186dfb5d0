"""plan.md after a real run shows the profiled step per part (compute, each axis's collectives)
against the plan's parts; the profiled steps are left out of the measured step."""
import json
import re

import pytest

from conftest import run_cli

from orchestrator import rundir

COMMON = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "cluster.nodes=1",
          "hardware.gpus_per_node=4", "layout.tp=2", "layout.dp=2", "training.steps=5"]


def _seconds(cell: str) -> float:
    num, unit = re.match(r"([0-9.]+)\s*(ms|us|µs|s|min)", cell.strip()).groups()
    return float(num) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60.0}[unit]


def test_plan_md_has_the_measured_parts_of_a_profiled_step(tmp_path):
    r = run_cli(COMMON, tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = tmp_path / "run"
    prof = json.loads((run / rundir.PROFILE_JSON).read_text())
    assert prof["step"] == 4  # the last step, after one warm-up step under the profiler
    recs = rundir.read_steps(run)
    assert [r["step"] for r in recs if r.get(rundir.PROFILED)] == [3, 4]
    assert len(rundir.timed(recs)) == 3
    # TP2 x DP2: DTensor's redistributes and FSDP2's regions were seen, CP's and PP's were not
    assert prof["regions"]["tp"] > 0 and prof["regions"]["dp"] > 0
    assert prof["regions"]["pp"] == 0
    text = (run / rundir.PLAN_MD).read_text()
    section = text.split("### Per part of the step", 1)[1]
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"^\| (\w+) \| ([^|]+) \| ([^|]+) \|", section, re.M)
            if m.group(1) != "part"}
    assert set(rows) >= {"compute", "tp", "cp", "dp", "pp", "step"}
    measured = {k: _seconds(v[1]) for k, v in rows.items()}
    assert measured["tp"] > 0 and measured["dp"] > 0 and measured["compute"] > 0
    parts = sum(v for k, v in measured.items() if k != "step")
    assert abs(parts - measured["step"]) <= 0.02 * measured["step"] + 2e-3  # the parts make up the step
    # the profiled step is the one plan.md reports (its overhead against the others' is a figure
    # benchmarks/probe_fit.py prints, not a test's)
    assert _seconds(rows["step"][1]) == pytest.approx(prof["step_s"], rel=0.01, abs=1e-3)
    assert _seconds(rows["step"][0]) > 0  # the predicted step beside it


def test_the_attentions_gathers_count_as_context_parallel_with_their_wait():
    """dist.all_gather only enqueues on gloo's thread; the rank waits inside the attention's own
    autograd function (model._GatherSeq), so its forward and backward regions are CP's part and
    the c10d op inside them is not counted twice."""
    from orchestrator.train.model import _GatherSeq
    from orchestrator.train.profile import part_of, summarize

    assert part_of(_GatherSeq.__name__) == part_of(_GatherSeq.__name__ + "Backward") == "cp"

    class Range:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Event:
        def __init__(self, name, start, end, parent=None):
            self.name, self.time_range, self.thread, self.cpu_parent = name, Range(start, end), 1, parent

    step = Event("orch::step", 0, 10_000)
    gather = Event("_GatherSeq", 1_000, 3_000, step)
    events = [step, gather, Event("c10d::allgather_", 1_100, 1_200, gather), Event("Redistribute", 4_000, 5_000, step)]
    out = summarize(events)
    assert out["parts_s"]["cp"] == 2e-3 and out["regions"]["cp"] == 1 and out["parts_s"]["tp"] == 1e-3
    assert abs(out["parts_s"]["compute"] - 7e-3) < 1e-12


@pytest.mark.parametrize("batch", [1, 2])
def test_torch_sequence_parallel_relayouts_are_the_copies_the_plan_charges(batch):
    """On [b, s, h] activations (stack.activation_layout=bsh) torch's functional collectives re-lay
    a sequence-dim all-gather's output unless the micro-batch is one sequence, and a reduce-scatter's
    input always (torch's own helpers, run here on the shapes they get). The plan charges exactly
    those whole-activation copies over the [s, b, h] layout (under torchtitan's selective AC: six
    all-gathers and four reduce-scatters per layer and micro-batch), and none under async TP."""
    import torch
    from torch._utils import _chunk_or_narrow_cat, _maybe_view_chunk_cat

    from orchestrator import compose, make_plan
    from orchestrator.plan.kernels import coefficients

    t, seq, h = 2, 16, 8
    gathered = torch.zeros(t * batch, seq // t, h)  # NCCL's all-gather output, the ranks' shards on dim 0
    ag_copies = _maybe_view_chunk_cat(gathered, t, 1).untyped_storage().data_ptr() != \
        gathered.untyped_storage().data_ptr()
    full = torch.zeros(batch, seq, h)
    rs_copies = _chunk_or_narrow_cat(full, t, 1, 0).untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    assert rs_copies and ag_copies == (batch > 1)
    copies = 6 * ag_copies + 4 * rs_copies

    base = ["hardware=h100_sxm", "stack=torchtitan", "model=llama3_8b", "cluster.nodes=1", "layout.tp=2",
            "layout.dp=4", f"training.micro_batch={batch}", "training.global_batch=16", "training.seq_len=4096",
            "training.recompute=selective"]
    plans = {k: make_plan(compose(base + extra)) for k, extra in
             (("sbh", ["stack.activation_layout=sbh"]), ("bsh", []), ("async", ["stack.tp_overlap=0.2"]),
              ("async_sbh", ["stack.tp_overlap=0.2", "stack.activation_layout=sbh"]))}
    spec = plans["bsh"].spec
    elementwise = coefficients(spec.hardware, spec.cost).elementwise
    m = 16 // (4 * batch)
    per_copy = 2 * (4096 * batch) * spec.model.hidden * 2 / (spec.hardware.hbm_gbps * 1e9) * elementwise
    extra = plans["bsh"].step.wall_compute - plans["sbh"].step.wall_compute
    assert extra == pytest.approx(copies * per_copy * spec.model.layers * m, rel=1e-6)
    assert plans["async"].step.wall_compute == pytest.approx(plans["async_sbh"].step.wall_compute, rel=1e-12)
