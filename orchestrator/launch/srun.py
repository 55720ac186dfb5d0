"""Inside a SLURM allocation: the supervisor that owns the job's failures, and its workers.

The batch job runs `Supervisor` (submitted by launch/slurm.py with submitit, directly in
the batch step, not under srun). It runs the same failover loop as the local launcher
(supervisor.py) with `SrunWorkers`: each attempt is one `srun --no-kill` step on the
nodes still alive. The job is submitted with `--no-kill`, so losing a node does not end
the allocation: the supervisor sees the node go down (sinfo), stops the step, re-plans
on the survivors and starts a new step, with nobody watching on the login node.

Preemption and time limits: SLURM signals the training step (USR2 `signal_delay_s`
before the time limit, TERM first when it preempts); every rank saves at the next step
boundary and exits with EXIT_STOPPED, and the supervisor has the job requeued (`scontrol
requeue`, at most launcher.max_requeues times); the requeued job resumes from that
checkpoint. When SLURM signals the batch step itself, submitit calls
`Supervisor.checkpoint`, which forwards the signal and does the same. Limits: the supervisor lives on the allocation's first node;
if that node dies the job ends (SLURM requeues it when JobRequeue allows, and the next
supervisor resumes from the last complete checkpoint).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import rundir
from orchestrator.launch import sbatch
from orchestrator.launch.status import read_status, steps_completed, write_status
from orchestrator.launch.supervisor import Outcome, Workers, supervise
from orchestrator.rundir import EXIT_STOPPED

DOWN_STATES = ("down", "not_responding", "fail", "drain", "*")


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    return out.stdout.split()


def dead_nodes(nodes: list[str], tries: int = 3, timeout_s: float = 20.0) -> list[str]:
    """Nodes SLURM reports down or not responding. A slurmctld that does not answer (sinfo
    timing out or failing) is retried `tries` times, then reads as no news: the supervisor
    keeps watching instead of dying."""
    if not nodes:
        return []
    for k in range(tries):
        try:
            r = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], capture_output=True,
                               text=True, timeout=timeout_s)
            if r.returncode == 0:
                out = r.stdout
                break
        except (subprocess.TimeoutExpired, OSError) as e:
            print(f"sinfo did not answer ({type(e).__name__}), try {k + 1} of {tries}", flush=True)
        time.sleep(1.0)
    else:
        return []
    return sorted({n for n, st in (line.split() for line in out.splitlines() if line.strip())
                   if any(x in st.lower() for x in DOWN_STATES)})


def node_fail_wait_s(lc) -> float:
    """launcher.node_fail_wait_s, or what SLURM takes to mark a dead node down: SlurmdTimeout
    (scontrol show config; 300 s when it does not answer) + 30 s, at least 60 s."""
    if lc.node_fail_wait_s is not None:
        return float(lc.node_fail_wait_s)
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
        line = next(x for x in out.splitlines() if x.split("=")[0].strip() == "SlurmdTimeout")
        timeout = float(line.split("=", 1)[1].split()[0])
    except (OSError, subprocess.TimeoutExpired, StopIteration, ValueError, IndexError):
        timeout = 300.0
    return max(60.0, timeout + 30.0)


def _crash_error(logs: Path) -> str | None:
    """The first error a rank of the step ended with (rank%t.log), None when none did."""
    from orchestrator.launch.processes import last_error

    for log in sorted(Path(logs).glob("rank*.log")):
        line = last_error(logs, log.stem)
        if "Error" in line.split(":", 1)[0]:
            return line
    return None


class SrunWorkers(Workers):
    """One srun step per attempt; a node that goes down ends the step and is reported lost,
    unless the model state has several copies: then the copies it held drop out and the
    others go on in the same step (the coordinator and the job's store run here)."""

    def __init__(self, spec, run_dir: Path, nodes: list[str]):
        self.spec, self.run_dir, self.all = spec, Path(run_dir), list(nodes)
        self.proc: subprocess.Popen | None = None
        self.current: list[str] = []
        self.stop_requested = False
        self.policy = self.services = None
        self.lost: list[str] = []

    # what the in-place policy asks
    def say(self, text: str) -> None:
        print(text, flush=True)

    def waiting_spares(self) -> set[int]:
        return set()

    def lost_nodes(self) -> list:
        return list(self.lost)

    def assign(self, copies, plan, plan_dir) -> None:
        pass

    def nodes(self) -> list:
        return list(self.all)

    def start(self, attempt: int, plan_dir: Path, nodes: list, env: dict, policy=None) -> None:
        import socket

        from orchestrator.launch.hosts import for_attempt

        lc, gpn = self.spec.launcher, self.spec.hardware.gpus_per_node
        need = json.loads((plan_dir / rundir.PLAN_JSON).read_text())["nodes"]
        # logical node k -> current[k]: the plan's nodes chosen among the nodes in service (after a
        # failover: the survivors, a spare close to its group) and ordered by the cluster's topology
        alive = [n for n in self.all if n not in self.lost]
        self.current, self.policy = for_attempt(self.spec, plan_dir, alive, need), policy
        self.plan_dir = Path(plan_dir)
        (plan_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        if policy is not None:
            from orchestrator.launch.control import JobServices

            self._close()
            self.services = JobServices(list(range(policy.plan.layout.dp_replicate)), str(plan_dir),
                                        policy.decide, self.spec.failover.quorum_s, host=socket.gethostname(),
                                        run_dir=str(self.run_dir), commit_timeout_s=self.spec.failover.timeout_s)
            env = {**env, **self.services.env}
            self.node_copies = {n: self._copies_on(n) for n in self.current}  # as this attempt starts
        cmd = sbatch.srun_command(lc, plan_dir, self.current, gpn, sys.executable, self.run_dir)
        cmd.insert(1, f"--output={plan_dir / 'logs' / 'rank%t.log'}")
        job = os.environ.get("SLURM_JOB_ID", "0")
        env = dict(os.environ, **env, MASTER_ADDR=self.current[0], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   MASTER_PORT=str(15000 + (int(job) * 7 + attempt) % 20000), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   ORCH_HOSTS=",".join(self.current))  # the worker's rank from its host (train/worker.py)
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        print(f"attempt {attempt}: {' '.join(cmd)}", flush=True)

    def _copies_on(self, node: str) -> list[int]:
        """The copies of the state with a rank on `node` (ranks are laid out node by node)."""
        from orchestrator.plan.topology import RankGrid

        plan, gpn = self.policy.plan, self.spec.hardware.gpus_per_node
        grid, k = RankGrid(plan.grid().sizes, plan.order), self.current.index(node)
        return sorted({grid.coords(r)["dp"] // plan.layout.dp_shard for r in range(k * gpn, (k + 1) * gpn)})

    def wait(self) -> Outcome:
        from orchestrator.launch.failover import why_not_in_place

        lc = self.spec.launcher
        while True:
            code = self.proc.poll()
            for node in dead_nodes(self.current):
                if node in self.lost:
                    continue
                self.lost.append(node)
                copies = []
                if self.policy is not None:  # copies the coordinator has not already dropped
                    copies = sorted(set(self.node_copies[node]) & set(self.services.coordinator.current.copies))
                    if not copies:
                        continue
                why = why_not_in_place(self.policy.plan) if self.policy is not None else "one copy of the state"
                if why:  # end the step: its survivors would wait on the dead ranks
                    self.stop()
                    return Outcome(False, list(self.lost), f"node(s) {self.lost} went down (SLURM); not in place: {why}")
                self.policy.detected = self.policy.detected or time.time()
                self.services.coordinator.lost(copies)
            if self.policy is not None:
                self.policy.poll()
            if code is not None:
                break
            time.sleep(lc.poll_s)
        done = steps_completed(self.run_dir, range(10**6)) >= self.spec.training.steps
        if code == 0 or (self.policy is not None and done):
            self._close()
            return Outcome(True)
        if code == EXIT_STOPPED or self.stop_requested:
            self._close()
            return Outcome(False, [], "stopped on request (preemption or time limit)", stopped=True)
        deadline = time.monotonic() + node_fail_wait_s(lc)  # a rank dies of its peer before SLURM marks the node
        while time.monotonic() < deadline and not self.lost:
            self.lost += dead_nodes(self.current)
            time.sleep(1.0)
        self._close()
        if self.lost:
            return Outcome(False, list(self.lost), f"node(s) {self.lost} went down (SLURM); the step exited with {code}")
        error = _crash_error(self.plan_dir / rundir.LOGS)
        if error is not None:  # a rank crashed, every node is up: recover, unless the same error repeats
            return Outcome(False, [], f"a rank crashed ({error}); the step exited with {code}", crashed=True,
                           error=error)
        return Outcome(False, [], f"the training step exited with status {code}; logs in "
                                  f"{self.run_dir / 'logs'} (and attempt*/logs)")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)  # srun forwards it to every task

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.services is not None:
            self.services.close()
            self.services = None


class Supervisor:
    """What the SLURM job runs (pickled by submitit): supervise the run in `run_dir` with
    the allocation SLURM gave, from wherever an earlier job of this run left it."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.workers: SrunWorkers | None = None

    def __call__(self) -> int:
        from orchestrator.launch.runs import load_plan

        run_dir = Path(self.run_dir)
        nodes = hostnames(os.environ["SLURM_JOB_NODELIST"])
        plan = load_plan(run_dir, latest=False)  # the run as planned; after a requeue the allocation is whole again
        if len(nodes) < plan.spec.cluster.nodes:
            plan = load_plan(run_dir)  # the latest attempt's, on the survivors of a failover
        spec = plan.spec
        need, gpn = spec.cluster.nodes, spec.hardware.gpus_per_node
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", str(gpn)).split("(")[0]
        if len(nodes) < need or int(per_node) != gpn:
            msg = (f"allocation mismatch: SLURM gave {len(nodes)} node(s) with {per_node} task(s) per node, the plan "
                   f"needs cluster.nodes={need} x hardware.gpus_per_node={gpn}; stopping before any training. "
                   f"Re-plan for this allocation, or submit with the plan's")
            write_status(run_dir, state="failed", message=msg)
            raise RuntimeError(msg)
        status = read_status(run_dir)
        write_status(run_dir, state="running", job_id=os.environ.get("SLURM_JOB_ID"), nodes=nodes,
                     restarts=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        self.workers = SrunWorkers(spec, run_dir, nodes)
        code = supervise(plan, run_dir, self.workers, first_attempt=int(status.get("next_attempt", 0)))
        if code == EXIT_STOPPED:  # every rank saved on request (preemption, time limit): come back
            self._requeue_or_stop(spec.launcher)
        return code

    def checkpoint(self, *args, **kwargs):
        """Preemption or time limit signalled to this batch step (submitit calls this on USR2):
        let every rank save at its next step boundary, then requeue the job."""
        from orchestrator.launch.runs import load_plan

        lc = load_plan(Path(self.run_dir)).spec.launcher
        if self.workers is not None and self.workers.proc is not None:
            self.workers.stop_requested = True
            self.workers.signal(signal.SIGUSR2)
            deadline = time.monotonic() + max(lc.signal_delay_s - 10, 10)
            while self.workers.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        self._requeue_or_stop(lc)

    def _requeue_or_stop(self, lc) -> None:
        """Requeue this job (it resumes from the checkpoint the ranks just wrote), at most
        launcher.max_requeues times; past that, stop with one plain line saying how to continue."""
        from orchestrator.launch.runs import final_line

        run_dir = Path(self.run_dir)
        path = run_dir / "requeues.json"
        n = json.loads(path.read_text())["count"] if path.exists() else 0
        if n >= lc.max_requeues:
            write_status(run_dir, state="stopped", message=f"preempted or out of time {n + 1} time(s); "
                         f"launcher.max_requeues={lc.max_requeues} reached")
            print(final_line(run_dir), flush=True)
            os._exit(0)  # no requeue and no traceback: the status and the line above say how to continue
        path.write_text(json.dumps({"count": n + 1}))
        write_status(run_dir, state="requeued", message=f"requeue {n + 1} of at most {lc.max_requeues}")
        job = os.environ["SLURM_JOB_ID"]
        print(f"requeueing job {job} ({n + 1} of at most {lc.max_requeues}); it resumes from its checkpoint",
              flush=True)
        subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)
        time.sleep(600)  # SLURM ends this process; the requeued job starts a new supervisor
