"""SLURM for real: a multi-node cluster on this machine (slurm/local-cluster.sh), submitit.

In CI (CI=true) a cluster that cannot come up is a failure; elsewhere, without root,
these tests skip and say why."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, failovers, golden, local_slurm, losses_by_step, run_cli, samples_read

SCRIPT = ROOT / "slurm" / "local-cluster.sh"
COMMON = ["hardware=cpu", "model=tiny", "figures=false", "training.seq_len=64", "training.global_batch=16"]


@pytest.fixture(scope="module")
def cluster():
    yield from local_slurm({"NODES": "2", "GPUS": "4", "CPUS": "8"})


@pytest.fixture(scope="module")
def reference(tiny_losses):
    """Uninterrupted single-process run, 40 steps (the layout does not change the maths)."""
    return tiny_losses[:40]


def test_sweep_submits_exactly_the_valid_points_and_three_axes_train_as_one_process(cluster, tmp_path, reference):
    """A sweep on 2 nodes x 4: the TP8 points (across nodes; with PP2 not dividing the world) are
    never submitted; TP2 and TP2 x PP2 x DP2 go as one job array, and the three-axis job's
    losses are the single process's."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "orchestrator", "-m", *COMMON, "launcher=slurm", "launcher.wait=true",
           "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2,8", "layout.pp=1,2", "training.steps=2",
           f"hydra.sweep.dir={sweep}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((sweep / "sweep.json").read_text())
    points = summary["points"]
    assert len(points) == 4
    invalid = [p for p in points if not p["valid"]]
    assert len(invalid) == 2 and all("layout.tp=8" in p["overrides"] for p in invalid)
    assert all(p["errors"] and "layout.tp" in json.dumps(p["errors"]) for p in invalid)
    assert all("job_id" not in p for p in invalid)
    valid = [p for p in points if p["valid"]]
    assert len({p["job_id"] for p in valid}) == 2 and len({p["job_id"].split("_")[0] for p in valid}) == 1
    for p in valid:
        assert p["state"] == "completed" and p["predicted_step_s"] > 0 and p["measured_step_s"] > 0
        assert 0 < p["measured_mfu"] < 1
    assert "NO" in r.stdout and "spans 2 nodes" in r.stdout and "does not divide" in r.stdout
    (three,) = [p for p in valid if "layout.pp=2" in p["overrides"]]
    got = losses_by_step(Path(three["dir"]))
    assert [got[s] for s in range(2)] == pytest.approx(reference[:2], rel=1e-5)
    state = subprocess.run(["sacct", "-X", "-n", "-P", "-j", three["job_id"], "-o", "State,NNodes"],
                           capture_output=True, text=True).stdout.split("\n")[0]
    assert state.startswith("COMPLETED|2"), state


def test_a_sweep_preview_submits_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "orchestrator", "-m", *COMMON, "launcher=slurm", "launcher.submit=false",
                        "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=1,2", f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    points = json.loads((sweep / "sweep.json").read_text())["points"]
    assert len(points) == 2 and all(p["valid"] and "job_id" not in p for p in points)
    for p in points:
        run = Path(p["dir"])
        assert (run / "slurm" / "preview.sbatch").exists() and not (run / "slurm_jobs.jsonl").exists()
    assert r.stdout.count("nothing was submitted") == 2


def test_preempted_job_requeues_and_finishes_from_its_checkpoint(cluster, tmp_path, reference):
    import submitit

    run = tmp_path / "pre" / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *COMMON, "launcher=slurm", "launcher.wait=true",
                             "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2", "training.steps=30",
                             f"hydra.run.dir={run}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and
                                                len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
        time.sleep(0.5)
    rec = json.loads((run / "slurm_jobs.jsonl").read_text().splitlines()[0])
    submitit.SlurmJob(folder=rec["folder"], job_id=rec["job_id"])._interrupt()  # preemption: TERM then USR2
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    assert json.loads((run / "requeues.json").read_text())["count"] == 1
    assert "resumed from" in out
    got = losses_by_step(run)
    assert sorted(got) == list(range(30))
    assert [got[s] for s in range(30)] == pytest.approx(reference[:30], rel=1e-5)


