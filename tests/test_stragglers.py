"""Stragglers (#23): a node persistently slower than the rest (fault.kind=slow_node) is named in
failover.json, status and TensorBoard, and with failover.evict_stragglers and a warm spare it
is moved to the spare with the losses of the uninterrupted run; without a spare it is kept.
The rule itself (launch/stragglers.py) runs on the coordinator's commits."""
import json

import pytest

from conftest import losses_by_step, run_cli, samples_read

SLOW = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
        "training.global_batch=16", "cluster.nodes=4", "hardware.gpus_per_node=1", "layout.dp=4",
        "layout.dp_shard=1", "failover.quorum_s=5", "training.steps=8", "fault.kind=slow_node", "fault.kill_node=1",
        "fault.at_step=1", "fault.slow_s=0.5", "failover.straggler_steps=3"]


def _coordinator(copies):
    from orchestrator.launch.control import Coordinator, Decision
    from orchestrator.launch.stragglers import Stragglers

    return Coordinator(copies, "plan", lambda *a: Decision(False, reason="test"), stragglers=Stragglers(1.3, 3))


def _step(coord, step, busy, saving=()):
    got = []
    for c, t in busy.items():
        coord.handle({"op": "commit", "copy": c, "gen": 0, "step": step, "sums": [1.0, 1.0, 0.0], "busy": t,
                      "saving": c in saving}, got.append)
    assert len(got) == len(busy) and all(a["op"] == "commit" for a in got)  # every copy granted: none evicted


def test_the_coordinator_names_a_copy_slower_by_the_margin_for_the_set_steps_and_never_a_saving_one():
    coord = _coordinator([0, 1, 2, 3])
    fast = {0: 0.2, 1: 0.2, 2: 0.21, 3: 0.2}
    for s in range(4):  # copy 0 is slow only while it saves a checkpoint: never counted
        _step(coord, s, {**fast, 0: 5.0}, saving={0})
    _step(coord, 4, {**fast, 2: 0.6})
    _step(coord, 5, {**fast, 2: 0.6})
    _step(coord, 6, fast)  # one normal step breaks the run of steps
    _step(coord, 7, {**fast, 2: 0.6})
    _step(coord, 8, {**fast, 2: 0.6}, saving={0})  # a save elsewhere changes nothing for copy 2
    assert coord.take_stragglers() == []
    _step(coord, 9, {**fast, 2: 0.6})
    (s,) = coord.take_stragglers()
    # the median from the commit tree's busy histogram: known to within one bin (train/tree.BUSY_BIN)
    assert (s.copy, s.step, s.steps) == (2, 9, 3) and s.ratio == pytest.approx(3.0, rel=0.05)
    for k in range(10, 14):  # named once
        _step(coord, k, {**fast, 2: 0.6})
    assert coord.take_stragglers() == []


def test_noise_under_the_floor_and_the_faster_of_two_are_not_stragglers():
    from orchestrator.launch.stragglers import MIN_EXCESS_S, Stragglers
    from orchestrator.train import tree

    s = Stragglers(1.3, 2)

    def summary(busy):  # what the coordinator sums from each copy's commit (train/tree.py)
        out = None
        for c, (t, saving) in busy.items():
            out = tree.merge_busy(out, tree.busy_of({"copy": c, "busy": t, "saving": saving}))
        return out

    for step in range(4):  # 2x slower, but by less than the floor (a millisecond step's jitter)
        s.observe(step, summary({0: (0.01, False), 1: (0.01 + MIN_EXCESS_S / 2, False)}))
    assert s.take() == []
    for step in range(4, 6):  # two copies: the lower median is the faster one, so the slower is named
        s.observe(step, summary({0: (1.0, False), 1: (2.0, False)}))
    assert [x.copy for x in s.take()] == [1]


def test_a_straggler_is_not_a_hang():
    """It makes progress every step: the progress deadline sees its beats."""
    from orchestrator.launch import progress

    beats = {1: progress.Beat(1, 5, True, 100.0), 2: progress.Beat(2, 4, False, 95.0)}
    assert progress.hung(beats, 100.0 + 29, 30.0) is None


def test_a_slow_node_is_named_a_straggler_and_kept_without_a_spare(tmp_path, tiny_losses, capsys):
    r = run_cli([*SLOW, "failover.evict_stragglers=true"], tmp_path, timeout=600)  # no spare: kept
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "run"
    (event,) = json.loads((run / "failover.json").read_text())
    assert event["mode"] == "straggler" and event["nodes"] == [1] and not event["evicted"]
    assert event["ratio"] > 1.3 and "no warm spare" in event["action"]
    (named,) = json.loads((run / "status.json").read_text())["stragglers"]
    assert named["nodes"] == [1] and "STRAGGLER: copy 1 on node(s) [1]" in r.stdout
    got = losses_by_step(run)
    assert [got[s] for s in range(8)] == pytest.approx(tiny_losses[:8], rel=1e-5)
    from orchestrator.launch.runs import show_status

    show_status(run)
    assert "straggler copy 1 on node(s) [1] is a straggler" in capsys.readouterr().out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard")).Reload()
    assert acc.Scalars("failover/straggler_ratio")[0].value == pytest.approx(event["ratio"])


def test_an_evicted_straggler_moves_to_the_spare_and_the_losses_are_the_fault_free_runs(tmp_path, tiny_losses):
    r = run_cli([*SLOW, "cluster.spare_nodes=1", "failover.evict_stragglers=true"], tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "run"
    named, moved = json.loads((run / "failover.json").read_text())
    assert named["mode"] == "straggler" and named["evicted"] and named["nodes"] == [1]
    assert moved["mode"] == "spare" and moved["nodes_lost"] == [1] and moved["copies_lost"] == [1]
    assert moved["new_layout"]["dp"] == 4 and moved["steps_lost"] == 0
    assert "node 1 evicted as a straggler" in r.stdout
    got = losses_by_step(run)
    assert sorted(got) == list(range(8))
    assert [got[s] for s in range(8)] == pytest.approx(tiny_losses[:8], rel=1e-5)
    assert samples_read(run) == list(range(8 * 16))


def test_a_slow_node_without_its_node_or_with_a_margin_of_one_is_refused_before_launch(cli):
    r = cli("hardware=cpu", "model=tiny", "launcher=local", "cluster.nodes=2", "hardware.gpus_per_node=1",
            "training.steps=5", "fault.kind=slow_node", "fault.at_step=1", "failover.straggler_margin=1.0")
    assert r.returncode == 2 and "[fault.kill_node]" in r.stderr and "fault.kill_node=<node>" in r.stderr
    assert "[failover.straggler_margin, failover.straggler_steps]" in r.stderr and "Traceback" not in r.stderr
