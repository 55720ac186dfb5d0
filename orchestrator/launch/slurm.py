"""launcher=slurm: submit a run whose job owns its failures, through submitit.

The job is one batch script (submitit, `use_srun=False`, `--no-kill`, `--requeue`) that
runs the supervisor (launch/srun.py) on the allocation's first node; the supervisor
starts the training steps with srun and handles node loss, preemption and time limits
inside the allocation. Submission is detached: `orchestrate` returns once the job is
queued, and nothing needs to stay alive on the login node. `launcher.wait=true` only
follows the run and prints its progress (Ctrl-C detaches, the job goes on);
`orchestrate-runs` lists, follows, cancels and resumes runs later.

By default the job runs a copy of the code taken at submission (RUN_DIR/code), so
editing the checkout while the job waits in the queue changes nothing. With
`launcher.submit=false` the batch script and the srun line are written and printed,
and nothing is submitted. submitit is imported lazily: planning never pays for it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from orchestrator import rundir
from orchestrator.config.errors import Problem
from orchestrator.config.schema import FaultKind
from orchestrator.launch import sbatch
from orchestrator.launch.base import Launcher
from orchestrator.launch.status import write_status

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding orchestrator/


def make_executor(spec, folder: Path, preview: bool = False):
    """The submitit executor of a run's job: the supervisor in the batch step, a node loss
    not fatal to the allocation (--no-kill), requeue allowed. `preview`: only its batch script
    is wanted (launcher.submit=false), which needs no SLURM client on this machine."""
    import submitit

    lc, gpn = spec.launcher, spec.hardware.gpus_per_node
    with _without_srun_check(preview):
        ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_max_num_timeout=lc.max_requeues)
    params = dict(name=lc.job_name, nodes=spec.cluster.nodes, tasks_per_node=gpn, cpus_per_task=lc.cpus_per_task,
                  timeout_min=lc.time_min, slurm_signal_delay_s=lc.signal_delay_s, slurm_setup=list(lc.setup),
                  slurm_use_srun=False,
                  slurm_additional_parameters={"no-kill": True, "requeue": True, **dict(lc.additional_parameters)})
    if lc.switches is not None:  # a compact allocation: at most N leaf switches (topology/tree)
        params["slurm_additional_parameters"]["switches"] = str(lc.switches)
    if lc.segment is not None:  # topology/block: the job in segments of N nodes, each inside one block
        params["slurm_additional_parameters"]["segment"] = int(lc.segment)
    if lc.gpus_per_node_gres:
        params["gpus_per_node"] = gpn
    for key, value in (("slurm_partition", lc.partition), ("slurm_account", lc.account), ("slurm_qos", lc.qos),
                       ("slurm_constraint", lc.constraint), ("slurm_exclude", lc.exclude)):
        if value:
            params[key] = value
    ex.update_parameters(**params)
    return ex


@contextmanager
def _without_srun_check(preview: bool):
    """submitit's SlurmExecutor refuses to be built where `srun` is not on PATH (its affinity
    check), even to write a batch script; a preview (a laptop, CI without SLURM) writes only
    that, so the check is lifted for the preview's construction and put back after it."""
    from submitit.slurm.slurm import SlurmExecutor

    if not preview or shutil.which("srun"):
        yield
        return
    saved = SlurmExecutor.__dict__["affinity"]
    SlurmExecutor.affinity = classmethod(lambda cls: 2)
    try:
        yield
    finally:
        SlurmExecutor.affinity = saved


def batch_script(executor) -> str:
    """The exact batch script submitit would submit for this executor."""
    inner = executor._executor
    return inner._make_submission_file_text(inner._submitit_command_str, "%j")


