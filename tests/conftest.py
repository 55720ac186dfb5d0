import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# hardware=cpu predicts with this machine's cached probe where there is one (orchestrator/probe.py):
# the tests plan the stock preset, in an empty cache of their own (the ranks they start inherit it)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["ORCHESTRATOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="orchestrator-test-cache-")
atexit.register(shutil.rmtree, os.environ["ORCHESTRATOR_CACHE_DIR"], ignore_errors=True)  # one per session, not left behind


def plan_of(*overrides: str):
    """Compose like the command line and plan (in process, no run directory)."""
    from orchestrator import compose, make_plan

    return make_plan(compose(list(overrides)))


def run_cli(args: list[str], tmp_path: Path, env: dict | None = None, timeout: int = 120):
    """Run `python -m orchestrator` for real; the run directory goes under tmp_path."""
    cmd = [sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={tmp_path}/run",
           f"hydra.sweep.dir={tmp_path}/sweep"]
    e = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=e)


def run_cli_here(args: list[str], tmp_path: Path):
    """`orchestrate ARGS` through its console script's own function in this process, without
    starting an interpreter: for command lines that plan, refuse or write a plan but start no
    rank (a refusal, launcher=dry). Exit status, stdout and stderr as run_cli gives them."""
    import io
    import signal
    import subprocess
    from contextlib import redirect_stderr, redirect_stdout

    from orchestrator.cli import main

    argv = [f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep", *args]  # a later one of args wins
    out, err, mask, sigint = io.StringIO(), io.StringIO(), os.umask(0o022), signal.getsignal(signal.SIGINT)
    os.umask(mask)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.umask(mask)  # a run sets owner-only files for its own process
        signal.signal(signal.SIGINT, sigint)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def losses_by_step(run_dir: Path) -> dict:
    """The loss each step ended with (metrics.jsonl), a re-run step taken from its latest attempt."""
    import json

    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def samples_read(run_dir: Path) -> list[int]:
    """Every sample index the steps that count read (each step from the attempt that finished it)."""
    import json

    per_step: dict = {}
    for f in (run_dir / "samples").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["step"], {}).setdefault(rec["attempt"], []).extend(rec["indices"])
    return sorted(i for by in per_step.values() for i in by[max(by)])


def failovers(run_dir: Path) -> list[dict]:
    """The run's failover events (failover.json) without the stragglers it named: on a loaded
    machine a copy can really be slower for a while; it is named and kept, which changes nothing
    these tests check (tests/test_stragglers.py checks the naming)."""
    import json

    return [e for e in json.loads((run_dir / "failover.json").read_text()) if e.get("mode") != "straggler"]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def local_slurm(env: dict):
    """A real SLURM cluster on this machine (slurm/local-cluster.sh up with `env`: NODES, GPUS,
    CPUS, TOPOLOGY) for the duration of a fixture, SLURM_CONF pointing at it; yields the conf path.
    In CI (CI=true) a cluster that cannot come up is a failure; elsewhere, without root, a skip."""
    script = ROOT / "slurm" / "local-cluster.sh"
    ci = os.environ.get("CI") == "true"
    if os.geteuid() != 0:
        if ci:
            pytest.fail("CI must run the SLURM tests, and bringing the local cluster up needs root")
        pytest.skip("the local SLURM cluster needs root (packages, /etc/hosts, daemons)")
    full = dict(os.environ, **env)
    r = subprocess.run([str(script), "up"], env=full, capture_output=True, text=True, timeout=900)
    if r.returncode:
        subprocess.run([str(script), "down"], env=full, capture_output=True, timeout=120)
        msg = f"local SLURM cluster ({env}) did not come up:\n{r.stderr[-3000:]}"
        pytest.fail(msg) if ci else pytest.skip(msg)
    conf = subprocess.run([str(script), "conf"], capture_output=True, text=True).stdout.strip()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run([str(script), "down"], env=full, capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def sbatch_text(overrides: list[str], folder: Path) -> str:
    """The batch script submitit would write for these overrides (launcher=slurm), its job folder as JOBS."""
    from orchestrator import compose
    from orchestrator.config.compose import typed
    from orchestrator.launch.slurm import make_executor

    ex = make_executor(typed(compose(overrides)), folder, preview=True)
    text = ex._executor._make_submission_file_text("python -u -m submitit.core._submit JOBS", "UID")
    return text.replace(str(folder), "JOBS")


def golden(name: str, text: str) -> str:
    """tests/golden/NAME (rewritten from `text` with UPDATE_GOLDEN=1)."""
    path = ROOT / "tests" / "golden" / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    return path.read_text()


REFERENCE_STEPS = 60


@pytest.fixture(scope="session")
def tiny_losses(tmp_path_factory) -> list[float]:
    """One process, no parallelism: the tiny model's loss at each of 60 steps (seq 64, batch 16,
    constant learning rate, so any shorter run's losses are a prefix). Every layout, restart,
    failover and resume of the same model and data must reproduce these."""
    tmp = tmp_path_factory.mktemp("tiny_reference")
    r = run_cli(["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
                 "training.global_batch=16", "cluster.nodes=1", "hardware.gpus_per_node=1",
                 f"training.steps={REFERENCE_STEPS}"], tmp, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    by_step = losses_by_step(tmp / "run")
    assert sorted(by_step) == list(range(REFERENCE_STEPS))
    return [by_step[s] for s in range(REFERENCE_STEPS)]


@pytest.fixture
def cli(tmp_path):
    def _run(*args, **kw):
        return run_cli(list(args), tmp_path, **kw)

    _run.dir = tmp_path / "run"
    return _run


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible object store on localhost (moto's server mode), reached through s3fs."""
    import shutil
    import socket
    import time

    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    assert exe, "moto[server] is a test dependency (pip install -e '.[test]')"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # for the ranks (fsspec reads FSSPEC_S3_* when it is imported)
    import fsspec.config

    s3conf = fsspec.config.conf.setdefault("s3", {})
    old_conf = dict(s3conf)
    s3conf["endpoint_url"] = env["FSSPEC_S3_ENDPOINT_URL"]  # and for this process, already imported
    try:
        import fsspec

        deadline = time.monotonic() + 30
        while True:
            try:
                fs = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"])
                fs.mkdir("orchestrator-tests")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        yield "s3://orchestrator-tests"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        s3conf.clear()
        s3conf.update(old_conf)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