def _a_snapshot_after(run: Path, node: str, step: int, within_s: float = 120) -> int:
    """Wait (bounded) until `node`'s snapshot keeper (its address in RUN_DIR/keepers/NODE.json, the
    job's key in RUN_DIR/keeper.key) holds every rank's snapshot of a step after `step`; that step."""
    from orchestrator.train import keeper, wire

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            addr = json.loads((run / "keepers" / f"{node}.json").read_text())["addr"]
            point = keeper.restore_point(keeper.inventories([addr], wire.read_secret(run / "keeper.key"), 5), step)
        except (OSError, ValueError, KeyError):
            point = {}
        if point.get("source") == "snapshot":
            return point["step"]
        time.sleep(0.2)
    pytest.fail(f"{node}'s keeper held no complete snapshot after step {step} within {within_s} s")


def _detached_run_with_a_node_killed(tmp_path, *layout, snapshot: bool = False) -> Path:
    """Submit and walk away (no launcher.wait): the job owns the failure. Kill node2 once nine
    steps are done (`snapshot`: and node1's keeper holds a snapshot of a step after 8), then only
    watch status.json until the run ends."""
    run = tmp_path / "run"
    r = run_cli([*COMMON, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                 "training.steps=40", *layout], tmp_path, timeout=300)
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and
                                                    len((run / "metrics.jsonl").read_text().splitlines()) >= 9):
            time.sleep(0.3)
        if snapshot:
            _a_snapshot_after(run, "node1", 8)
        subprocess.run([str(ROOT / "slurm" / "kill-node.sh"), "node2"], check=True, timeout=30)
        deadline = time.monotonic() + 600
        state = None
        while time.monotonic() < deadline and state not in ("completed", "failed", "stopped", "cancelled"):
            state = json.loads((run / "status.json").read_text()).get("state")
            time.sleep(1)
        assert state == "completed", (run / "status.json").read_text()
    finally:
        subprocess.run([str(SCRIPT), "up"], env=dict(os.environ, NODES="2", GPUS="4", CPUS="8"),
                       capture_output=True, timeout=300)  # node2 back in service for later tests
    return run


def test_a_detached_job_restarts_on_the_survivors_when_its_state_has_one_copy(cluster, tmp_path, reference):
    """One copy of the state; node2 killed after step 8 once node1's snapshot keeper (node2's ranks'
    buddy, an srun step of the job beside the ranks) holds a snapshot after it: the run restarts on
    node1 from that memory snapshot, later than any checkpoint (the only one is the last step's: the
    kill may land at any step of the run's rest), with the uninterrupted run's losses."""
    run = _detached_run_with_a_node_killed(tmp_path, "training.checkpoint.every=40",
                                           "training.checkpoint.snapshot_every=2", snapshot=True)
    (event,) = failovers(run)
    assert event["mode"] == "restart" and event["node"] == "node2"
    assert event["old_layout"]["dp"] == 4 and event["new_layout"]["dp"] == 2
    assert event["nodes_in_service"] == ["node1"]
    assert event["resumed_from"] == "snapshot" and 8 < event["resumed_from_step"] < 40, event
    logs = "".join(f.read_text() for f in (run / "attempt1" / "logs").glob("rank*.log"))
    assert "resumed from the memory snapshot of step" in logs
    got = losses_by_step(run)
    assert [got[s] for s in range(40)] == pytest.approx(reference, rel=1e-5)
    assert samples_read(run) == list(range(40 * 16))  # none lost, none repeated


def test_a_detached_job_goes_on_in_place_when_its_state_has_copies(cluster, tmp_path, reference):
    run = _detached_run_with_a_node_killed(tmp_path, "layout.dp_shard=2", "failover.quorum_s=5")
    (event,) = failovers(run)
    assert event["mode"] == "in_place" and event["steps_lost"] == 0 and event["new_layout"]["dp"] == 2
    assert event["recovery_s"] > 0
    # the step in flight finished from copy 0's kept gradients: copy 1's 8 micro-batches of 16 recomputed, 4 a rank
    assert (event["redo"], event["microbatches_recomputed"], event["microbatches_recomputed_per_rank"]) == (
        "kept", 8, 4), event
    got = losses_by_step(run)
    assert [got[s] for s in range(40)] == pytest.approx(reference, rel=1e-5)
    assert samples_read(run) == list(range(40 * 16))