def snapshot(run_dir: Path) -> tuple[Path, int, float]:
    """Copy the code that will run (orchestrator/, conf/, recipes/) into RUN_DIR/code:
    tracked and untracked-but-not-ignored files of a checkout, or the installed package.
    Returns the folder, its size in bytes and the seconds it took."""
    t0 = time.perf_counter()
    dest = Path(run_dir) / "code"
    try:
        listed = subprocess.run(["git", "-C", str(PACKAGE_ROOT), "ls-files", "-co", "--exclude-standard", "--",
                                 "orchestrator", "conf", "recipes"], capture_output=True, text=True, timeout=60,
                                check=True).stdout.split("\n")
        files = [PACKAGE_ROOT / f for f in listed if f and (PACKAGE_ROOT / f).is_file()]
    except (OSError, subprocess.SubprocessError):
        files = [f for f in (PACKAGE_ROOT / "orchestrator").rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    size = 0
    for f in files:
        target = dest / f.relative_to(PACKAGE_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
        size += f.stat().st_size
    return dest, size, time.perf_counter() - t0


@contextmanager
def code_from(code_dir: Path | None):
    """The submitted job (and every srun step it starts) imports orchestrator from code_dir:
    sbatch passes this environment on."""
    old = os.environ.get("PYTHONPATH")
    if code_dir is not None:
        os.environ["PYTHONPATH"] = str(code_dir) + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def record_job(run_dir: Path, job_id: str, folder: Path, **extra) -> None:
    with open(Path(run_dir) / rundir.SLURM_JOBS, "a") as f:
        f.write(json.dumps({"job_id": job_id, "folder": str(folder), "time": time.time(), **extra}) + "\n")


def submit_jobs(ex, runs: list, folder: Path, code_dir: Path | None) -> list[str]:
    """Submit one supervisor job per (spec, run directory) with executor `ex` (made for their
    shared resources), several as one job array; each run records its job and is queued."""
    from contextlib import nullcontext

    from orchestrator.launch.batch import BatchJob

    with code_from(code_dir), (ex.batch() if len(runs) > 1 else nullcontext()):
        jobs = [ex.submit(BatchJob(str(run_dir))) for _, run_dir in runs]
    for (spec, run_dir), job in zip(runs, jobs):
        record_job(run_dir, job.job_id, folder, nodes=spec.cluster.nodes)
        write_status(run_dir, state="queued", launcher="slurm", job_id=job.job_id)
    return [job.job_id for job in jobs]


def local_only_problems(spec) -> list[Problem]:
    """Settings only the local launcher acts on, refused rather than ignored on SLURM."""
    out = []
    if spec.cluster.spare_nodes:
        out.append(Problem("cluster.spare_nodes", f"warm spares ({spec.cluster.spare_nodes}) are kept by the local "
                           f"launcher only; a SLURM job asks for cluster.nodes={spec.cluster.nodes} and, after a "
                           f"node loss, goes on in place or re-plans on the survivors.",
                           "set cluster.spare_nodes=0 (or raise cluster.nodes and keep copies: layout.dp_shard)."))
    if spec.fault.kind == FaultKind.kill_node and spec.fault.kill_node is not None:  # the rank kinds and slow_node run
        out.append(Problem("fault.kill_node", "fault.kind=kill_node emulates a node loss in the local launcher; a "
                           "SLURM job has real nodes.", "unset fault.kill_node; fail a node with slurm/kill-node.sh "
                           "NODE instead (fault.kind=crash_rank, segfault_rank, hang_rank and slow_node are injected on SLURM)."))
    return out


class SlurmLauncher(Launcher):
    def preflight(self):
        return sbatch.problems(self.spec.launcher, self.run_dir) + local_only_problems(self.spec) + super().preflight()

    def submit(self) -> int:
        lc = self.spec.launcher
        folder = self.run_dir / rundir.SLURM_DIR
        ex = make_executor(self.spec, folder, preview=not lc.submit)
        if not lc.submit:
            return self._preview(ex, folder)
        code_dir = None
        if lc.snapshot:
            code_dir, size, seconds = snapshot(self.run_dir)
            print(f"code snapshot: {size / 1e6:.2f} MB in {seconds:.2f} s -> {code_dir}")
        write_status(self.run_dir, state="queued", launcher="slurm", snapshot=str(code_dir) if code_dir else None)
        (job_id,) = submit_jobs(ex, [(self.spec, self.run_dir)], folder, code_dir)
        print(f"submitted SLURM job {job_id} ({self.spec.cluster.nodes} nodes x {self.spec.hardware.gpus_per_node} "
              f"tasks); the job supervises itself: node losses, preemption and time limits are handled in it.\n"
              f"run directory {self.run_dir}; follow with: orchestrate-runs logs -f {self.run_dir}", flush=True)
        if not lc.wait:
            return rundir.EXIT_OK
        from orchestrator.launch.runs import follow

        return follow(self.run_dir)

    def _environment(self, nodes: list[str]) -> list[str]:
        """Every variable the launcher gives each rank beyond the job's own environment."""
        from orchestrator.launch.srun import step_env
        from orchestrator.launch.trainers import describe_task_env
        from orchestrator.plan.hostlist import compress

        gpn = self.spec.hardware.gpus_per_node
        step = {**step_env(nodes, "15000 + (7 x SLURM_JOB_ID + attempt) mod 20000"),
                rundir.ENV_RUN_DIR: str(self.run_dir), rundir.ENV_ATTEMPT: "0 (then 1, 2, ... after a failover)"}
        step[rundir.ENV_HOSTS] = f"{compress(nodes)} expanded, comma-separated (the plan's node order)"
        return (["each rank's environment: the batch job's own, plus (set by the supervisor for the step)"]
                + [f"  {k}={v}" for k, v in step.items()]
                + ["and (set by each srun task for itself)"]
                + [f"  {line}" for line in describe_task_env(self.run_dir, gpn, len(nodes) * gpn)])

    def _preview(self, ex, folder: Path) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        script = batch_script(ex)
        nodes = [f"<node{i + 1}>" for i in range(self.spec.cluster.nodes)]
        srun = " ".join(sbatch.srun_command(self.spec.launcher, self.run_dir, nodes, self.spec.hardware.gpus_per_node,
                                            sys.executable))
        (folder / "preview.sbatch").write_text(script)
        (folder / "preview.srun").write_text(srun + "\n")
        from orchestrator.launch.trainers import rendered_for

        release = rendered_for(self.run_dir)
        print(f"\nbatch script ({folder / 'preview.sbatch'}; nothing was submitted):\n{script}\n"
              f"training step, started by the supervisor inside the allocation ({folder / 'preview.srun'}):\n{srun}"
              + (f"\nrendered for {release}" if release else "") + "\n")
        print("\n".join(self._environment(nodes)))
        return rundir.EXIT_OK
