"""launcher=local: one process per emulated GPU on this machine, grouped into the
plan's emulated nodes (ranks node*gpus_per_node ... (node+1)*gpus_per_node-1).

Each rank gets the usual torch environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT). Output lines are prefixed
by node and rank and kept in RUN_DIR/logs/. If any rank fails, every other rank
is killed (each worker leads its own process group, so nothing survives it) and
the launcher reports which rank failed and how. The ranks die with the launcher
whatever ends it: Linux delivers SIGKILL to each rank when its parent dies
(PR_SET_PDEATHSIG), and SIGTERM/SIGINT stop them before the launcher exits.

A rank killed by a signal is how an (emulated) node dies: the supervisor re-plans
on the other nodes. A rank that exits with an error is the program failing, not a
node: the run stops and says why.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.config.schema import FaultMode
from orchestrator.launch.base import Launcher
from orchestrator.launch.supervisor import Outcome, Workers, steps_completed, supervise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalResult:
    returncode: int
    failed_rank: int | None = None
    failed_node: int | None = None
    cause: str = ""
    pids: list[int] = field(default_factory=list)
    seconds: float = 0.0
    signalled: bool = False  # the failed rank was killed by a signal (a lost node), not an error exit

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL this rank when the launcher dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class LocalJob:
    def __init__(self, run_dir: Path, nodes: int, gpus_per_node: int, env: dict | None = None,
                 echo: bool = True, worker: list[str] | None = None):
        self.run_dir, self.nodes, self.gpn = Path(run_dir), nodes, gpus_per_node
        self.world = nodes * gpus_per_node
        self.env, self.echo = env or {}, echo
        self.worker = worker or [sys.executable, "-m", "orchestrator.train.worker", str(self.run_dir)]
        self.procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._print_lock = threading.Lock()

    def node_of(self, rank: int) -> int:
        return rank // self.gpn

    def start(self) -> None:
        port = free_port()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for rank in range(self.world):
            env = dict(os.environ)
            env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank % self.gpn),
                       LOCAL_WORLD_SIZE=str(self.gpn), GROUP_RANK=str(self.node_of(rank)),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                       PYTHONFAULTHANDLER="1")  # a crash in native code leaves every thread's Python stack in the log
            env.update({k: str(v) for k, v in self.env.items()})
            p = subprocess.Popen(self.worker, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, text=True, bufsize=1, preexec_fn=_die_with_parent)
            self.procs.append(p)
            t = threading.Thread(target=self._pump, args=(rank, p), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, rank: int, p: subprocess.Popen) -> None:
        prefix = f"[node{self.node_of(rank)} rank{rank}] "
        with open(self.run_dir / "logs" / f"rank{rank}.log", "a") as log:
            for line in p.stdout:
                log.write(line)
                log.flush()
                if self.echo and (rank == 0 or "Error" in line or "Traceback" in line):
                    with self._print_lock:
                        try:
                            sys.stdout.write(prefix + line)
                            sys.stdout.flush()
                        except (BrokenPipeError, ValueError):  # the reader went away: keep logging
                            self.echo = False

    def kill(self, ranks=None, sig=signal.SIGKILL) -> None:
        for rank, p in enumerate(self.procs):
            if (ranks is None or rank in ranks) and p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill_node(self, node: int) -> None:
        self.kill([r for r in range(self.world) if self.node_of(r) == node])

    def wait(self, timeout: float | None = None, on_poll=None) -> LocalResult:
        t0 = time.monotonic()
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = min(failed, key=lambda rc: rc[0] if rc[1] < 0 else rc[0] + self.world)
                    # a rank killed by a signal is the cause; the others died of it
                    self.kill()
                    self._reap()
                    return LocalResult(1, rank, self.node_of(rank), f"rank {rank} (node {self.node_of(rank)}) "
                                       f"{_describe(code)}", [p.pid for p in self.procs], time.monotonic() - t0,
                                       signalled=code < 0)
                if all(c == 0 for c in codes):
                    self._reap()
                    return LocalResult(0, pids=[p.pid for p in self.procs], seconds=time.monotonic() - t0)
                if timeout is not None and time.monotonic() - t0 > timeout:
                    self.kill()
                    self._reap()
                    return LocalResult(124, cause=f"timed out after {timeout:.0f} s",
                                       pids=[p.pid for p in self.procs], seconds=time.monotonic() - t0)
                if on_poll is not None:
                    on_poll(self)
                time.sleep(0.05)
        except BaseException:  # Ctrl-C or anything else: leave no orphan behind
            self.kill()
            self._reap()
            raise

    def _reap(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for t in self._threads:
            t.join(timeout=2)


class LocalWorkers(Workers):
    """The ranks of each attempt as processes here, one emulated node per `gpus_per_node`
    ranks; fault injection (fault.*) kills an emulated node in the first attempt."""

    def __init__(self, spec, run_dir: Path, echo: bool = True):
        self.spec, self.run_dir, self.echo = spec, Path(run_dir), echo
        self.job: LocalJob | None = None
        self.current: list = []
        self.attempt = 0
        f = spec.fault
        self.fault_step = (None if f.kill_node is None else
                           random.Random(f.seed).randint(1, max(spec.training.steps - 1, 1))
                           if f.mode == FaultMode.random else f.at_step)
        self.killed_at: float | None = None

    def nodes(self) -> list:
        return list(range(self.spec.cluster.nodes))

    def start(self, attempt: int, plan_dir: Path, nodes: list, env: dict) -> None:
        env = dict(env)
        if attempt == 0 and self.fault_step is not None and self.spec.fault.mode == FaultMode.during_save:
            env.update(ORCH_FAULT_MODE="during_save", ORCH_FAULT_NODE=str(self.spec.fault.kill_node),
                       ORCH_FAULT_STEP=str(self.fault_step))
        self.attempt, self.current, self.killed_at = attempt, list(nodes), None
        self.job = LocalJob(plan_dir, nodes=len(nodes), gpus_per_node=self.spec.hardware.gpus_per_node, env=env,
                            echo=self.echo)
        self.job.start()

    def _inject(self, job: LocalJob) -> None:
        if (self.attempt == 0 and self.fault_step is not None and self.spec.fault.mode != FaultMode.during_save
                and self.killed_at is None and steps_completed(self.run_dir, (0,)) >= self.fault_step):
            node = self.spec.fault.kill_node
            print(f"fault injection: killing every process of node {node} after step {self.fault_step}", flush=True)
            self.killed_at = time.monotonic()
            job.kill_node(self.current.index(node))

    def wait(self) -> Outcome:
        res = self.job.wait(on_poll=self._inject)
        if res.ok:
            return Outcome(True)
        detected = time.monotonic() - self.killed_at if self.killed_at else None
        if res.failed_node is None or not res.signalled:
            return Outcome(False, [], res.cause + f"; logs in {self.job.run_dir / 'logs'}", detected)
        return Outcome(False, [self.current[res.failed_node]], res.cause, detected)

    def stop(self) -> None:
        if self.job is not None:
            self.job.kill()
            self.job._reap()


class LocalLauncher(Launcher):
    """launcher=local: the ranks here, supervised to the end by this process."""

    def submit(self) -> int:
        from orchestrator.config.errors import print_rejection

        problems = self.preflight()
        if problems:
            return print_rejection(problems)
        from orchestrator.launch.status import read_status, write_status

        first = int(read_status(self.run_dir).get("next_attempt", 0))  # a resumed run goes on numbering
        write_status(self.run_dir, state="running", launcher="local", pid=os.getpid())
        workers = LocalWorkers(self.spec, self.run_dir)
        stop = _StopOnSignal(workers)
        try:
            code = supervise(self.plan, self.run_dir, workers, first_attempt=first)
        finally:
            stop.restore()
        if code:
            print(f"\nFAILED: every rank was stopped. Logs: {self.run_dir / 'logs'}", file=sys.stderr)
            return code
        print(f"\ndone: TensorBoard logs in {self.run_dir / 'tensorboard'}, metrics in "
              f"{self.run_dir / 'metrics.json'}, plan and pictures in {self.run_dir}")
        return 0


class _StopOnSignal:
    """SIGTERM (and SIGHUP) stop every rank before the launcher exits with 128 + signal."""

    def __init__(self, workers: Workers):
        self.workers = workers
        self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGHUP)}

    def _handle(self, signum, frame):
        self.workers.stop()
        sys.stderr.write(f"\nstopped by {signal.Signals(signum).name}: every rank was stopped.\n")
        os._exit(128 + signum)

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)