def _ended(run: Path, within_s: float = 600) -> str | None:
    """The state a detached run ends in (its status.json), or the last seen after `within_s`."""
    deadline, state = time.monotonic() + within_s, None
    while time.monotonic() < deadline and state not in ("completed", "failed", "stopped", "cancelled"):
        state = json.loads((run / "status.json").read_text()).get("state")
        time.sleep(1)
    return state


def _detached_run_to_its_end(tmp_path, *overrides) -> Path:
    """A detached run on the 2-node cluster (2 GPUs each), submitted and followed until it ends
    completed; its run directory."""
    run = tmp_path / "run"
    r = run_cli([*COMMON, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=2", *overrides], tmp_path,
                timeout=300)
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert _ended(run) == "completed", (run / "status.json").read_text()
    return run


def test_a_detached_job_names_a_hung_rank_with_its_stack_and_restarts_without_its_node(cluster, tmp_path, reference):
    """fault.kind=hang_rank under SLURM: the supervisor reads the ranks' progress beats in the
    shared run directory; past the deadline the rank furthest behind is named, every task dumps
    its stack (SIGUSR1 through srun), and its node is treated as lost: the run restarts on the
    other node from its checkpoint with the uninterrupted run's losses."""
    run = _detached_run_to_its_end(tmp_path, "layout.dp=4", "training.steps=8", "training.checkpoint.every=2",
                                             "fault.kind=hang_rank", "fault.rank=3", "fault.at_step=5",
                                             "failover.progress_deadline_s=10")
    (event,) = failovers(run)
    assert event["mode"] == "restart" and "rank 3 (pid" in event["cause"] and "hung" in event["cause"]
    assert event["nodes_lost"] == [event["node"]] and event["nodes_in_service"] != [event["node"]]
    assert event["seconds"]["detection"] >= 10 and event["resumed_from_step"] == 4
    log = Path(event["cause"].split("its Python stack is in ")[1].split(";")[0]).read_text()
    assert "_fault_if_injected" in log and "File " in log  # faulthandler's stack of the hung rank
    got = losses_by_step(run)
    assert [got[s] for s in range(8)] == pytest.approx(reference[:8], rel=1e-5)
    assert samples_read(run) == list(range(8 * 16))


def test_a_crash_beat_stops_a_one_copy_step_at_once(tmp_path, monkeypatch):
    """The supervisor's side of a crash on SLURM without the cluster: a rank that ends with an error of
    its own says so in its beat (train/world.crashed_beat); SrunWorkers.wait stops the step (a real
    process group here) at once and reports the crash with the rank's error line. A rank that failed
    of its peer (a connection reset) does not: what it saw may be a node lost, which SLURM confirms."""
    from conftest import plan_of
    from orchestrator.launch import progress
    from orchestrator.launch.srun import SrunWorkers
    from orchestrator.train import world

    plan = plan_of(*COMMON, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4")
    run = tmp_path / "run"
    logs = run / "attempt0" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank3.log").write_text("[rank 3] INFO step 5/12\nRuntimeError: CUDA error: an illegal memory access\n")
    monkeypatch.setenv("SLURM_PROCID", "3")
    world.beat(run, 5, "begin", 3)
    world.crashed_beat(RuntimeError("Connection closed by peer [10.0.0.2]:1234"))
    assert progress.crashed(run) is None  # a peer's failure seen: not the crashed one
    world.crashed_beat(RuntimeError("CUDA error: an illegal memory access"))
    assert progress.crashed(run).rank == 3
    workers = SrunWorkers(plan.spec, run, ["n1", "n2"])
    workers.timeouts(plan.to_json())
    workers.plan_dir = run / "attempt0"
    workers.proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    out = workers.wait()
    assert workers.proc.poll() is not None  # the step was stopped, not waited out
    assert not out.ok and out.crashed and "stopped at once" in out.cause and "illegal memory access" in out.error
    world.forget_beat()


def test_allocation_that_does_not_match_the_plan_stops_before_training(cluster, tmp_path):
    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.launch.slurm import make_executor
    from orchestrator.launch.batch import BatchJob

    r = run_cli([*COMMON, "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4", "launcher=dry"], tmp_path)
    assert r.returncode == 0
    plan_dir = tmp_path / "run"
    small = typed(compose([*COMMON, "cluster.nodes=1", "hardware.gpus_per_node=2", "launcher=slurm"]))
    job = make_executor(small, tmp_path / "by_hand").submit(BatchJob(str(plan_dir)))
    with pytest.raises(Exception) as err:
        job.result()
    assert "allocation mismatch" in str(err.value) and "cluster.nodes=2" in str(err.value)
    assert not (plan_dir / "metrics.jsonl").exists()
    assert json.loads((plan_dir / "status.json").read_text())["state"] == "failed"


@pytest.mark.parametrize("bad", ["launcher.job_name='x;reboot'", "launcher.setup=['echo $(id)']",
                                 "launcher.setup=['module load x\nrm -rf /']", "launcher.partition='a b'"])
def test_values_that_would_reach_the_shell_are_rejected(tmp_path, bad):
    r = run_cli([*COMMON, "launcher=slurm", bad], tmp_path)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    assert "nothing was submitted" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "slurm").exists()


def test_local_only_settings_are_refused_on_slurm_not_ignored(tmp_path):
    r = run_cli([*COMMON, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                 "cluster.spare_nodes=1", "fault.kill_node=1", "fault.at_step=3"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "[cluster.spare_nodes]" in r.stderr and "[fault.kill_node]" in r.stderr and "kill-node.sh" in r.stderr
    assert not (tmp_path / "run" / "slurm").exists()


def test_sbatch_script_matches_the_golden_file(tmp_path):
    from conftest import sbatch_text

    text = sbatch_text([*COMMON, "cluster.nodes=2", "hardware.gpus_per_node=4", "launcher=slurm",
                        "launcher.partition=gpu", "launcher.account=research", "launcher.qos=high",
                        "launcher.time_min=90", "launcher.setup=['module load cuda/12.4']", "launcher.exclude=node7"],
                       tmp_path / "jobs")
    assert text == golden("sbatch.txt", text)


def test_preview_writes_the_exact_batch_script_and_srun_line_in_a_container(tmp_path):
    """launcher.submit=false: nothing reaches SLURM; the batch script and the training step's
    srun line (pyxis options, the run directory mounted, the image's python) are printed and
    kept. Golden, since no cluster here has pyxis."""
    r = run_cli([*COMMON, "cluster.nodes=2", "hardware.gpus_per_node=4", "launcher=slurm", "launcher.submit=false",
                 "launcher.partition=gpu", "launcher.container_image=nvcr.io/nvidia/pytorch:24.05-py3",
                 "launcher.container_mounts=[/lustre/data:/data:ro]", "launcher.container_workdir=/workspace"],
                tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = tmp_path / "run"
    assert "nothing was submitted" in r.stdout and not (run / "slurm_jobs.jsonl").exists()
    text = ((run / "slurm" / "preview.sbatch").read_text() + "---\n" + (run / "slurm" / "preview.srun").read_text())
    assert text.split("---\n")[1].strip() in r.stdout
    text = text.replace(str(run), "RUN").replace(sys.executable, "PYTHON")
    assert text == golden("preview_container.txt", text)


def test_your_own_program_is_requeued_on_preemption_and_resumes_from_its_checkpoint(cluster, tmp_path):
    """trainer=command on 2 nodes x 2: examples/train_fsdp.py under srun (torchrun's environment
    from SLURM's, launch/trainers.py); preempted mid-run (TERM, then USR2), every rank saves and
    exits 3, the job requeues itself and resumes from the program's own DCP checkpoint, ending
    with the losses of an uninterrupted single-process run."""
    import numpy as np
    import submitit

    from test_trainers import _uninterrupted

    steps, run = 32, tmp_path / "run"  # preempted after 5: 27 steps of margin for the signal to land before the end
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "hardware=cpu", "model=tiny", "figures=false",
                             "launcher=slurm", "launcher.wait=true", "cluster.nodes=2", "hardware.gpus_per_node=2",
                             f"training.steps={steps}", "training.global_batch=8", "training.checkpoint.every=8",
                             "trainer=command", f"trainer.command='python {ROOT}/examples/train_fsdp.py --lr 1e-2'",
                             f"hydra.run.dir={run}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and
                                                len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
        time.sleep(0.3)
    rec = json.loads((run / "slurm_jobs.jsonl").read_text().splitlines()[0])
    submitit.SlurmJob(folder=rec["folder"], job_id=rec["job_id"])._interrupt()  # preemption: TERM then USR2
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    assert json.loads((run / "requeues.json").read_text())["count"] == 1
    logs = "".join(f.read_text() for f in run.rglob("logs/rank*.log"))
    assert "stopping after step" in logs and "resumed from step" in logs
    got = losses_by_step(run)
    ref = _uninterrupted(json.loads((run / "plan.json").read_text()), steps, 1e-2)
    assert sorted(got) == list(range(steps))
    assert np.allclose([got[s] for s in range(steps)], ref, rtol=2e-5, atol=0)


def test_a_hung_copy_is_named_by_its_stall_and_the_others_go_on_in_place(cluster, tmp_path, reference):
    """#36: two copies of the state (dp_shard=2), rank 3 (copy 1, node2) stops before step 6. The
    ranks waiting on it in the cross-copy all-reduce beat so; past the stall deadline (20 s, the
    collective timeout is 120 s) the supervisor names it from the beats, the coordinator aborts the
    survivors' collectives at once and copy 0 goes on in place in the same step (no restart, no
    checkpoint read); copy 1's ranks, declared lost, leave by themselves (fenced)."""
    run = _detached_run_to_its_end(tmp_path, "layout.dp=4", "layout.dp_shard=2", "training.steps=8",
                                             "fault.kind=hang_rank", "fault.rank=3", "fault.at_step=5",
                                             "failover.quorum_s=5", "failover.timeout_s=120")
    (event,) = failovers(run)
    assert event["mode"] == "in_place" and event["copies_lost"] == [1] and event["new_layout"]["dp"] == 2, event
    assert event["survivors_released"] == "abort", event
    assert (event["redo"], event["microbatches_recomputed"]) == ("kept", 8), event  # not the whole step redone
    logs = "".join(f.read_text() for f in run.rglob("rank*.log"))
    assert "aborted by the coordinator" in logs and "declared lost in generation 0" in logs
    assert not (run / "checkpoints").exists() or "CHECKPOINT" not in logs
    got = losses_by_step(run)
    assert [got[s] for s in range(8)] == pytest.approx(reference[:8], rel=1e-5)
    assert samples_read(run) == list(range(8 * 16))


def test_a_failed_batch_job_ends_failed_in_sacct_with_its_code(cluster, tmp_path):
    """A program that fails at once, every attempt: the supervisor stops the run and the batch job
    ends FAILED with a non-zero exit code in SLURM's own accounting (not COMPLETED 0:0)."""
    script = tmp_path / "fail.py"
    script.write_text("raise RuntimeError('a bug in the user program')\n")
    run = tmp_path / "run"
    r = run_cli(["hardware=cpu", "model=tiny", "figures=false", "launcher=slurm", "cluster.nodes=1",
                 "hardware.gpus_per_node=1", "training.steps=4", "trainer=command",
                 f"trainer.command='python {script}'",
                 "launcher.node_fail_wait_s=5"],  # its node stays up: each attempt's exit is a crash 5 s later,
                tmp_path, timeout=300)  # not after SlurmdTimeout + 30 s (60 s at least; the suite's time)
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    job = json.loads((run / "slurm_jobs.jsonl").read_text().splitlines()[0])["job_id"]
    deadline, out = time.monotonic() + 600, ""
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(job), "-o", "State,ExitCode"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
        if out and out.split("|")[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            break
        time.sleep(2)
    state, code = out.split("|")
    assert state == "FAILED" and code.split(":")[0] != "0", out
    assert json.loads((run / "status.json").read_text())["state"] == "failed"


def test_a_crashed_rank_stops_the_step_at_once_and_the_run_restarts(cluster, tmp_path, reference):
    """One copy of the state (FSDP over 4): rank 3 crashes with an error of its own before step 6. Its
    beat says so (train/world.crashed_beat) and the supervisor stops the step at once, not after its
    peers' collective timeout, and restarts from the checkpoint with the uninterrupted run's losses."""
    run = _detached_run_to_its_end(tmp_path, "layout.dp=4", "training.steps=8", "training.checkpoint.every=2",
                                             "fault.kind=crash_rank", "fault.rank=3", "fault.at_step=5",
                                             "failover.timeout_s=120")
    (event,) = failovers(run)
    assert event["mode"] == "restart" and "stopped at once" in event["cause"], event
    assert "illegal memory access" in event["cause"] and event["resumed_from_step"] == 4, event
    got = losses_by_step(run)
    assert [got[s] for s in range(8)] == pytest.approx(reference[:8], rel=1e-5)
    assert samples_read(run) == list(range(8 * 16))


def test_a_rank_dead_of_its_own_segfault_is_a_crash_and_the_run_restarts_on_every_node(cluster, tmp_path,
                                                                                        reference):
    """Rank 3 dies of its own SIGSEGV (a fault in native code: no Python error, no beat of its own)
    before step 6. Its node stays up: a crash, not a node lost, so the restart keeps both nodes
    (dp 4) and resumes from the checkpoint with the uninterrupted run's losses. Its log says how it
    died (faulthandler's line, printed on a node that is up), so the supervisor does not wait out
    the window in which SLURM would mark a lost node down (launcher.node_fail_wait_s) first."""
    run = _detached_run_to_its_end(tmp_path, "layout.dp=4", "training.steps=8", "training.checkpoint.every=2",
                                             "fault.kind=segfault_rank", "fault.rank=3", "fault.at_step=5",
                                             "failover.timeout_s=120")
    (event,) = failovers(run)
    assert event["mode"] == "restart" and event["nodes_lost"] == [] and event["resumed_from_step"] == 4, event
    assert event["error"].startswith("Fatal Python error: Segmentation fault"), event
    assert "decided on its log, not after SLURM's node window" in event["cause"], event  # the path it took
    assert event["new_layout"]["dp"] == 4 and event["new_layout"]["nodes"] == 2, event
    got = losses_by_step(run)
    assert [got[s] for s in range(8)] == pytest.approx(reference[:8], rel=1e-5)
    assert samples_read(run) == list(range(8 * 16))


def test_a_standby_supervisor_takes_over_when_the_first_node_dies(cluster, tmp_path, reference):
    """#36: the supervisor's own node (node1, the batch step's: the supervisor, the coordinator, the
    store) dies as a machine that lost power (slurm/kill-node.sh --freeze: nothing of it reports
    again). The standby supervisor on node2 sees the lease in the run directory expire (6 s), takes
    over in the same allocation (no requeue), ends the old step, re-plans on node2 and resumes from
    the checkpoint with the uninterrupted run's losses. Rank 0 stops before step 5 (attempt 0 only), so
    the node dies at a known step. With memory snapshots every step, node2's keeper (an srun step of the
    job, kept by the takeover) holds every rank's snapshot of step 5, newer than the checkpoint of step
    4: the standby resumes from it."""
    run = tmp_path / "run"
    r = run_cli([*COMMON, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                 "training.steps=8", "training.checkpoint.every=2", "fault.kind=hang_rank", "fault.rank=0",
                 "fault.at_step=5", "failover.progress_deadline_s=120", "failover.lease_s=6",
                 "training.checkpoint.snapshot_every=1"], tmp_path, timeout=300)
    assert r.returncode == 0 and "submitted SLURM job" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and
                                                    len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
            time.sleep(0.3)
        assert _a_snapshot_after(run, "node2", 4) == 5  # every rank's, in the keeper that outlives node1
        subprocess.run([str(ROOT / "slurm" / "kill-node.sh"), "--freeze", "node1"], check=True, timeout=30)
        assert _ended(run) == "completed", (run / "status.json").read_text()
    finally:
        subprocess.run([str(SCRIPT), "up"], env=dict(os.environ, NODES="2", GPUS="4", CPUS="8"),
                       capture_output=True, timeout=300)  # node1's frozen processes ended, node1 back in service
    (event,) = failovers(run)
    assert event["mode"] == "supervisor_takeover" and event["node"] == "node1" and event["generation"] == 2, event
    # the lease it waited out (how long detection and takeover took is benchmarks/failover_sim.py's to print)
    assert event["nodes_in_service"] == ["node2"] and event["lease_s"] == 6 and "detection" in event["seconds"], event
    assert event["resumed_from"] == "snapshot" and event["resumed_from_step"] == 5, event  # the checkpoint: step 4
    logs = "".join(f.read_text() for f in run.glob("attempt*/logs/rank*.log"))
    assert "resumed from the memory snapshot of step 5" in logs
    assert not (run / "requeues.json").exists()  # never requeued (by SLURM: a supervisor_lost event would say so)
    assert "TAKEOVER" in (run / "logs" / "standby.log").read_text()
    got = losses_by_step(run)
    assert [got[s] for s in range(8)] == pytest.approx(reference[:8], rel=1e-5)
    assert samples_read(run) == list(range(8 * 16))
