"""Processes on this machine, one per emulated GPU, grouped into emulated nodes (ranks
node*gpus_per_node ... (node+1)*gpus_per_node-1).

Each rank gets the usual torch environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT). Output lines are prefixed
by node and rank and kept in RUN_DIR/logs/. Each worker leads its own process group,
so killing it leaves nothing behind, and dies with the launcher whatever ends it:
Linux delivers SIGKILL to each rank when its parent dies (PR_SET_PDEATHSIG).
The ranks of the default worker are forked from one process that imported the runtime
once (launch/forkserver.py; ORCH_FORK_SERVER=0 starts each with its own interpreter).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import rundir
from orchestrator.launch.forkserver import die_with_parent as _die_with_parent

RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
ECHOED = ("step ", "generation ", "resumed from", "copy ", "stopping after")  # whichever rank says them
WARNED = ("Error", "Traceback", "CHECKPOINT", "NO INTACT")


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
    signalled: bool = False  # the failed rank was killed from outside (its node lost: node_lost), not a crash
    code: int | None = None  # the failed rank's own exit status
    failed_nodes: list[int] = field(default_factory=list)  # every node whose ranks were killed (node_lost)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# A process's own fatal signals as Popen reports them (-signal), an uncaught error (1) and those
# signals as a shell reports them (128 + signal: 134 abort, 139 segfault, ...). A rank that ends so
# crashed: its node stays up (a fault until it repeats). Any other signal killed it from outside:
# an (emulated) node lost.
OWN_FAULTS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)  # a fault in the process itself
CRASH_SIGNALS = (*OWN_FAULTS, signal.SIGABRT)  # ... and an abort (its own, or c10d's when a peer is gone)
CRASH_STATUSES = (1, *(128 + s for s in CRASH_SIGNALS))


def crashed(code: int | None) -> bool:
    """A rank's exit status says it crashed (an error, or a fatal signal of its own)."""
    return code is not None and (code in CRASH_STATUSES or (code < 0 and -code in CRASH_SIGNALS))


def node_lost(code: int | None) -> bool:
    """A rank's exit status says it was killed from outside: its node is lost."""
    return code is not None and code < 0 and not crashed(code)


FATAL_SIGNAL = "Fatal Python error"  # faulthandler's first line when a fatal signal ends the process
# ... for OWN_FAULTS (both spellings CPython has used for SIGFPE). Not SIGABRT ("Aborted"): NCCL's
# watchdog and c10d abort a rank whose peer is gone (a lost node) that way.
OWN_FAULT_LINES = tuple(f"{FATAL_SIGNAL}: {what}" for what in ("Segmentation fault", "Bus error", "Illegal instruction",
                                                               "Floating point exception", "Floating-point exception"))


def names_error(line: str) -> bool:
    """A log line that names an exception, or faulthandler's line for a fatal signal."""
    head = line.split(":", 1)[0]
    return "Error" in head or "Exception" in head or line.startswith(FATAL_SIGNAL)


def last_error(logs: Path, name: str) -> str:
    """The error a crashed rank ended with: the last line of its log that names an exception
    (the comparison that tells a repeated bug from a fault)."""
    try:  # torch prefixes what a rank prints of an uncaught error with "[rankN]: "
        lines = [RANK_PREFIX.sub("", x).strip() for x in (Path(logs) / f"{name}.log").read_text(errors="replace").splitlines()
                 if x.strip()]
    except OSError:
        return "no log"
    errors = [i for i, x in enumerate(lines) if names_error(x)]
    if not errors:
        return (lines or ["no output"])[-1][:300]
    line = lines[errors[-1]]
    if line.startswith(FATAL_SIGNAL):  # faulthandler's stacks follow, the faulting thread's ("Current
        # thread"), innermost frame first: where it died (two faults in different places at the same step
        # are then not read as one repeated bug)
        after = lines[errors[-1] + 1:]
        start = next((i for i, x in enumerate(after) if x.startswith("Current thread")), 0)
        frame = next((x for x in after[start:] if x.startswith("File ")), None)
        line = f"{line} in {frame}" if frame else line
    return line[:300]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def apply(environ, variables: dict) -> None:
    """Set each variable in `environ`, removing those given as None (a variable a rank must not
    inherit, e.g. Megatron-FSDP's CUDA_DEVICE_MAX_CONNECTIONS)."""
    for k, v in variables.items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v


