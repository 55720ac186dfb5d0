"""What really fails, at the sizes the plans are for (#23): a run never says it finished with
steps missing; after a node loss every whole surviving replica goes on with the global batch
exact (micro-batches split unevenly, gradients weighted so the update is the full batch's).
Losses against the uninterrupted single-process run (tiny_losses)."""
import json

import pytest

from conftest import failovers, losses_by_step, plan_of, run_cli, samples_read
from orchestrator.launch.supervisor import Workers

COMMON = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
          "training.global_batch=16", "cluster.nodes=4", "hardware.gpus_per_node=1", "layout.dp=4",
          "failover.quorum_s=5", "fault.kill_node=1", "fault.at_step=3"]


def _check(r, run, reference, steps):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = losses_by_step(run)
    assert sorted(got) == list(range(steps))
    assert [got[s] for s in range(steps)] == pytest.approx(reference[:steps], rel=1e-5)
    assert samples_read(run) == list(range(steps * 16))  # every sample once, per step that counts
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and f"all {steps} steps" in status["message"]
    return failovers(run)


def test_in_place_refused_falls_back_to_restart_and_finishes_every_step(tmp_path, tiny_losses):
    """The issue's repro: 3 copies cannot split the batch evenly (batch_policy=even), so in
    place is refused; the run must restart from its checkpoint, not report success at step 3."""
    r = run_cli([*COMMON, "layout.dp_shard=1", "training.steps=8", "training.checkpoint.every=2",
                 "failover.batch_policy=even"], tmp_path, timeout=600)
    refused, restart = _check(r, tmp_path / "run", tiny_losses, 8)
    assert refused["mode"] == "in_place_refused" and "evenly" in refused["reason"]
    assert restart["mode"] == "restart" and restart["new_layout"]["dp"] == 2 and restart["resumed_from_step"] == 2
    assert "FAILOVER 1 (restart" in r.stdout


def test_a_crashed_rank_drops_its_copy_and_the_survivors_keep_the_batch_exact(tmp_path, tiny_losses):
    """4 copies; rank 1 crashes with an error (fault.kind=crash_rank, its node stays up): the
    other 3 go on in place with 16 samples as 6 + 5 + 5, and the losses are the same."""
    r = run_cli([*COMMON, "layout.dp_shard=1", "training.steps=6", "fault.kind=crash_rank", "fault.rank=1"],
                tmp_path, timeout=600)
    (event,) = _check(r, tmp_path / "run", tiny_losses, 6)
    assert event["mode"] == "in_place" and event["new_layout"]["dp"] == 3 and event["steps_lost"] == 0
    assert event["nodes_lost"] == [] and "crashed" in r.stdout and "illegal memory access" in r.stdout
    assert event["survivors_released"] == "abort"  # the crash was known (its exit, its leader's connection)
    # the step in flight: the 3 survivors keep their gradients; copy 1's 4 micro-batches (4-7 of 16) are
    # recomputed over them, 2 + 1 + 1 (the first takes the one over), not the whole step
    assert (event["redo"], event["microbatches_recomputed"], event["microbatches_recomputed_per_rank"]) == (
        "kept", 4, 2), event
    plan = json.loads((tmp_path / "run" / f"attempt{event['attempt']}" / "plan.json").read_text())
    assert plan["config"]["training"]["uneven_batch"] and plan["layout"]["microbatches"] == 6


def test_a_rank_dead_of_its_own_segfault_is_a_crash_and_the_run_restarts_on_the_same_node(tmp_path, tiny_losses):
    """One copy sharded over the 2 ranks of one node; rank 1 dies of its own SIGSEGV (a fault in
    native code, as a gloo or driver bug ends a rank) after step 3: a crash, its node up, not a
    lost node (with one node, that would leave nothing to run on). faulthandler's line is the
    error; the run restarts on the same node from step 2's checkpoint with the same losses."""
    r = run_cli([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2", "layout.dp_shard=2",
                 "fault.kill_node=null", "fault.kind=segfault_rank", "fault.rank=1", "training.steps=4",
                 "training.checkpoint.every=2"], tmp_path, timeout=600)
    (event,) = _check(r, tmp_path / "run", tiny_losses, 4)
    assert event["mode"] == "restart" and event["nodes_lost"] == [] and event["new_layout"]["nodes"] == 1, event
    assert event["resumed_from_step"] == 2 and "SIGSEGV" in event["cause"], event
    assert event["error"].startswith("Fatal Python error: Segmentation fault"), event
    assert event["error"].endswith("in _fail_rank"), event  # where it died: the faulting thread's innermost frame


