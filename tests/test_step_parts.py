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
