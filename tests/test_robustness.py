"""Nothing breaks it: hostile values that would reach a shell, a batch script or a path;
damaged checkpoints (reported as such, skipped, the previous intact one loaded); a resume
that would change the data stream; signals and closed pipes."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, alive, failovers, losses_by_step, run_cli

COMMON = ["hardware=cpu", "model=tiny", "figures=false", "training.seq_len=64", "training.global_batch=16"]


def _slurm_problems(*overrides, run_dir="/tmp/run"):
    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.launch.sbatch import problems

    return problems(typed(compose([*COMMON, "launcher=slurm", *overrides])).launcher, Path(run_dir))


# one row per hostile class: the overrides, and the key that must be named
HOSTILE_SBATCH = [
    (["launcher.job_name='x;reboot'"], "launcher.job_name"),
    (["launcher.partition='gpu\n'"], "launcher.partition"),  # a trailing newline ends the #SBATCH line
    (["launcher.partition='a b'"], "launcher.partition"),
    (["launcher.account='" + "a" * 300 + "'"], "launcher.account"),  # no length limit before
    (["launcher.setup=['echo $(id)']"], "launcher.setup[0]"),
    (["launcher.setup=['module load x\nrm -rf /']"], "launcher.setup[0]"),
    (["launcher.setup=['echo \"unbalanced']"], "launcher.setup[0]"),  # would swallow the srun line
    (["launcher.time_min=0"], "launcher.time_min"),
    (["launcher.cpus_per_task=-1"], "launcher.cpus_per_task"),
    (["launcher.signal_delay_s=-5"], "launcher.signal_delay_s"),
    (["launcher.max_requeues=-1"], "launcher.max_requeues"),
    (["launcher.time_min=1", "launcher.signal_delay_s=90"], "launcher.signal_delay_s, launcher.time_min"),
    (["+launcher.additional_parameters.mail-user='a;b'"], "launcher.additional_parameters.mail-user"),
    (["launcher.container_image='img;rm'"], "launcher.container_image"),
    (["launcher.container_mounts=['/data:/data:ro:x:y']"], "launcher.container_mounts[0]"),
]


@pytest.mark.parametrize("overrides,key", HOSTILE_SBATCH, ids=[k for _, k in HOSTILE_SBATCH])
def test_every_hostile_sbatch_value_is_named(overrides, key):
    problems = _slurm_problems(*overrides)
    assert [p.key for p in problems] == [key], problems
    assert problems[0].fix


@pytest.mark.parametrize("run_dir", ["/tmp/a\nb", "/tmp/a b", "/tmp/$(id)"])
def test_a_run_directory_that_would_break_the_batch_script_is_refused(run_dir):
    problems = _slurm_problems(run_dir=run_dir)
    assert [p.key for p in problems] == ["hydra.run.dir"]


@pytest.mark.parametrize("quote", ["'", ""], ids=["quoted", "bare"])
def test_the_cli_refuses_a_newline_in_the_run_directory_before_writing_anything(tmp_path, quote):
    run = tmp_path / "a\nb"
    r = subprocess.run([sys.executable, "-m", "orchestrator", *COMMON, "launcher=slurm",
                        f"hydra.run.dir={quote}{run}{quote}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "[hydra.run.dir]" in r.stderr and "nothing was" in r.stderr
    assert "Traceback" not in r.stderr and not run.exists() and not (tmp_path / "a").exists()


@pytest.mark.parametrize("url,words", [
    ("/", "system location"), ("/dev/null", "system location"), ("file:///etc", "system location"),
    ("s3://../..", "'..'"), ("nosuchproto://bucket/x", "unknown protocol"),
    ("{file}/under-a-file", "not writable"), ("{file}", "not a directory"),
], ids=["root", "dev-null", "etc", "dotdot", "protocol", "under-a-file", "a-file"])
def test_checkpoint_locations_are_proved_before_launch(tmp_path, url, words):
    from orchestrator.launch.preflight import location_problems

    f = tmp_path / "a-file"
    f.write_text("x")
    (p,) = location_problems(url.format(file=f), writes=True)
    assert p.key == "training.checkpoint.dir" and words in p.message and p.fix


def test_a_writable_location_passes_and_leaves_nothing_behind(tmp_path):
    from orchestrator.launch.preflight import location_problems

    assert location_problems(str(tmp_path / "ck"), writes=True) == []
    assert list((tmp_path / "ck").iterdir()) == []


@pytest.fixture(scope="module")
def four_saves(tmp_path_factory):
    """Checkpoints after steps 1, 2, 3 and 4 of a DP2 run, and the uninterrupted losses."""
    tmp = tmp_path_factory.mktemp("saves")
    r = run_cli([*COMMON, "launcher=local", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2",
                 "training.steps=6", "training.checkpoint.every=1", "training.checkpoint.keep=10"], tmp, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp / "run", losses_by_step(tmp / "run")


def _copy_saves(src: Path, dst: Path, steps) -> Path:
    import shutil

    for s in steps:
        shutil.copytree(src / "checkpoints" / f"step_{s:08d}", dst / f"step_{s:08d}")
    return dst


def test_damaged_checkpoints_are_named_skipped_and_the_previous_intact_one_loads(tmp_path, four_saves):
    """Payload altered with its container intact, a shard deleted, a truncated .metadata, a
    broken meta.json, and a stray directory holding only COMPLETE: each is reported as damaged
    (never as a lost node), marked, and the run resumes from step 1, the newest intact save."""
    src, reference = four_saves
    ck = _copy_saves(src, tmp_path / "ck", (1, 2, 3, 4, 5))
    shard = sorted((ck / "step_00000005").glob("__0_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same container, different payload
    shard.write_bytes(bytes(data))
    (ck / "step_00000004" / "meta.json").write_text("{not json")
    sorted((ck / "step_00000003").glob("__1_*.distcp"))[0].unlink()
    meta = ck / "step_00000002" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    stray = ck / "step_00000009"
    stray.mkdir()
    (stray / "COMPLETE").write_text("9")
    r = run_cli([*COMMON, "launcher=local", "cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2",
                 "training.steps=3", f"training.checkpoint.dir={ck}"], tmp_path / "resume", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr and "FAILOVER" not in r.stdout
    events = failovers(tmp_path / "resume" / "run")
    assert [e["step"] for e in events if e["mode"] == "checkpoint_damaged"] == [9, 5, 4, 3, 2]
    assert all(e["mode"] == "checkpoint_damaged" for e in events)
    assert any("contents changed" in p for p in events[1]["problems"])
    assert r.stdout.count("CHECKPOINT DAMAGED") == 5
    for step in (2, 3, 4, 5, 9):
        assert (ck / f"step_{step:08d}" / "DAMAGED").exists()  # kept for inspection, never loaded again
    got = losses_by_step(tmp_path / "resume" / "run")
    assert sorted(got) == [1, 2] and got[1] == pytest.approx(reference[1], rel=1e-5)


def test_no_intact_checkpoint_is_a_clear_stop(tmp_path, four_saves):
    src, _ = four_saves
    ck = _copy_saves(src, tmp_path / "ck", (1,))
    (ck / "step_00000001" / "meta.json").write_text("")
    r = run_cli([*COMMON, "launcher=local", "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=3",
                 f"training.checkpoint.dir={ck}"], tmp_path / "r", timeout=600)
    assert r.returncode == 1 and "NO INTACT CHECKPOINT" in r.stdout and "FAILOVER" not in r.stdout


def test_a_resume_that_would_change_the_data_stream_is_refused_unless_allowed(tmp_path, four_saves):
    src, _ = four_saves
    ck = _copy_saves(src, tmp_path / "ck", (6,))
    base = [*COMMON, "launcher=local", "cluster.nodes=1", "hardware.gpus_per_node=1", "training.steps=7",
            f"training.checkpoint.dir={ck}"]
    r = run_cli([*base, "training.seed=5", "model.rope_theta=20000"], tmp_path / "a")
    assert r.returncode == 2 and "[training.seed]" in r.stderr and "[model.rope_theta]" in r.stderr
    assert "training.resume.allow=[training.seed]" in r.stderr and not (tmp_path / "a" / "run" / "logs").exists()
    r = run_cli([*base, "model.rope_theta=20000", "training.resume.allow=[model.rope_theta]"], tmp_path / "b",
                timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_fault_settings_that_would_never_fire_are_named(cli):
    r = cli(*COMMON, "launcher=local", "cluster.nodes=2", "hardware.gpus_per_node=1", "training.steps=5",
            "fault.kill_node=1", "fault.at_step=9")
    assert r.returncode == 2 and "[fault.at_step]" in r.stderr and "never fire" in r.stderr
    r = cli(*COMMON, "launcher=local", "cluster.nodes=2", "hardware.gpus_per_node=1", "training.steps=6",
            "training.checkpoint.every=4", "fault.kill_node=1", "fault.at_step=3", "fault.mode=during_save")
    assert r.returncode == 2 and "no checkpoint is saved at step 3" in r.stderr


def _ranks_of(launcher: int) -> list[int]:
    """The launcher's ranks: its worker processes, or the children of its fork server."""
    procs = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                procs[int(p.name)] = (int((p / "stat").read_text().split()[3]), (p / "cmdline").read_bytes())
            except (OSError, IndexError, ValueError):
                continue
    servers = {pid for pid, (ppid, cmd) in procs.items() if ppid == launcher and b"orchestrator.launch.forkserver" in cmd}
    return [pid for pid, (ppid, cmd) in procs.items() if ppid in servers or
            (ppid == launcher and pid not in servers and b"orchestrator.train.worker" in cmd)]


