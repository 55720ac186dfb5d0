"""launcher=slurm: submission through submitit, requeue on preemption, failover on node loss.

One task per GPU on `cluster.nodes` nodes. Every task reads its place from
submitit's JobEnvironment, checks the real allocation against the plan (a
mismatch stops the job before any training), sets up torch.distributed with the
job's first host as rendezvous, and runs the same training as the local
launcher. Preemption and time limits: the ranks agree at a step boundary to save
a checkpoint, then rank 0 lets submitit requeue the job (Checkpointable), which
resumes from it; bounded by `launcher.max_requeues`. Node failure is owned here,
not by submitit: the watcher re-plans on the nodes that remain and resubmits
excluding the failed node; every attempt has its own submitit folder, so no
stale result is ever read. Every value that reaches sbatch is validated first.

submitit is imported lazily: planning never pays for it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.plan.errors import Problem

SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%+=/\-\[\]]+$")
SAFE_SETUP = re.compile(r"^[A-Za-z0-9_.,:@%+=/\- '\"]+$")
SAFE_KEY = re.compile(r"^[a-z][a-z0-9_\-]*$")
FIELDS = ("job_name", "partition", "account", "qos", "constraint", "exclude")


def safety_problems(launcher) -> list[Problem]:
    """Values that would reach an sbatch script or a shell line, checked before anything is submitted."""
    out = []
    for f in FIELDS:
        v = getattr(launcher, f, None)
        if v is not None and not SAFE_VALUE.match(str(v)):
            out.append(Problem(f"launcher.{f}", f"{v!r} contains characters that could reach the shell "
                               f"(allowed: letters, digits and _ . , : @ % + = / - [ ]).",
                               "use a plain name."))
    for i, line in enumerate(launcher.setup or []):
        if not SAFE_SETUP.match(str(line)):
            out.append(Problem(f"launcher.setup[{i}]", f"{line!r} is not a plain command: ';', '$(...)', "
                               f"backquotes, pipes, redirections and newlines are refused.",
                               "put complex set-up in a script on the cluster and call it by name."))
    for k, v in (launcher.additional_parameters or {}).items():
        if not SAFE_KEY.match(str(k)) or not SAFE_VALUE.match(str(v)):
            out.append(Problem(f"launcher.additional_parameters.{k}", f"{k}={v!r} is not a plain sbatch option.",
                               "use a plain option name and value."))
    return out


class TrainingJob:
    """The function every SLURM task runs (pickled by submitit). Checkpointable: on
    preemption or time-out submitit calls `checkpoint`, which requeues this same job."""

    def __init__(self, plan_dir: str, run_dir: str, attempt: int, max_requeues: int):
        self.plan_dir, self.run_dir, self.attempt, self.max_requeues = plan_dir, run_dir, attempt, max_requeues

    def __call__(self):
        import submitit

        env = submitit.JobEnvironment()
        plan = json.loads((Path(self.plan_dir) / "plan.json").read_text())
        gpn = plan["config"]["hardware"]["gpus_per_node"]
        nodes = plan["config"]["cluster"]["nodes"]
        got = (env.num_nodes, env.num_tasks)
        if got != (nodes, nodes * gpn):
            raise RuntimeError(
                f"allocation mismatch: SLURM gave {env.num_nodes} node(s) and {env.num_tasks} task(s), the plan "
                f"needs cluster.nodes={nodes} x hardware.gpus_per_node={gpn} = {nodes * gpn} tasks; stopping "
                f"before any training. Re-plan for this allocation or submit with the plan's.")
        os.environ.update(RANK=str(env.global_rank), WORLD_SIZE=str(env.num_tasks), LOCAL_RANK=str(env.local_rank),
                          LOCAL_WORLD_SIZE=str(gpn), MASTER_ADDR=env.hostnames[0],
                          # SLURM_JOB_ID is unique per array task (submitit's job_id is "array_task")
                          MASTER_PORT=str(15000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000),
                          ORCH_RUN_DIR=self.run_dir, ORCH_ATTEMPT=str(self.attempt), OMP_NUM_THREADS="1",
                          TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        # submitit's handler requeues from rank 0 only; first every rank must save together.
        requeue = signal.getsignal(signal.SIGUSR2)
        stop = {"signum": None}
        signal.signal(signal.SIGUSR2, lambda signum, frame: stop.update(signum=signum))
        from orchestrator.train.worker import train

        history = train(Path(self.plan_dir), should_stop=lambda: stop["signum"] is not None)
        if history.get("stopped") and env.global_rank == 0 and callable(requeue):
            requeue(stop["signum"], None)  # calls self.checkpoint, then scontrol requeue, then exits
        return {"loss": history["loss"], "stopped": bool(history.get("stopped")), "rank": env.global_rank}

    def checkpoint(self, *args, **kwargs):
        import submitit

        path = Path(self.run_dir) / "requeues.json"
        n = json.loads(path.read_text())["count"] if path.exists() else 0
        if n >= self.max_requeues:
            return None  # submitit then ends the job: "not requeued"
        path.write_text(json.dumps({"count": n + 1}))
        return submitit.helpers.DelayedSubmission(TrainingJob(self.plan_dir, self.run_dir, self.attempt,
                                                              self.max_requeues))


def make_executor(cfg, folder: Path, exclude: list[str] | None = None):
    import submitit

    lc, gpn = cfg.launcher, cfg.hardware.gpus_per_node
    ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_max_num_timeout=lc.max_requeues)
    excl = ",".join([x for x in [lc.exclude] if x] + (exclude or [])) or None
    params = dict(name=lc.job_name, nodes=cfg.cluster.nodes, tasks_per_node=gpn, cpus_per_task=lc.cpus_per_task,
                  timeout_min=lc.time_min, slurm_signal_delay_s=lc.signal_delay_s,
                  slurm_setup=list(lc.setup or []),
                  slurm_additional_parameters=dict(lc.additional_parameters or {}))
    if lc.gpus_per_node_gres:
        params["gpus_per_node"] = gpn
    for key, value in (("slurm_partition", lc.partition), ("slurm_account", lc.account), ("slurm_qos", lc.qos),
                       ("slurm_constraint", lc.constraint), ("slurm_exclude", excl)):
        if value:
            params[key] = value
    ex.update_parameters(**params)
    return ex


def submit(cfg, plan_dir: Path, run_dir: Path, attempt: int, exclude: list[str] | None = None):
    ex = make_executor(cfg, run_dir / "slurm" / f"attempt{attempt}", exclude)
    job = ex.submit(TrainingJob(str(plan_dir), str(run_dir), attempt, cfg.launcher.max_requeues))
    rec = {"job_id": job.job_id, "attempt": attempt, "folder": str(run_dir / "slurm" / f"attempt{attempt}"),
           "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr), "exclude": exclude or []}
    with open(run_dir / "slurm_jobs.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return job


def _state(job) -> str:
    return job.watcher.get_state(job.job_id, mode="force")


def _job_nodes(job_id: str) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "NodeList"], capture_output=True,
                         text=True).stdout.split()
    names = set()
    for item in out:
        names.update(subprocess.run(["scontrol", "show", "hostnames", item], capture_output=True,
                                    text=True).stdout.split())
    return sorted(names)


def dead_nodes(nodes: list[str]) -> list[str]:
    if not nodes:
        return []
    out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], capture_output=True,
                         text=True).stdout
    return sorted({n for n, st in (l.split() for l in out.splitlines() if l.strip())
                   if any(x in st.lower() for x in ("down", "not_responding", "*", "fail", "drain"))})


class _Tail:
    def __init__(self):
        self.pos: dict[str, int] = {}

    def __call__(self, path: Path) -> None:
        if not path.exists():
            return
        with open(path) as f:
            f.seek(self.pos.get(str(path), 0))
            for line in f:
                if line.startswith(("step ", "stopping")) or "resumed" in line or "Error" in line:
                    print(f"[slurm rank0] {line}", end="", flush=True)
            self.pos[str(path)] = f.tell()


def launch_slurm(plan, cfg, out_dir: Path) -> int:
    from orchestrator.launch.failover import preflight

    problems = safety_problems(cfg.launcher) + preflight(cfg, out_dir)
    if problems:
        print("\nREJECTED: nothing was submitted.", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    job = submit(cfg, out_dir, out_dir, 0)
    print(f"submitted SLURM job {job.job_id} ({cfg.cluster.nodes} nodes x {cfg.hardware.gpus_per_node} tasks); "
          f"logs: {job.paths.stdout} and {job.paths.stderr}", flush=True)
    if not cfg.launcher.wait:
        return 0
    return watch(job, cfg, plan, out_dir)


def watch(job, cfg, plan, out_dir: Path, poll_s: float = 2.0) -> int:
    """Follow the job to the end; own node failures (re-plan, exclude, resubmit)."""
    import submitit

    from orchestrator.cli import write_plan
    from orchestrator.launch.failover import record_failover, replan_on_survivors

    tail = _Tail()
    attempt, cur_cfg, cur_plan, events, excluded = 0, cfg, plan, [], []
    from orchestrator.train.checkpoint import url_for

    url = url_for(cfg.training.checkpoint.dir, out_dir)
    ran_on: list[str] = []
    while True:
        tail(Path(str(job.paths.stdout).replace("%t", "0")))
        state = _state(job)
        if state in ("RUNNING", "COMPLETING") and not ran_on:
            ran_on = _job_nodes(job.job_id)
        if state == "COMPLETED":
            # a fresh object for this attempt's folder: never a stale result of an earlier job
            tasks = tuple(range(cur_cfg.cluster.nodes * cur_cfg.hardware.gpus_per_node))
            fresh = submitit.SlurmJob(folder=job.paths.folder, job_id=job.job_id, tasks=tasks)
            tail(Path(str(job.paths.stdout)))
            try:
                fresh.results()
            except Exception as e:  # the job ran but a task raised
                print(f"FAILED: job {job.job_id}: {e}", file=sys.stderr)
                return 1
            print(f"job {job.job_id} completed" + (f" after {len(events)} failover(s)" if events else ""))
            return 0
        terminal = state in ("FAILED", "NODE_FAIL", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED",
                             "BOOT_FAIL", "DEADLINE")
        requeued_after_node_fail = state in ("PENDING", "REQUEUED") and ran_on and dead_nodes(ran_on)
        if terminal or requeued_after_node_fail:
            nodes = ran_on or _job_nodes(job.job_id)
            lost = dead_nodes(nodes)
            deadline = time.monotonic() + cfg.launcher.node_fail_wait_s
            while not lost and state != "CANCELLED" and time.monotonic() < deadline:
                time.sleep(1.0)  # a rank dies of its peer's death before SLURM marks the node down
                lost = dead_nodes(nodes)
            if not lost:
                print(f"FAILED: job {job.job_id} ended {state}; logs {job.paths.stderr}", file=sys.stderr)
                return 1
            subprocess.run(["scancel", str(job.job_id)], capture_output=True)  # SLURM's requeue cannot shrink
            if len(events) >= cfg.failover.max_failovers:
                print(f"STOPPED: node(s) {lost} lost and failover.max_failovers reached", file=sys.stderr)
                return 1
            alive = len(nodes) - len(lost)
            rp = replan_on_survivors(cur_cfg, alive)
            if rp.plan is None:
                print(f"STOPPED: no layout fits the {alive} surviving node(s): {'; '.join(rp.problems)}",
                      file=sys.stderr)
                return 1
            excluded += lost
            event = record_failover(out_dir, events, attempt=attempt, node=lost[0], old_plan=cur_plan,
                                    old_nodes=len(nodes), rp=rp, url=url, nodes_lost=lost, job_id=job.job_id,
                                    state=state, exclude=list(excluded))
            attempt += 1
            plan_dir = out_dir / f"attempt{attempt}"
            write_plan(rp.plan, plan_dir, figures=False)
            cur_cfg, cur_plan = rp.cfg, rp.plan
            job = submit(cur_cfg, plan_dir, out_dir, attempt, exclude=excluded)
            print(f"FAILOVER {len(events)}: node(s) {lost} lost (job ended {state}); re-planned on {rp.nodes} "
                  f"node(s): {', '.join(rp.changes)}; resubmitted as job {job.job_id} excluding {excluded}, "
                  f"resuming from step {event['resumed_from_step']}", flush=True)
            ran_on = []
        time.sleep(poll_s)