class LocalJob:
    def __init__(self, run_dir: Path, nodes: int, gpus_per_node: int, env: dict | None = None,
                 echo: bool = True, worker: list[str] | None = None):
        self.run_dir, self.nodes, self.gpn = Path(run_dir), nodes, gpus_per_node
        self.world = nodes * gpus_per_node
        self.env, self.echo = env or {}, echo
        self.worker = worker or [sys.executable, "-m", "orchestrator.train.worker", str(self.run_dir)]
        self.forked = worker is None and os.environ.get(rundir.ENV_FORK_SERVER, "1") != "0"
        self.server = None
        self.procs: list = []  # subprocess.Popen, or forkserver.ForkedProcess
        self._threads: list[threading.Thread] = []
        self._print_lock = threading.Lock()

    def node_of(self, rank: int) -> int:
        return self.nodes_of[rank] if rank < len(self.nodes_of) else rank // self.gpn

    def _runtime_modules(self) -> tuple[str, ...]:
        """What the ranks will import: the runtime, and torch's pipelining when the plan has stages."""
        try:
            pp = json.loads((self.run_dir / rundir.PLAN_JSON).read_text())["layout"]["pp"]
        except (OSError, ValueError, KeyError):
            pp = 1
        return ("orchestrator.train.worker",) + (("orchestrator.train.pipeline",) if pp > 1 else ())

    def start(self) -> None:
        self.port = free_port()
        self.nodes_of: list[int] = []
        self.names: list[str] = []  # each process's log name (logs/NAME.log)
        (self.run_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        for rank in range(self.world):
            self.spawn(rank, rank // self.gpn, {"RANK": rank, "WORLD_SIZE": self.world}, f"rank{rank}")

    def spawn(self, rank: int, node: int, env: dict, name: str) -> subprocess.Popen:
        """One more process: a rank of this attempt, or a spare or rejoining copy's."""
        full = dict(os.environ)
        full.update(LOCAL_RANK=str(rank % self.gpn), LOCAL_WORLD_SIZE=str(self.gpn), GROUP_RANK=str(node),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), OMP_NUM_THREADS="1",
                    PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                    PYTHONFAULTHANDLER="1")  # a crash in native code leaves every thread's Python stack in the log
        if self.forked and self.server is None:
            from orchestrator.launch.forkserver import ForkServer

            self.server = ForkServer(dict(full, **{k: str(v) for k, v in self.env.items()}),
                                     self._runtime_modules())
        apply(full, {k: None if v is None else str(v) for k, v in {**self.env, **env}.items()})
        if self.server is not None:
            p = self.server.spawn(full, str(self.run_dir))
        else:
            p = subprocess.Popen(self.worker, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full,
                                 start_new_session=True, text=True, bufsize=1, preexec_fn=_die_with_parent)
        self.procs.append(p)
        self.nodes_of.append(node)
        self.names.append(name)
        t = threading.Thread(target=self._pump, args=(len(self.procs) - 1, p, name), daemon=True)
        t.start()
        self._threads.append(t)
        return p

    def _pump(self, slot: int, p: subprocess.Popen, name: str) -> None:
        rank = slot
        prefix = f"[node{self.node_of(slot)} {name}] "
        with open(self.run_dir / rundir.LOGS / f"{name}.log", "a") as log:
            for line in p.stdout:
                log.write(line)
                log.flush()
                said = rundir.rank_message(line)
                if self.echo and (rank == 0 or said.startswith(ECHOED) or any(w in said for w in WARNED)):
                    with self._print_lock:
                        try:
                            sys.stdout.write(prefix + said)
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
        self.kill([r for r in range(len(self.procs)) if self.node_of(r) == node])

    def wait(self, timeout: float | None = None, on_poll=None, settle_s: float = 0.0) -> LocalResult:
        """Until every rank ended, one failed (then, after `settle_s` more to see every failure of
        the same moment, stop the rest), or `timeout`."""
        t0 = time.monotonic()
        first = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed and first is None:
                    first = time.monotonic()
                if failed and (time.monotonic() - first >= settle_s or all(c is not None for c in codes)):
                    # the cause: a rank killed from outside (its node), else one that died of a fault of
                    # its own (OWN_FAULTS), else the lowest rank of the others (an error exit, an abort:
                    # what a peer's failure ends a rank with); the others died of it
                    rank, code = min(failed, key=lambda rc: (0 if node_lost(rc[1]) else
                                                             1 if rc[1] < 0 and -rc[1] in OWN_FAULTS else 2, rc[0]))
                    self.kill()
                    self._reap()
                    return LocalResult(1, rank, self.node_of(rank), f"rank {rank} (node {self.node_of(rank)}) "
                                       f"{_describe(code)}", [p.pid for p in self.procs], time.monotonic() - t0,
                                       signalled=node_lost(code), code=code,
                                       failed_nodes=sorted({self.node_of(r) for r, c in failed if node_lost(c)}))
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
        if self.server is not None:
            self.server.close()
            self.server = None