def _ignore_sigint():
    """Start the launcher as a background job of a script is started (or a test runner's worker
    that ignores Ctrl-C): SIGINT inherited ignored. Ctrl-C must still stop it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["KILL", "TERM", "INT"])
def test_the_ranks_die_with_the_launcher_whatever_signal_it_gets(tmp_path, sig):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", *COMMON, "launcher=local", "cluster.nodes=1",
                          "hardware.gpus_per_node=2", "layout.dp=2", "training.steps=1000",
                          f"hydra.run.dir={run}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_ignore_sigint if sig == signal.SIGINT else None)
    try:
        deadline = time.monotonic() + 120
        ranks = []
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists()):
            ranks = _ranks_of(p.pid) or ranks
            time.sleep(0.2)
        ranks = _ranks_of(p.pid) or ranks
        assert len(ranks) == 2
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # a failed check must not leave a 1000-step run behind
            p.kill()
            p.communicate()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(r) for r in ranks):
        time.sleep(0.2)
    assert not any(alive(r) for r in ranks)
    if sig == signal.SIGINT:
        assert p.returncode == 130 and "Traceback" not in err and "interrupted" in err
    if sig == signal.SIGTERM:
        assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err


def test_a_closed_pipe_ends_quietly():
    p = subprocess.Popen(f"{sys.executable} -m orchestrator recipe=llama3_405b figures=false "
                         f"hydra.run.dir=/tmp/orch-pipe-test | head -1", shell=True, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert len(out.splitlines()) == 1 and "Traceback" not in err and "BrokenPipe" not in err


def test_a_rank_that_fails_before_its_first_beat_is_seen_crashed(tmp_path):
    """A rank that dies before it beat once (here: its plan unreadable; on SLURM: its rendezvous port
    taken) writes a crashed beat, which the SLURM supervisor's wait loop reads (progress.crashed): its
    step is stopped at once instead of its peers waiting in the rendezvous until the store's timeout."""
    from orchestrator.launch import progress

    run_dir = tmp_path / "run"
    (run_dir / "attempt1").mkdir(parents=True)  # no plan.json in it
    env = {**os.environ, "RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "3", "ORCH_RUN_DIR": str(run_dir),
           "PYTHONPATH": str(ROOT)}
    assert progress.crashed(run_dir) is None
    r = subprocess.run([sys.executable, "-m", "orchestrator.train.worker", str(run_dir / "attempt1")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "plan.json" in r.stderr, r.stderr[-2000:]
    beat = progress.crashed(run_dir)
    assert beat is not None and beat.rank == 3 and beat.task == 3 and beat.pid != os.getpid()
