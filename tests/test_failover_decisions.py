"""Failover decisions in one place (launch/failover.py), for every launcher: what failed ->
in place, restart or stop, with the reason; two nodes at once are one recovery; drained and
flapping nodes are left out and drained ones are not counted; the supervisor's own death is
survived by resuming from the last complete checkpoint. Real processes where they run here;
the decision itself on SLURM's own output (tests/golden/sinfo_states.txt: `sinfo -h -N -o
"%N|%T|%E"` on the local cluster, slurm/local-cluster.sh with 4 nodes, slurm-wlm 22.05.8, after
`scontrol update nodename=node2 state=drain`, node4 drained with a job running, node3 set down)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, failovers, losses_by_step, plan_of, run_cli, samples_read

COMMON = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
          "training.global_batch=16", "cluster.nodes=4", "hardware.gpus_per_node=1", "layout.dp=4"]


def _same_losses(run, reference, steps):
    got = losses_by_step(run)
    assert sorted(got) == list(range(steps))
    assert [got[s] for s in range(steps)] == pytest.approx(reference[:steps], rel=1e-5)
    assert samples_read(run) == list(range(steps * 16))


def test_two_nodes_lost_at_the_same_step_are_one_restart(tmp_path, tiny_losses):
    """fault.kill_node=[1,2]: both nodes die after step 3. One failover, on the 2 survivors (dp
    4 -> 2), neither dead node relaunched, and the losses of the fault-free run."""
    r = run_cli([*COMMON, "training.steps=6", "training.checkpoint.every=2", "fault.kill_node=[1,2]",
                 "fault.at_step=3"], tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "run"
    events = failovers(run)
    (restart,) = [e for e in events if e["mode"] == "restart"]
    assert len(events) == 1 and restart["nodes_lost"] == [1, 2] and restart["new_layout"]["nodes"] == 2
    assert restart["nodes_in_service"] == [0, 3] and restart["new_layout"]["dp"] == 2
    _same_losses(run, tiny_losses, 6)


def _killed_after(cmd, run, step, env):
    """Start `cmd`, SIGKILL the supervisor (the `orchestrate` process) once `step` steps completed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= step:
            break
        time.sleep(0.2)
    assert p.poll() is None, p.stdout.read()[-3000:]
    os.kill(p.pid, signal.SIGKILL)  # the supervisor's node dies: no handler runs
    p.wait(timeout=60)
    return p