def test_a_hung_rank_is_named_and_its_node_lost_and_the_restart_pads_the_short_replicas(tmp_path, tiny_losses):
    """One copy sharded over 4 (FSDP); rank 1 stops making progress before step 4: past the
    progress deadline it is named, its Python stack dumped into its log, its node lost. The
    restart on 3 nodes runs dp 3 as 6 + 5 + 5 samples; the two short replicas run a padding
    micro-batch that weighs nothing (FSDP counts micro-batches), and the losses are the same."""
    r = run_cli([*COMMON, "training.steps=6", "training.checkpoint.every=2", "fault.kind=hang_rank", "fault.rank=1",
                 "failover.progress_deadline_s=8"], tmp_path, timeout=600)
    (event,) = _check(r, tmp_path / "run", tiny_losses, 6)
    assert event["mode"] == "restart" and event["new_layout"]["dp"] == 3 and event["new_layout"]["nodes"] == 3
    assert event["nodes_lost"] == [1] and "rank1 (pid" in event["cause"] and "hung" in event["cause"]
    assert event["seconds"]["detection"] >= 8
    log = (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert "_fault_if_injected" in log and "File " in log  # faulthandler's stack of the hung rank


def test_the_progress_deadline_follows_the_plan():
    from orchestrator.launch import progress
    from orchestrator.plan import timeouts

    fo = plan_of("hardware=cpu", "model=tiny").spec.failover
    slow = {"step": {"wall_s": 12.0}, "blast_radius": {"checkpoint_seconds": 3.0}}
    assert progress.deadline_s(slow, fo) == timeouts.DEADLINE_FACTOR * 15.0
    assert progress.deadline_s({"step": {"wall_s": 0.01}}, fo) == timeouts.DEADLINE_FLOOR_S
    beats = {1: progress.Beat(1, 3, True, 100.0), 2: progress.Beat(2, 4, False, 100.2),
             3: progress.Beat(3, 4, False, 100.1)}
    assert progress.hung(beats, 100.2 + 29, 30.0) is None
    assert progress.hung(beats, 100.2 + 31, 30.0).pid == 1  # the one behind: step 4 never begun


def test_the_watcher_names_the_rank_that_stopped_never_one_waiting_on_it():
    """Copies on SLURM (#36): the ranks waiting in the cross-copy collective beat `wait`; the rank that
    stopped before it is named once they waited the stall deadline, even when its beat is newer
    than theirs (the old rule, furthest behind by time, named a healthy waiting rank); when every
    rank waits (a peer cut off inside the collective) nobody is named."""
    from orchestrator.launch import progress

    beats = {1: progress.Beat(1, 7, False, 100.0, waiting=True), 2: progress.Beat(2, 7, False, 100.5),
             3: progress.Beat(3, 7, False, 100.1, waiting=True)}  # rank 2 began step 8 and never came
    assert progress.hung(beats, 100.0 + 9, 30.0, stall=10.0) is None
    assert progress.hung(beats, 100.0 + 11, 30.0, stall=10.0).pid == 2
    assert progress.hung(beats, 100.5 + 31, 30.0).pid == 2  # without the stall rule: at the hang deadline, still 2
    everyone = {p: progress.Beat(p, 7, False, 100.0 + p, waiting=True) for p in (1, 2, 3)}
    assert progress.hung(everyone, 1000.0, 30.0, stall=10.0) is None
    # the beats as the ranks write them (train/world.beat): the phase read back
    import tempfile
    from pathlib import Path

    from orchestrator.train import world

    with tempfile.TemporaryDirectory() as d:
        world.beat(Path(d), 7, "wait", 3)
        (b,) = progress.read(Path(d)).values()
        assert b.waiting and b.step == 7 and not b.ended and b.rank == 3


def test_the_plan_says_what_a_node_loss_costs_and_keeps_every_whole_replica():
    """llama3_405b on 1,024 nodes (replicas of 16 nodes): one node lost leaves 63 whole replicas."""
    from orchestrator.plan.replan import replan_on_survivors

    plan = plan_of("recipe=llama3_405b", "launcher=dry")
    loss = plan.blast_radius["after_node_loss"]
    per = plan.blast_radius["gpus_per_replica"] // plan.spec.hardware.gpus_per_node
    assert loss["nodes"] == (plan.spec.cluster.nodes - 1) // per * per and loss["dp"] == plan.layout.dp - 1
    assert loss["global_batch"] == plan.spec.training.global_batch and loss["uneven_batch"]
    assert loss["step_s"] > plan.step.wall_s
    # the slowest replica's micro-batches set the step: more than the even share, at least ceil(M / dp)
    assert loss["microbatches"] >= -(-plan.spec.training.global_batch // loss["dp"])
    even = replan_on_survivors(plan_of("recipe=llama3_405b", "launcher=dry", "failover.batch_policy=even"),
                               plan.spec.cluster.nodes - 1)
    assert even.plan.layout.dp < loss["dp"]  # the old rule halves the job


def test_the_uneven_split_reads_every_sample_once():
    from orchestrator.train.data import TokenSource, share

    src = TokenSource(vocab=64, seq_len=8)
    for M, dp, b in ((16, 3, 1), (2048, 63, 1), (12, 5, 2)):
        counts = [share(M, dp, r)[1] for r in range(dp)]
        assert sum(counts) == M and max(counts) - min(counts) <= 1
        got = [i for r in range(dp) for i in src.indices(2, M * b, dp, r, b)]
        assert got == list(range(2 * M * b, 3 * M * b))


def test_a_recovery_pass_reads_every_lost_sample_once_and_no_kept_one_again():
    """Copies lost mid-step (plan/split.py): the survivors' kept samples (the old split, read by the
    runtime's TokenSource) and what the new generation's data ranks recompute make the step's batch,
    each sample once; the copy's ranks pad to the copy's count. Shrinks, spares, two lost, uneven."""
    from orchestrator.plan.split import copy_ranks, lost_microbatches, recompute_run, recompute_share
    from orchestrator.train.data import TokenSource

    src = TokenSource(vocab=64, seq_len=8)
    b, step = 2, 3
    for M, copies, S, lost_at, after in ((16, 4, 1, [1], 3), (16, 2, 2, [1], 2), (24, 4, 2, [0, 2], 2),
                                         (20, 3, 1, [2], 3), (12, 4, 1, [1, 3], 5)):
        dp, dp_after = copies * S, after * S
        kept = [i for c in range(copies) if c not in lost_at for r in copy_ranks(c, S)
                for i in src.indices(step, M * b, dp, r, b)]
        lost = lost_microbatches(M, dp, S, lost_at)
        again = [step * M * b + j * b + k for r in range(dp_after) for j in recompute_share(lost, dp_after, r)
                 for k in range(b)]
        assert sorted(kept + again) == list(range(step * M * b, (step + 1) * M * b)), (M, copies, S, lost_at)
        for c in range(after):  # every rank of a copy runs its busiest rank's count
            run = recompute_run(len(lost), dp_after, S, c)
            assert all(len(recompute_share(lost, dp_after, r)) <= run for r in copy_ranks(c, S))
            assert run == max(len(recompute_share(lost, dp_after, r)) for r in copy_ranks(c, S))


class _Scripted(Workers):
    """Workers that end each attempt as scripted, writing the metrics the steps would."""

    def __init__(self, run_dir, outcomes, steps_per_attempt):
        self.run_dir, self.outcomes, self.steps, self.attempt = run_dir, list(outcomes), steps_per_attempt, 0

    def nodes(self):
        return [0, 1]

    def start(self, attempt, plan_dir, nodes, env, policy=None):
        self.attempt = attempt

    def wait(self):
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            for step in range(self.steps[self.attempt]):
                f.write(json.dumps({"step": step, "loss": 1.0, "step_time_s": 0.1, "attempt": self.attempt,
                                    "time": 0.0}) + "\n")
        return self.outcomes.pop(0)

    def stop(self):
        pass


def _supervise(tmp_path, outcomes, steps, *overrides):
    from orchestrator.launch.supervisor import supervise
    from orchestrator.report.artifacts import write_plan

    plan = plan_of("hardware=cpu", "model=tiny", "launcher=local", "cluster.nodes=2", "hardware.gpus_per_node=1",
                   "training.steps=8", *overrides)
    write_plan(plan, tmp_path, figures=False)
    code = supervise(plan, tmp_path, _Scripted(tmp_path, outcomes, steps), say=lambda *a, **k: None)
    return code, json.loads((tmp_path / "status.json").read_text())


def test_a_run_with_steps_missing_never_reads_completed(tmp_path):
    from orchestrator.launch.supervisor import EXIT_INCOMPLETE, Outcome

    code, status = _supervise(tmp_path, [Outcome(True)], [3])
    assert code == EXIT_INCOMPLETE and status["state"] == "failed" and "only 3 of training.steps=8" in status["message"]


def test_a_crash_recovers_once_and_the_same_error_at_the_same_step_stops_as_a_bug(tmp_path):
    from orchestrator.launch.supervisor import Outcome

    def crash(error):
        return Outcome(False, [], "rank 1 exited with status 1", crashed=True, error=error)

    # a fault (a different error the second time) recovers; the same error at the same step stops
    code, status = _supervise(tmp_path, [crash("RuntimeError: CUDA error"), crash("ValueError: bad shape"),
                                         crash("ValueError: bad shape")], [3, 3, 3])
    assert code == 1 and "same error at step 3 twice" in status["message"] and "bad shape" in status["message"]
    restarts = [e for e in failovers(tmp_path) if e["mode"] == "restart"]
    assert len(restarts) == 2 and restarts[0]["nodes_lost"] == [] and restarts[0]["new_layout"]["nodes"] == 2


def test_attempts_failing_at_the_same_step_stop_with_a_distinct_status(tmp_path):
    from orchestrator.launch.supervisor import Outcome
    from orchestrator.rundir import EXIT_NO_PROGRESS

    code, status = _supervise(tmp_path, [Outcome(False, [1], "node 1 lost")] * 2, [4, 4],
                              "cluster.spare_nodes=0", "failover.no_progress_attempts=2", "layout.dp=1",
                              "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.tp=2")
    assert code == EXIT_NO_PROGRESS and "no progress: 2 attempts in a row failed after step 4" in status["message"]


def test_the_failure_budget_is_a_rate(tmp_path):
    from orchestrator.launch.supervisor import Outcome

    crash = [Outcome(False, [], "rank crashed", crashed=True, error=f"RuntimeError: fault {k}") for k in range(3)]
    code, status = _supervise(tmp_path, crash, [1, 2, 3], "failover.max_failovers_per_hour=2")
    assert code == 1 and "2 restarts in the last hour reach failover.max_failovers_per_hour=2" in status["message"]


HOST_SCALARS = """
import sys, tempfile
import torch
import torch.distributed as dist
from orchestrator.train import world
from orchestrator.train.replicas import Replicas
for backend in sys.argv[1:]:
    dist.init_process_group(backend, init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    try:
        got = (world.host_reduce([1.5, 2.0]), world.host_gather([3.0]), Replicas.copy_totals(torch.tensor([1.0, 2.0, 0.0]), False))
        print(backend, "OK", got)
    except RuntimeError as e:
        print(backend, "REFUSED", str(e).splitlines()[0])
    dist.destroy_process_group()
"""


def test_host_scalars_ride_the_side_backend_a_gpu_world_gets():
    """On a GPU the runtime's groups are `cuda:nccl,cpu:gloo` (world.backend_for); here gloo
    stands in for NCCL on the device side, so the device-only group refuses CPU tensors the way
    NCCL does. The runtime's host-scalar collectives (loss, stop flag, memory, the copies'
    agreement) pass on the runtime's groups and are refused on a device-only one."""
    import subprocess
    import sys

    from orchestrator.train.world import backend_for

    gpu = backend_for("nccl", "cuda")
    assert gpu == "cuda:nccl,cpu:gloo" and backend_for("gloo", "cpu") == "gloo"
    here = gpu.replace("cuda:nccl", "cuda:gloo")
    r = subprocess.run([sys.executable, "-c", HOST_SCALARS, here, "cuda:gloo"], capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.splitlines()
    assert lines[0] == f"{here} OK ([1.5, 2.0], [[3.0]], [1.0, 2.0, 0.0, 1.0])", r.stdout + r.stderr
    assert lines[1].startswith("cuda:gloo REFUSED") and "device type cpu" in lines[1], r.stdout + r.stderr


def test_nodes_a_re_plan_leaves_over_wait_in_the_pool_and_the_next_re_plan_uses_them(tmp_path):
    """Six nodes, replicas of two (PP2 DP3): losing node 1 leaves five healthy, whole replicas fit
    on four and node 5 waits; losing node 3 then re-plans on all four healthy nodes (DP2 again),
    not on the three still in service."""
    from orchestrator.launch.supervisor import Outcome, supervise
    from orchestrator.report.artifacts import write_plan

    class Six(_Scripted):
        started = []

        def nodes(self):
            return list(range(6))

        def start(self, attempt, plan_dir, nodes, env, policy=None):
            self.attempt = attempt
            self.started.append(list(nodes))

    plan = plan_of("hardware=cpu", "model=tiny", "launcher=local", "cluster.nodes=6", "hardware.gpus_per_node=1",
                   "layout.pp=2", "layout.dp=3", "training.global_batch=12", "training.steps=8")
    assert plan.valid and plan.layout.dp_replicate == 1  # one copy of the state: every loss restarts
    write_plan(plan, tmp_path, figures=False)
    workers = Six(tmp_path, [Outcome(False, [1], "node 1 lost"), Outcome(False, [3], "node 3 lost"), Outcome(True)],
                  [3, 5, 8])
    assert supervise(plan, tmp_path, workers, say=lambda *a, **k: None) == 0
    first, second = [e for e in failovers(tmp_path) if e["mode"] == "restart"]
    assert first["healthy_nodes"] == 5 and first["nodes_in_service"] == [0, 2, 3, 4]
    assert first["nodes_waiting"] == [5] and first["new_layout"]["dp"] == 2
    assert second["healthy_nodes"] == 4 and second["nodes_in_service"] == [0, 2, 4, 5]
    assert second["new_layout"]["nodes"] == 4 and second["new_layout"]["dp"] == 2
    assert workers.started == [[0, 1, 2, 3, 4, 5], [0, 2, 3, 4], [0, 2, 4, 5]]
