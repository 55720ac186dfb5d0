"""Inside a SLURM allocation: the supervisor that owns the job's failures, and its workers.

The SLURM batch step runs `BatchJob` (launch/batch.py, submitted by launch/slurm.py with submitit,
directly in the batch step, not under srun), which runs (`resume`) the same failover loop as the local launcher
(supervisor.py) with `SrunWorkers`: each attempt is one `srun --no-kill` step on the
nodes still alive. The job is submitted with `--no-kill`, so losing a node does not end
the allocation: the supervisor sees the node go down (sinfo), gathers every node that fails
within the settle window (two at once are one recovery), stops the step, re-plans on the
survivors and starts a new step, with nobody watching on the login node. A node SLURM
reports drained or draining is left out of every later step and not counted as a failure;
what to do is decided in launch/failover.py.

Preemption and time limits: SLURM signals the training step (USR2 `signal_delay_s`
before the time limit, TERM first when it preempts); every rank saves at the next step
boundary and exits with EXIT_STOPPED, and the supervisor has the job requeued (`scontrol
requeue`, at most launcher.max_requeues times); the requeued job resumes from that
checkpoint. When SLURM signals the batch step itself, submitit calls
`BatchJob.checkpoint`, which forwards the signal and does the same.

The supervisor's own node: the supervisor (with the coordinator and the job's store) lives in
the batch step on the allocation's first node and holds the run's lease; a standby supervisor on
the last node takes over in the same allocation when the lease expires (launch/batch.py,
launch/lease.py). A single-node job has no standby: SLURM ends it as NODE_FAIL and, submitted with
`--requeue`, requeues it (SLURM_RESTART_COUNT > 0); the new supervisor finds status.json still
"running", records a `supervisor_lost` event and resumes from the last complete checkpoint. The
local launcher does the same when the killed `orchestrate` is run again
(tests/test_failover_decisions.py).
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
from orchestrator.rundir import events
from orchestrator.frameworks.trainers import external
from orchestrator.launch import failover, progress, sbatch, stragglers
from orchestrator.launch.keepers import SrunKeepers
from orchestrator.launch.status import read_status, steps_completed, write_status
from orchestrator.launch.supervisor import Outcome, Workers, supervise
from orchestrator.rundir import EXIT_STOPPED
from orchestrator.train import keeper


def master_port(job: str, attempt: int) -> str:
    """The attempt's rendezvous port on its first host: from the job and attempt (every task computes
    the same), in 20000-31999, below Linux's ephemeral range (32768-60999) where any process's
    outgoing connection or port-0 listener may already hold it (the master rank then cannot listen,
    EADDRINUSE, and its peers wait on whatever answers there), and above SLURM's own daemons' ports."""
    return str(20000 + (int(job) * 7 + attempt) % 12000)


def step_env(hosts: list[str], port: str) -> dict[str, str]:
    """What the supervisor adds to the job's environment for an attempt's srun step (every task
    inherits it; launch/trainers.py adds each task's own)."""
    return {"MASTER_ADDR": hosts[0], "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            rundir.ENV_HOSTS: ",".join(hosts)}  # the worker's rank from its host (train/worker.py)


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    return out.stdout.split()


def node_states(nodes: list[str], tries: int = 3, timeout_s: float = 20.0) -> dict[str, tuple[str, str]]:
    """{node: (state, reason)} as SLURM reports them (sinfo; launch/failover.parse_sinfo reads
    it). A slurmctld that does not answer (sinfo timing out or failing) is retried `tries`
    times, then reads as no news: the supervisor keeps watching instead of dying."""
    from orchestrator.launch.failover import parse_sinfo

    if not nodes:
        return {}
    for k in range(tries):
        try:
            r = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T|%E"], capture_output=True,
                               text=True, timeout=timeout_s)
            if r.returncode == 0:
                return parse_sinfo(r.stdout)
        except (subprocess.TimeoutExpired, OSError) as e:
            print(f"sinfo did not answer ({type(e).__name__}), try {k + 1} of {tries}", flush=True)
        time.sleep(1.0)
    return {}


def node_fail_wait_s(lc) -> float:
    """launcher.node_fail_wait_s, or what SLURM takes to mark a dead node down: SlurmdTimeout
    (scontrol show config; SLURM's default when it does not answer) + 30 s, at least 60 s
    (plan/timeouts.node_confirm_s, what plan.md states)."""
    from orchestrator.plan.timeouts import node_confirm_s

    if lc.node_fail_wait_s is not None:
        return node_confirm_s(lc)
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
        line = next(x for x in out.splitlines() if x.split("=")[0].strip() == "SlurmdTimeout")
        timeout = float(line.split("=", 1)[1].split()[0])
    except (OSError, subprocess.TimeoutExpired, StopIteration, ValueError, IndexError):
        timeout = None
    return node_confirm_s(lc, timeout)


def _crash_error(logs: Path, run_dir: Path) -> str | None:
    """The error the step's first crashed rank ended with (rank%t.log), None when none did: the
    rank furthest behind by its progress beat first (its peers then fail of it: "connection
    closed by peer"), then the others in order."""
    from orchestrator.launch.processes import last_error, names_error

    beats = progress.read(run_dir)
    first = min(beats.values(), key=lambda b: (b.step, b.ended, b.time)).task if beats else None
    for log in sorted(Path(logs).glob("rank*.log"), key=lambda p: (p.stem != f"rank{first}", p.name)):
        line = last_error(logs, log.stem)
        if names_error(line):
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
        self.crash: str | None = None  # a rank seen crashed while its peers wait on it
        self.drained: list[str] = []  # drained by SLURM: left out of later steps, not counted as failures
        self.keepers = SrunKeepers(spec, run_dir, self.say)  # each node's snapshot keeper, across attempts

    def lost_nodes(self) -> list:
        return list(self.lost)

    def nodes(self) -> list:
        return list(self.all)

    def start(self, attempt: int, plan_dir: Path, nodes: list, env: dict, policy=None) -> None:
        import socket

        from orchestrator.launch.hosts import for_attempt

        lc, gpn = self.spec.launcher, self.spec.hardware.gpus_per_node
        need = json.loads((plan_dir / rundir.PLAN_JSON).read_text())["nodes"]
        # logical node k -> current[k]: the plan's nodes chosen among the nodes in service (after a
        # failover: the survivors, a spare close to its group) and ordered by the cluster's topology
        alive = [n for n in self.all if n not in self.lost and n not in self.drained]
        self.current, self.policy = for_attempt(self.spec, plan_dir, alive, need), policy
        self.plan_dir = Path(plan_dir)
        (plan_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        progress.clear(self.run_dir)  # the beats of this attempt's ranks, read by wait (a hang)
        self.crash = None
        plan = json.loads((plan_dir / rundir.PLAN_JSON).read_text())
        self.timeouts(plan)
        if keeper.every_of(plan) and not external(plan):  # snapshots: a keeper on each node (started once)
            env = {**env, **self.keepers.env_for(self.current)}
        self.keepers.hand_over(plan_dir)  # a restart: where its ranks resume (a memory snapshot or the checkpoint)
        if policy is not None:
            from orchestrator.launch.control import JobServices
            from orchestrator.plan.timeouts import from_plan

            self._close()
            fo = self.spec.failover
            self.services = JobServices(list(range(policy.plan.layout.dp_replicate)), str(plan_dir),
                                        policy.decide, fo.quorum_s, host=socket.gethostname(),
                                        run_dir=str(self.run_dir), commit_timeout_s=fo.timeout_s,
                                        stragglers=stragglers.Stragglers(fo.straggler_margin, fo.straggler_steps),
                                        shards=rundir.store_shards(policy.plan.world_size, fo.store_shards),
                                        collective_s=from_plan(plan, fo)["collective_bound_s"])
            env = {**env, **self.services.env}
            self.node_copies = {n: self._copies_on(n) for n in self.current}  # as this attempt starts
        cmd = sbatch.srun_command(lc, plan_dir, self.current, gpn, sys.executable, self.run_dir)
        cmd.insert(1, f"--output={plan_dir / rundir.LOGS / 'rank%t.log'}")
        env = dict(os.environ, **env, **step_env(self.current, master_port(os.environ.get("SLURM_JOB_ID", "0"),
                                                                           attempt)))
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        print(f"attempt {attempt}: {' '.join(cmd)}", flush=True)
        return list(self.current)

    def timeouts(self, plan: dict) -> None:
        """The attempt's waits from its plan's ladder (plan/timeouts.py, as plan.md prints it): the
        hang deadline, and the settle window within which the failures SLURM reports are one
        recovery (below the quorum, so copies hit at one moment are decided together)."""
        from orchestrator.plan.timeouts import from_plan

        self.deadline = progress.deadline_s(plan, self.spec.failover)
        ladder = from_plan(plan, self.spec.failover)
        self.settle, self.stall = ladder["settle_s"], ladder.get("stall_s")

    def _copies_on(self, node: str) -> list[int]:
        """The copies of the state with a rank on `node` (ranks are laid out node by node)."""
        from orchestrator.plan.topology import RankGrid

        plan, gpn = self.policy.plan, self.spec.hardware.gpus_per_node
        grid, k = RankGrid(plan.grid().sizes, plan.order), self.current.index(node)
        return sorted({grid.coords(r)["dp"] // plan.layout.dp_shard for r in range(k * gpn, (k + 1) * gpn)})

    def _seen(self) -> list:
        """New failures SLURM reports for this step's nodes (launch/failover.failures_from_states)."""
        states = node_states(self.current)
        return failover.failures_from_states(states, self.current, known=set(self.lost) | set(self.drained))

    def resume_point(self, url: str, done: int) -> dict:
        return self.keepers.resume_point(url, done)

    def wait(self) -> Outcome:
        outcome = self._wait()
        self.keepers.lose(self.lost)  # a node lost took its keeper (its task of the keepers' step) with it
        return outcome

    def _wait(self) -> Outcome:
        lc = self.spec.launcher
        wait_s = node_fail_wait_s(lc)
        settle = self.settle  # the plan's settle window W (< quorum < collective timeout)
        pending, first = [], None  # failures gathered since `first`, decided together
        while True:
            code = self.proc.poll()
            seen = self._seen()
            pending += [f for f in seen if f.node not in {p.node for p in pending}]
            first = first or (time.monotonic() if seen else None)
            if pending and (time.monotonic() - first >= settle or code is not None):
                outcome = self._decide(pending)
                pending, first = [], None
                if outcome is not None:
                    return outcome
            if self.policy is not None and code is None and self.lost and self._left_behind():
                self.stop()  # every member finished; what is left are a lost node's ranks that could not leave
                code = self.proc.poll()
                break
            if self.policy is not None:
                self.policy.poll()
                for s in self.services.coordinator.take_stragglers():  # no spares on SLURM: named and kept
                    stragglers.name(self.run_dir, s, [n for n in self.current if s.copy in self.node_copies[n]],
                                    self.spec.failover, 0, self.say)
            hit = progress.crashed(self.run_dir, self.lost) if code is None and self.policy is None else None
            if hit is not None:  # one copy: its peers would wait out their collective timeout on it
                return self._crashed(hit)
            beats = progress.read(self.run_dir) if code is None and not self.crash else None  # read once a poll
            late = (progress.watch(self.run_dir, self.deadline, self._gone(), stall=self.stall, beats=beats)
                    if beats is not None else None)
            outcome = self._hung(late) if late is not None else None
            if outcome is not None:
                return outcome
            if late is None and beats is not None and self.policy is not None:
                self._in_collective(beats)
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
        # a rank dies of its peer before SLURM marks the node; not when a rank's own fault ended the
        # step (faulthandler's line for a segfault and its like: the rank's node was up to print it, a
        # lost node's ranks print nothing): then SLURM is asked once, not waited for
        from orchestrator.launch.processes import OWN_FAULT_LINES

        error = _crash_error(self.plan_dir / rundir.LOGS, self.run_dir)
        own_signal = error is not None and error.startswith(OWN_FAULT_LINES)
        if own_signal:
            for f in self._seen():
                (self.drained if f.kind == failover.DRAINED else self.lost).append(f.node)
        deadline = time.monotonic() + (0.0 if own_signal else wait_s)
        while time.monotonic() < deadline and not self.lost:
            for f in self._seen():
                (self.drained if f.kind == failover.DRAINED else self.lost).append(f.node)
            if self.lost:  # the rest of the settle window: a second node of the same moment
                time.sleep(settle)
                self.lost += [f.node for f in self._seen() if f.kind != failover.DRAINED]
                break
            time.sleep(1.0)
        self._close()
        if self.lost:
            return Outcome(False, list(self.lost), f"node(s) {self.lost} went down (SLURM); the step exited with "
                           f"{code}", drained=list(self.drained))
        error = error if own_signal else _crash_error(self.plan_dir / rundir.LOGS, self.run_dir)
        if error is not None:  # a rank crashed, every node is up: recover, unless the same error repeats
            beats = progress.read(self.run_dir)  # detected: from the last sign of life of the rank furthest behind
            since = min(beats.values(), key=lambda b: (b.step, b.ended, b.time)).time if beats else None
            how = ("; a fault of its own, its node up: decided on its log, not after SLURM's node window"
                   if own_signal else "")
            return Outcome(False, [], f"a rank crashed ({error}){how}; the step exited with {code}",
                           time.time() - since if since else None, crashed=True, error=error,
                           drained=list(self.drained))
        if self.drained:
            return Outcome(False, [], f"node(s) {self.drained} drained (SLURM); the step exited with {code}",
                           drained=list(self.drained))
        return Outcome(False, [], f"the training step exited with status {code}; logs in "
                                  f"{self.run_dir / rundir.LOGS} (and attempt*/{rundir.LOGS})")

    def _crashed(self, beat) -> Outcome:
        """A rank said it ended with an error of its own (its beat; its node is up): the step is
        stopped now, not after its peers' collective timeout, and the run goes on as after a crash."""
        from orchestrator.launch.processes import last_error, names_error

        detected = max(0.0, time.time() - beat.time)
        error, until = "", time.monotonic() + 5.0  # its error line reaches its log through srun (bounded)
        while time.monotonic() < until:
            error = last_error(self.plan_dir / rundir.LOGS, f"rank{beat.task}")
            if names_error(error):
                break
            time.sleep(0.2)
        print(f"rank {beat.rank} on {beat.host} crashed ({error}); the step is stopped now (its peers would wait "
              f"their collective timeout)", flush=True)
        self.stop()
        return Outcome(False, [], f"a rank crashed ({error}); the step was stopped at once", detected, crashed=True,
                       error=error, drained=list(self.drained))

    def _gone(self) -> set:
        """Hosts whose beats no longer count: lost, or (copies) every copy on them dropped by the
        coordinator (a leader's connection closed, a copy fenced: its last beat is no one's wait)."""
        gone = set(self.lost)
        if self.policy is not None and self.services is not None:
            current = set(self.services.coordinator.current.copies)
            gone |= {n for n, cs in self.node_copies.items() if cs and not set(cs) & current}
        return gone

    def _left_behind(self) -> bool:
        """Every copy of the current generation said bye for SETTLE x 2 + poll: the step only waits on
        the ranks of a node declared lost (frozen, unreachable) that could not leave themselves."""
        coord = self.services.coordinator if self.services is not None else None
        if coord is None or not coord.current.copies or not set(coord.current.copies) <= coord.finished:
            self.finishing = None
            return False
        self.finishing = getattr(self, "finishing", None) or time.monotonic()
        return time.monotonic() - self.finishing > 2 * self.settle + self.spec.launcher.poll_s

    def _in_collective(self, beats: dict) -> None:
        """Every rank in a step's cross-copy collective: the coordinator judges how long (a partition
        the control plane cannot see, launch/control.Coordinator.in_collective)."""
        gone = self._gone()
        seen = progress.in_collective({p: b for p, b in beats.items() if b.host not in gone}, time.time())
        if seen is not None and self.services.coordinator.in_collective(*seen):
            self.say(f"PARTITION: every rank waited {seen[1]:.1f} s in step {seen[0] + 1}'s cross-copy collective with "
                     f"no copy committing it; its generation aborted, re-formed without the copies cut off")

    def _hung(self, late) -> Outcome | None:
        """A rank past the progress deadline: every task dumps its Python stack into its log
        (SIGUSR1, which srun forwards; faulthandler), the hung one is named, and its node is
        treated as lost: the step ends and the run restarts without it (in place needs its
        ranks killed on their node, which this step cannot do alone)."""
        from orchestrator.launch.processes import last_error, names_error

        now = time.time()
        error = last_error(self.plan_dir / rundir.LOGS, f"rank{late.task}")
        if names_error(error):  # not a hang: it crashed without a beat saying so (a fault in native code)
            if self.policy is None:  # one copy: its peers would wait on it until their collective timeout
                return self._crashed(late)
            self.crash = error  # copies: the step ends when its peers time out and is read as a crash
            print(f"rank {late.rank} crashed ({error}); its peers stop at their collective timeout", flush=True)
            return None
        self.signal(signal.SIGUSR1)
        time.sleep(2.0)
        log = rundir.rank_log(self.plan_dir, late.task)
        what = progress.verdict(late, f"rank {late.rank}", late.host, now, self.deadline, str(log), self.stall)
        print(f"HANG: {what}", flush=True)
        self.lost.append(late.host)
        if self.policy is not None:  # copies: its copies are known lost; the coordinator aborts the survivors'
            current = set(self.services.coordinator.current.copies)  # collectives and they go on in place; the
            copies = sorted(set(self.node_copies.get(late.host, ())) & current)  # copy's ranks leave (fenced)
            if copies and not failover.why_not_in_place(self.policy.plan) and \
                    not self.policy.copies_alive_for(len(current - set(copies))):
                self.policy.detected = self.policy.detected or time.time()
                self.services.coordinator.lost(copies)
                return None
        self.stop()
        return Outcome(False, list(self.lost), what, now - late.time)

    def _decide(self, failures: list) -> Outcome | None:
        """Failures of one settle window: drained nodes are noted (left out of the next step); lost
        nodes drop their copies in place when launch/failover.decide says so, else the step ends."""
        self.drained += [f.node for f in failures if f.kind == failover.DRAINED]
        lost = [f.node for f in failures if f.kind != failover.DRAINED]
        self.lost += lost
        if not lost:
            return self._drained(failures)
        if self.policy is None:  # one copy of the state: the step ends, the loop decides (restart or stop)
            self.stop()
            return Outcome(False, list(self.lost), f"node(s) {self.lost} went down (SLURM); one copy of the state",
                           drained=list(self.drained))
        current = set(self.services.coordinator.current.copies)  # copies the coordinator has not dropped yet
        copies = sorted({c for n in lost for c in self.node_copies[n]} & current)
        if not copies:
            return None
        verdict = failover.decide(failures, self.policy.plan, copies_alive=len(current - set(copies)))
        if verdict.action not in ("in_place", "spare"):  # end the step: its survivors would wait on the dead ranks
            self.stop()
            return Outcome(False, list(self.lost), f"node(s) {self.lost} went down (SLURM); {verdict.reason}",
                           drained=list(self.drained))
        self.policy.detected = self.policy.detected or time.time()
        self.services.coordinator.lost(copies)
        return None

    def _drained(self, failures: list) -> None:
        """Nodes SLURM drained (maintenance): never counted as failures. Their copies are moved
        off in place when the plan allows (dismissed; a warm spare takes over or the rest go on),
        else they train on until this step ends and are left out of every later one."""
        nodes = [f.node for f in failures]
        if self.policy is not None:
            current = set(self.services.coordinator.current.copies)
            copies = sorted({c for n in nodes for c in self.node_copies[n]} & current)
            why = failover.why_not_in_place(self.policy.plan) or self.policy.copies_alive_for(len(current - set(copies)))
            if copies and not why:
                print(f"SLURM drained node(s) {nodes}: copies {copies} move off them in place "
                      f"(not counted as failures)", flush=True)
                self.policy.detected = self.policy.detected or time.time()
                self.services.coordinator.lost(copies)
                return None
        print(f"SLURM drained node(s) {nodes}: they are left out of every later step "
              f"(not counted as failures)", flush=True)
        return None

    def fence(self) -> None:
        """A standby took the run's lease (launch/lease.Renewer calls this): stop the step at once;
        the failover loop then returns without deciding or writing anything (supervisor.supervise)."""
        self.fenced = True
        self.stop()

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


def plan_for(run_dir: Path, nodes: list[str], takeover: bool = False):
    """The plan to go on with on `nodes`: the run's as planned (after a requeue the allocation is
    whole again), else the latest attempt's (the survivors of a failover); a standby that took over
    re-plans on the survivors when they are fewer still. An allocation that does not fit stops."""
    from orchestrator.launch.runs import load_plan
    from orchestrator.plan.replan import replan_on_survivors

    plan = load_plan(run_dir, latest=False)
    if len(nodes) < plan.spec.cluster.nodes:
        plan = load_plan(run_dir)
    if takeover and len(nodes) < plan.spec.cluster.nodes:
        rp = replan_on_survivors(plan, len(nodes))
        if rp.plan is None:
            msg = f"no layout fits the {len(nodes)} node(s) left after the supervisor's node: " + "; ".join(rp.problems)
            write_status(run_dir, state="failed", message=msg)
            raise RuntimeError(msg)
        print(f"re-planned on the {len(nodes)} surviving node(s): {', '.join(rp.changes)}", flush=True)
        return rp.plan
    need, gpn = plan.spec.cluster.nodes, plan.spec.hardware.gpus_per_node
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", str(gpn)).split("(")[0] if not takeover else str(gpn)
    if len(nodes) < need or int(per_node) != gpn:
        msg = (f"allocation mismatch: SLURM gave {len(nodes)} node(s) with {per_node} task(s) per node, the plan "
               f"needs cluster.nodes={need} x hardware.gpus_per_node={gpn}; stopping before any training. "
               f"Re-plan for this allocation, or submit with the plan's")
        write_status(run_dir, state="failed", message=msg)
        raise RuntimeError(msg)
    return plan


def start_standby(spec, run_dir: Path, node: str) -> subprocess.Popen:
    """The standby supervisor (launch/batch.py) as an srun step of one task on `node`; it writes its
    own log, logs/standby.log (not through this srun, which dies with the first node)."""
    lc = spec.launcher
    rundir.log_file(run_dir, "standby").parent.mkdir(parents=True, exist_ok=True)
    cmd = ["srun", "--overlap", "--no-kill", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
           f"--cpus-per-task={lc.cpus_per_task}", "--output=/dev/null", *sbatch.container_args(lc, run_dir),
           lc.container_python if lc.container_image else sys.executable, "-m", "orchestrator.launch.batch",
           str(run_dir)]
    print(f"standby supervisor on {node}: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)


def resume(run_dir: Path, nodes: list[str], lease, job=None, takeover=None, standby_on: str | None = None) -> int:
    """Supervise the run on `nodes` while holding `lease` (renewed on a thread; launch/lease.py),
    from wherever it was left: by an earlier job of the run (SLURM requeued it, its supervisor's node
    lost: a `supervisor_lost` event) or, for a standby that took over (`takeover`: called with the
    plan and the attempt before the ranks start), by this job's earlier supervisor. The exit code
    of the failover loop; EXIT_FENCED when a successor took the lease meanwhile."""
    from orchestrator.launch.lease import Renewer, Standby
    from orchestrator.plan.timeouts import lease_period_s

    plan = plan_for(run_dir, nodes, takeover is not None)
    status = read_status(run_dir)
    restarts, job_id = int(os.environ.get("SLURM_RESTART_COUNT", "0")), os.environ.get("SLURM_JOB_ID")
    if takeover is None and restarts and status.get("state") in ("running", "re-forming"):
        # SLURM requeued the job without this supervisor asking (its node failed: NODE_FAIL, --requeue)
        events.record(run_dir, {"mode": "supervisor_lost", "job_id": job_id, "restarts": restarts,
                                "failed_after_step": steps_completed(run_dir, range(10**6))})
    first = int(status.get("next_attempt", 0))
    write_status(run_dir, state="running", job_id=job_id, nodes=nodes, restarts=restarts, supervisor=lease.holder,
                 message=(f"standby supervisor on {lease.host} took over (lease generation {lease.generation})"
                          if takeover else f"supervisor up on {nodes[0]} (SLURM job {job_id}"
                          + (f", requeued {restarts} time(s) by SLURM" if restarts else "") + ")")
                 + ", starting the ranks")
    workers = SrunWorkers(plan.spec, run_dir, nodes)
    standby = None
    if standby_on is not None:  # kept running: a new one on another node when its node dies (lease.Standby)
        from orchestrator.launch.runs import DONE

        def start(node: str):
            if standby.tried:  # the last one's step ended while the run goes on (its node died): another elsewhere
                events.record(run_dir, {"mode": "standby_replaced", "node": node, "previous": standby.tried[-1]})
                print(f"the standby supervisor on {standby.tried[-1]} is gone: a new one on {node}", flush=True)
            return start_standby(plan.spec, run_dir, node)
        standby = Standby([n for n in nodes if n != standby_on] + [standby_on], lease.host, start,
                          gone=lambda: set(workers.lost) | set(workers.drained),
                          going=lambda: read_status(run_dir).get("state") not in DONE)
        standby.check()
    if job is not None:
        job.workers = workers
    renewer = Renewer(lease, lease_period_s(lease.timeout_s), workers.fence,
                      on_renewed=standby.check if standby is not None else None)
    code = rundir.EXIT_FAILED
    try:
        if takeover is not None:
            takeover(plan, first, takeover_point(plan, run_dir, workers))
        code = supervise(plan, run_dir, workers, first_attempt=first)
    finally:
        renewer.stop()
        if code != rundir.EXIT_FENCED:  # the run ended under this holder: no standby takes over
            lease.release()
            workers.keepers.close()  # (a holder fenced leaves them to its successor)
    return code


def takeover_point(plan, run_dir: Path, workers: SrunWorkers) -> dict:
    """Where a standby's takeover resumes (what its first attempt's ranks read): the newest snapshot
    the keepers on the surviving nodes hold (they outlive the supervisor's node and are adopted),
    when newer than the checkpoint; else the checkpoint, with why (keeper.restore_point's, or none
    taken)."""
    from orchestrator.rundir import checkpoints as ckpt

    pj = plan.to_json()
    url = ckpt.url_for(plan.spec.training.checkpoint.dir, run_dir)
    done = steps_completed(run_dir, range(10**6))
    if not keeper.every_of(pj) or external(pj):
        point = workers.resume_point(url, done)
        return {**point, "why": "the plan takes no memory snapshots"}
    workers.keepers.adopt(workers.nodes())
    point = workers.resume_point(url, done)
    if point["source"] != "snapshot" and not point.get("why"):
        point["why"] = f"no snapshot keeper answered on the surviving node(s) {workers.nodes()}"
    return point


def requeue_or_stop(run_dir: Path, lc) -> None:
    """Requeue this job (it resumes from the checkpoint the ranks just wrote), at most
    launcher.max_requeues times; past that, stop with one plain line saying how to continue."""
    from orchestrator.launch.runs import final_line

    run_dir = Path(run_dir)
    path = run_dir / rundir.REQUEUES_JSON
    n = json.loads(path.read_text())["count"] if path.exists() else 0
    if n >= lc.max_requeues:
        write_status(run_dir, state="stopped", message=f"preempted or out of time {n + 1} time(s); "
                     f"launcher.max_requeues={lc.max_requeues} reached")
        print(final_line(run_dir), flush=True)
        os._exit(rundir.EXIT_OK)  # no requeue and no traceback: the status and the line above say how to continue
    rundir.write_json(path, {"count": n + 1})
    write_status(run_dir, state="requeued", message=f"requeue {n + 1} of at most {lc.max_requeues}")
    job = os.environ["SLURM_JOB_ID"]
    print(f"requeueing job {job} ({n + 1} of at most {lc.max_requeues}); it resumes from its checkpoint",
          flush=True)
    subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)
    time.sleep(600)  # SLURM ends this process; the requeued job starts a new supervisor