def test_the_supervisor_killed_resumes_from_its_last_complete_checkpoint(tmp_path, tiny_losses):
    """The supervisor dies with SIGKILL (its node lost): every rank dies with it (PDEATHSIG),
    status.json says what it last knew and names the dead supervisor; the same command run
    again (what a requeued SLURM job does) resumes from the last complete checkpoint with the
    losses of the uninterrupted run."""
    from orchestrator.launch.runs import final_line

    run = tmp_path / "run"
    args = [*COMMON[:5], "cluster.nodes=2", "hardware.gpus_per_node=1", "layout.dp=2", "training.steps=6",
            "training.checkpoint.every=2", "training.global_batch=16"]
    cmd = [sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={run}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    _killed_after(cmd, run, 3, env)
    line = final_line(run)
    assert line.startswith("FAILED") and "supervisor" in line and "is gone" in line, line
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "the supervisor (pid" in r.stdout
    (event,) = failovers(run)
    assert event["mode"] == "supervisor_lost" and event["resumed_from_step"] == 2
    _same_losses(run, tiny_losses, 6)


# ---- the decision, on SLURM's own output -----------------------------------------------------
def _sinfo():
    from orchestrator.launch.failover import parse_sinfo

    return parse_sinfo((ROOT / "tests" / "golden" / "sinfo_states.txt").read_text())


def test_node_states_read_from_sinfo_tell_lost_from_drained():
    from orchestrator.launch.failover import DRAINED, NODE_LOST, node_state

    states = _sinfo()
    kinds = {n: node_state(*st) for n, st in states.items()}
    assert kinds == {"node1": "up", "node2": DRAINED, "node3": NODE_LOST, "node4": DRAINED}, states
    # scontrol show node's State= for the same nodes (node4 drained while a job ran on it)
    assert [node_state(s) for s in ("IDLE", "IDLE+DRAIN", "DOWN", "MIXED+DRAIN", "IDLE*")] == [
        "up", DRAINED, NODE_LOST, DRAINED, NODE_LOST]


def test_drained_nodes_are_left_out_and_not_counted_lost_ones_restart():
    from orchestrator.launch import failover

    plan = plan_of(*COMMON, "cluster.nodes=4")
    states = _sinfo()
    seen = failover.failures_from_states(states, ["node1", "node2", "node3", "node4"])
    drained_only = failover.decide([f for f in seen if f.kind == failover.DRAINED], plan)
    assert drained_only.action == "continue" and not drained_only.counted
    assert drained_only.excluded == ["node2", "node4"] and "not counted" in drained_only.reason
    both = failover.decide(seen, plan)
    assert both.action == "restart" and both.lost == ["node3"] and set(both.excluded) == {"node2", "node3", "node4"}
    # a restart caused by a drained node does not count against the budget
    history = [{"mode": "restart", "time": time.time(), "counted": False, "nodes_lost": []}] * 5
    assert failover.why_stop(plan_of(*COMMON, "failover.max_failovers=1"), history, 3) is None
    assert "max_failovers=1" in failover.why_stop(plan_of(*COMMON, "failover.max_failovers=1"),
                                                  history[:1] + [{**history[0], "counted": True}], 3)[0]


def test_a_flapping_node_is_excluded_after_its_second_failure():
    from orchestrator.launch import failover

    plan = plan_of(*COMMON)
    now = time.time()
    once = [{"mode": "restart", "time": now - 100, "nodes_lost": ["node3"]}]
    assert failover.flapping(once, now) == [] and failover.excluded_nodes(once, now) == []
    twice = once + [{"mode": "in_place", "time": now - 10, "nodes_lost": ["node3"]}]
    assert failover.flapping(twice, now) == ["node3"] and failover.excluded_nodes(twice, now) == ["node3"]
    old = [{**e, "time": now - failover.FLAP_WINDOW_S - 1} for e in twice]
    assert failover.flapping(old, now) == []  # outside the window: not flapping
    v = failover.decide([failover.Failure("node3", failover.NODE_LOST, "node node3 is down")], plan, history=twice,
                        now=now)
    assert v.action == "restart" and "flapping" in v.reason and v.excluded == ["node3"]


def test_copies_left_go_on_in_place_one_copy_restarts_and_a_repeated_error_stops():
    from orchestrator.launch import failover
    from orchestrator.rundir import EXIT_NO_PROGRESS

    copies = plan_of(*COMMON, "layout.dp_shard=1")
    lost = [failover.Failure(1, failover.NODE_LOST, "node 1 lost"), failover.Failure(2, failover.NODE_LOST,
                                                                                     "node 2 lost")]
    v = failover.decide(lost, copies, copies_alive=2)
    assert v.action == "in_place" and v.lost == [1, 2]
    assert failover.decide(lost, copies, copies_alive=2, spares=1).action == "spare"
    assert failover.decide(lost, plan_of(*COMMON, "layout.dp_shard=1", "failover.min_dp=3"),
                           copies_alive=2).action == "restart"
    one = plan_of(*COMMON)
    assert failover.decide(lost, one).action == "restart" and "one copy" in failover.decide(lost, one).reason
    crash = [failover.Failure(None, failover.CRASH, "rank 1 crashed", "ValueError: bad shape")]
    history = [{"mode": "restart", "time": time.time(), "error": "ValueError: bad shape", "failed_after_step": 3}]
    stop = failover.decide(crash, one, history=history, steps_done=3)
    assert stop.action == "stop" and "same error at step 3 twice" in stop.reason
    stuck = failover.decide(lost, plan_of(*COMMON, "failover.no_progress_attempts=2"), steps_done=3,
                            history=[{"mode": "restart", "time": time.time(), "failed_after_step": 3}])
    assert stuck.action == "stop" and stuck.exit_code == EXIT_NO_PROGRESS


def test_the_step_in_flight_keeps_its_gradients_unless_the_copy_or_a_second_loss_says_otherwise():
    """launch/inplace.keeps, the rule the coordinator's answer carries to every rank: 4 copies of one
    rank, copy 1 lost at step 3 -> kept, its 4 micro-batches of 16 recomputed over the 3 survivors (2 +
    1 + 1); two lost and a spare -> 8 over 3; the copy's layout changed (TP2 copies) or a second loss
    before step 3 committed -> the whole step is redone, and the event says why."""
    from orchestrator.launch.inplace import keeps
    from orchestrator.plan.replan import replan_with

    four = plan_of(*COMMON, "layout.dp_shard=1")
    _, three, _, why = replan_with(four, 3, 3, 1)  # the survivors' plan, as the decision makes it (16 as 6+5+5)
    assert why is None, why
    assert keeps(four, three, [0, 1, 2, 3], [0, 2, 3], 3, None) == {"path": "kept", "why": "", "lost": 4,
                                                                     "per_rank": 2}
    assert keeps(four, three, [0, 1, 2, 3], [0, 3, 4], 3, None)["lost"] == 8  # copies 1 and 2 lost, spare 4 in
    assert keeps(four, three, [0, 1, 2, 3], [0, 2, 3], 3, 3)["path"] == "step"  # the pass itself failed
    assert keeps(four, three, [0, 1, 2, 3], [0, 2, 3], 3, 2)["path"] == "kept"  # an earlier step's recovery
    tp2 = plan_of(*COMMON[:-1], "layout.dp=2", "layout.tp=2", "layout.dp_shard=1")
    other = keeps(four, tp2, [0, 1, 2, 3], [0, 1], 3, None)
    assert other["path"] == "step" and "tp 1 -> 2" in other["why"], other


def test_the_settle_window_follows_the_detection_deadline():
    from orchestrator.plan import timeouts

    assert timeouts.settle_s(30.0) == pytest.approx(timeouts.SETTLE_FRACTION * 30.0)
    assert timeouts.settle_s(1.0) == timeouts.SETTLE_MIN_S and timeouts.settle_s(1e6) == timeouts.SETTLE_MAX_S


@pytest.mark.parametrize("code", [0, 1, 6, 7])
def test_the_slurm_batch_step_ends_failed_with_the_supervisors_code(tmp_path, monkeypatch, code):
    """BatchJob (what submitit runs in the batch step) with the supervisor stubbed: 0 returns (SLURM:
    COMPLETED); any other code but EXIT_STOPPED leaves by SystemExit(code), which submitit's job
    runner does not catch (`except Exception`), so SLURM records FAILED with that exit code and does
    not requeue (a no-progress stop, EXIT_NO_PROGRESS=7, included). Returned, submitit would record
    it as a successful result and SLURM the job as COMPLETED 0:0."""
    from orchestrator.launch import batch, runs, srun
    from orchestrator.rundir import EXIT_NO_PROGRESS

    assert EXIT_NO_PROGRESS == 7
    plan = plan_of("hardware=cpu", "model=tiny", "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=1")
    monkeypatch.setattr(runs, "load_plan", lambda run_dir, latest=True: plan)
    monkeypatch.setattr(srun, "hostnames", lambda nodelist: ["n1", "n2"])
    monkeypatch.setattr(srun, "supervise", lambda *a, **k: code)
    monkeypatch.setattr(srun, "requeue_or_stop", lambda run_dir, lc: pytest.fail("requeued"))
    monkeypatch.setattr(srun, "start_standby", lambda spec, run_dir, node: None)  # no srun here
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    job = batch.BatchJob(str(tmp_path))
    if code == 0:
        assert job() == 0
        return
    with pytest.raises(SystemExit) as e:
        job()
    assert e.value.code == code and not isinstance(e.value, Exception)


def test_a_stopped_slurm_batch_step_is_requeued_not_failed(tmp_path, monkeypatch):
    from orchestrator.launch import batch, srun
    from orchestrator.rundir import EXIT_STOPPED

    asked = []
    monkeypatch.setattr(srun, "requeue_or_stop", lambda run_dir, lc: asked.append(lc))
    assert batch.BatchJob(str(tmp_path))._end(EXIT_STOPPED, "lc") == EXIT_STOPPED and asked == ["lc"]


# each rank of a LocalJob whose worker is this script ends as its RANK says, at its time
_ENDINGS = """
import os, signal, sys, time
how, at = os.environ["ENDINGS"].split(",")[int(os.environ["RANK"])].split(":")
time.sleep(float(at))
if how == "exit":
    sys.exit(1)
if how == "wait":
    time.sleep(60)
os.kill(os.getpid(), getattr(signal, how))
time.sleep(60)
"""


@pytest.mark.parametrize("endings, cause, node_lost, lost_nodes", [
    # a segfault (its own fault) and, beside it, a peer's error exit and an abort: a crash, no node lost
    ("SIGSEGV:0.2,exit:0.4,SIGABRT:0.5,wait:0", 0, False, []),
    # the fault is named the cause over a lower rank's error exit
    ("exit:0.2,SIGSEGV:0.4,SIGABRT:0.5,wait:0", 1, False, []),
    # an abort (how c10d ends a rank whose peer is gone) is not ranked above an error exit
    ("exit:0.4,SIGABRT:0.2,wait:0,wait:0", 0, False, []),
    # node 1's rank 3 killed from outside in the same window: that is the cause, node 1 lost
    ("SIGSEGV:0.2,exit:0.4,SIGABRT:0.5,SIGKILL:0.6", 3, True, [1]),
])
def test_a_rank_killed_from_outside_is_a_lost_node_and_its_own_fatal_signal_a_crash(tmp_path, endings, cause,
                                                                                     node_lost, lost_nodes):
    """The local launcher's one rule (launch/processes.crashed / node_lost) on real processes: a rank
    that dies of SIGSEGV or SIGABRT crashed and its node stays up; only a rank killed from outside
    (SIGKILL: how an emulated node dies) loses its node. The window's cause: a lost node's rank, else
    a rank's own fault, else the lowest of the others."""
    from orchestrator.launch.processes import LocalJob, crashed

    job = LocalJob(tmp_path, nodes=2, gpus_per_node=2, env={"ENDINGS": endings}, echo=False,
                   worker=[sys.executable, "-c", _ENDINGS])
    job.start()
    res = job.wait(timeout=60, settle_s=5.0)  # every ending of the table inside one window, even under load
    assert not res.ok and res.failed_rank == cause, res
    assert res.signalled is node_lost and res.failed_nodes == lost_nodes, res
    assert crashed(res.code) is not node_lost, res
