"""launcher=local: the ranks as processes on this machine (launch/processes.py), supervised to
the end by the `orchestrate` process with the failover loop every launcher shares.

A rank killed from outside (SIGKILL) is how an (emulated) node dies: with several copies of
the model state the other copies go on in place (launch/inplace.py), otherwise the
supervisor re-plans on the other nodes and restarts; ranks that fail within the settle
window are one failure, and launch/failover.py decides what it calls for. A rank that
crashes (an uncaught error, or a fatal signal of its own such as a segfault in native code:
processes.crashed) leaves its node up: recovered as a fault until the same error repeats. A
rank that exits with any other status is the program stopping itself: the run stops and says
why. SIGTERM and SIGINT stop every rank before the launcher exits.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir import EXIT_LEFT, EXIT_OK
from orchestrator.config.schema import FaultKind, FaultMode
from orchestrator.launch import failover, faults, progress, stragglers
from orchestrator.launch.keepers import LocalKeepers
from orchestrator.launch.base import Launcher
from orchestrator.launch.processes import LocalJob, _describe, crashed, last_error
from orchestrator.launch.status import read_metrics, steps_completed
from orchestrator.launch.supervisor import Outcome, Workers, supervise
from orchestrator.launch.trainers import local_job
from orchestrator.frameworks.trainers import external
from orchestrator.train import keeper
from orchestrator.plan import timeouts

class LocalWorkers(Workers):
    """The ranks of each attempt as processes here, one emulated node per `gpus_per_node`
    ranks. With several copies of the model state it also runs the job's store and the
    coordinator, keeps warm spare copies on cluster.spare_nodes, and lets a lost node's
    copies drop out in place (launch/inplace.py decides). Fault injection (fault.*) kills an
    emulated node in the first attempt, and can bring it back (fault.rejoin_at_step)."""

    def __init__(self, spec, run_dir: Path, echo: bool = True, say=print):
        self.spec, self.run_dir, self.echo, self.say_ = spec, Path(run_dir), echo, say
        self.job: LocalJob | None = None
        self.current: list = []
        self.attempt = 0
        self.fault_step = faults.armed_step(spec)
        self.killed_at: float | None = None
        self.rejoined = False
        self.policy = self.coordinator = self.services = None
        self.copy_of: dict[int, int] = {}  # process slot -> copy of the state
        self.spares: set[int] = set()  # copies waiting warm
        self.lost: list = []
        self.crash_error: str | None = None  # a rank that crashed in place (its node stays up)
        self.next_copy = 0
        self.next_watch = 0.0
        self.hang = None
        self.evicted: dict = {}  # node -> why it was evicted (a straggler)
        self.keepers = LocalKeepers(self.run_dir, self.say)  # each node's snapshot keeper, across attempts

    # ---- what the in-place policy asks -----------------------------------------------------
    def say(self, text: str) -> None:
        self.say_(text, flush=True)

    def waiting_spares(self) -> set[int]:
        return set(self.spares)

    def lost_nodes(self) -> list:
        return list(self.lost)

    def assign(self, copies: list[int], plan, plan_dir: Path) -> None:
        """A generation was decided: the spares it took are spares no more."""
        self.spares -= set(copies)

    # ---- Workers -------------------------------------------------------------------------
    def nodes(self) -> list:
        return list(range(self.spec.cluster.nodes + self.spec.cluster.spare_nodes))

    def start(self, attempt: int, plan_dir: Path, nodes: list, env: dict, policy=None) -> None:
        env = dict(env)
        self.attempt, self.killed_at, self.policy = attempt, None, policy
        progress.clear(self.run_dir)
        plan = json.loads((Path(plan_dir) / rundir.PLAN_JSON).read_text())
        ladder = timeouts.from_plan(plan, self.spec.failover)  # as plan.md prints it (plan/timeouts.py)
        self.deadline = progress.deadline_s(plan, self.spec.failover)
        self.bound = ladder["collective_bound_s"]  # every rank in the cross-copy collective this long: a cut
        self.stall = ladder.get("stall_s")  # ranks waiting in the cross-copy collective on one that stopped
        self.fence: tuple | None = None  # (node, until): a hung node's ranks, killed once the survivors moved on
        self.fenced_copies: set[int] = set()  # copies declared lost here (their ranks leave or are killed: expected)
        self.settle = ladder["settle_s"]  # failures this close together are one recovery (< quorum)
        self.hang: tuple | None = None  # (node, what) of a rank found hung
        gpn = self.spec.hardware.gpus_per_node
        active = nodes[: plan["nodes"]]  # the attempt's plan's nodes; the rest wait (warm spares with copies)
        self.current = list(active)
        if keeper.every_of(plan) and not external(plan):
            env.update(self.keepers.env_for(active))
        self.keepers.hand_over(plan_dir)  # a restart: where its ranks resume (a memory snapshot or the checkpoint)
        if policy is not None:
            env.update(self._serve(policy, plan_dir))
        self.job = local_job(plan_dir, nodes=len(active), gpus_per_node=gpn, env=env, echo=self.echo)
        self.job.start()
        self.job.nodes_of[:] = [active[r // gpn] for r in range(self.job.world)]  # physical nodes
        if policy is not None:
            from orchestrator.plan.topology import RankGrid

            d = policy.plan.layout
            grid = RankGrid(policy.plan.grid().sizes, policy.plan.order)
            self.copy_of = {r: grid.coords(r)["dp"] // d.dp_shard for r in range(self.job.world)}
            self.next_copy = d.dp_replicate
            spare_nodes = [n for n in nodes if n not in active]
            self._spawn_copies(plan_dir, spare_nodes, now=False)
        return list(active)

    def resume_point(self, url: str, done: int) -> dict:
        return self.keepers.resume_point(url, done)

    def _serve(self, policy, plan_dir: Path) -> dict:
        """The job's store and the coordinator, for this attempt."""
        from orchestrator.launch.control import JobServices

        fo = self.spec.failover
        self._close_services()
        self.services = JobServices(list(range(policy.plan.layout.dp_replicate)), str(plan_dir), policy.decide,
                                    fo.quorum_s, host="127.0.0.1", run_dir=str(self.run_dir),
                                    commit_timeout_s=fo.timeout_s, say=self.say,
                                    stragglers=stragglers.Stragglers(fo.straggler_margin, fo.straggler_steps),
                                    shards=rundir.store_shards(policy.plan.world_size, fo.store_shards),
                                    collective_s=self.bound)
        self.coordinator = self.services.coordinator
        return self.services.env

    def _spawn_copies(self, plan_dir: Path, nodes: list, now: bool) -> list[int]:
        """Whole copies on these nodes, waiting to join (warm spares, or a node back with now=True)."""
        from orchestrator.launch.inplace import copy_size

        gpn, size = self.spec.hardware.gpus_per_node, copy_size(self.policy.plan)
        slots = [(n, g) for n in nodes for g in range(gpn)]
        made = []
        for k in range(len(slots) // size):
            copy = self.next_copy
            self.next_copy += 1
            self.coordinator.expect(copy)  # only copies launched here may join
            for local in range(size):
                node, _ = slots[k * size + local]
                self.job.spawn(local, node, {"RANK": local, "WORLD_SIZE": self.job.world, rundir.ENV_JOIN_COPY: copy,
                                             rundir.ENV_JOIN_NOW: "1" if now else "0"}, f"copy{copy}_rank{local}")
                self.copy_of[len(self.job.procs) - 1] = copy
            made.append(copy)
            if not now:
                self.spares.add(copy)
        return made

    def _watch_progress(self) -> None:
        """A rank past the progress deadline: named, its Python stack dumped into its log, its node lost."""
        now = time.time()
        if self.hang is not None or now < self.next_watch:
            return
        self.next_watch = now + 0.5
        live = {p.pid: slot for slot, p in enumerate(self.job.procs) if p.poll() is None}
        beats = progress.read(self.run_dir, live)
        late = progress.hung(beats, now, self.deadline, self.stall)
        if late is None:
            seen = progress.in_collective(beats, now) if self.coordinator is not None else None
            if seen is not None and self.coordinator.in_collective(*seen):  # a cut nobody sees: aborted, re-formed
                self.policy.detected = time.time()
                self.say(f"PARTITION: every rank waited {seen[1]:.1f} s in step {seen[0] + 1}'s cross-copy collective "
                         f"with no copy committing it; its generation aborted, re-formed without the copies cut off")
            return
        slot = live[late.pid]
        node, name = self.job.node_of(slot), self.job.names[slot]
        try:
            os.kill(late.pid, signal.SIGUSR1)  # faulthandler: every thread's stack into logs/NAME.log
        except ProcessLookupError:
            pass
        time.sleep(1.0)
        what = progress.verdict(late, name, node, now, self.deadline, f"{rundir.LOGS}/{name}.log", self.stall)
        self.hang = (node, what, now - late.time)
        self.say(f"HANG: {what}")
        copies = sorted({c for k, c in self.copy_of.items() if self.job.node_of(k) == node}
                        & set(self.coordinator.current.copies)) if self.coordinator is not None else []
        if copies:  # known lost: the coordinator aborts the survivors' collectives now; the node's ranks are
            self.lost += [node] if node not in self.lost else []  # killed once the others moved on (bounded)
            self.policy.detected = time.time()
            self.coordinator.lost(copies)
            self.fenced_copies |= set(copies)
            self.fence = (node, self.coordinator.current.gen, time.monotonic() + self.spec.failover.quorum_s + 5)
            return
        self.job.kill_node(node)

    def _fence(self) -> None:
        """Kill a hung node's ranks once the coordinator decided without them (or its bound passed)."""
        if self.fence is not None:
            node, gen, until = self.fence
            if self.coordinator.current.gen != gen or self.coordinator.changing is None or time.monotonic() > until:
                self.fence = None
                self.job.kill_node(node)

    def _watch_stragglers(self) -> None:
        """Copies the coordinator named stragglers: named everywhere; evicted when configured and a spare waits."""
        for s in self.coordinator.take_stragglers() if self.coordinator is not None else ():
            slots = [k for k, p in enumerate(self.job.procs) if self.copy_of.get(k) == s.copy and p.poll() is None]
            nodes = sorted({self.job.node_of(k) for k in slots})
            if stragglers.name(self.run_dir, s, nodes, self.spec.failover, len(self.spares), self.say):
                for node in nodes:
                    self.lost += [node] if node not in self.lost else []  # lost before its copies' leaders close
                    self.evicted[node] = f"node {node} evicted as a straggler (copy {s.copy}, {s.ratio:.2f}x the median step)"
                    self.job.kill_node(node)

    def _inject(self) -> None:
        self._watch_progress()
        if self.policy is not None:
            self._fence()
        if self.policy is not None:
            self._watch_stragglers()
        f = self.spec.fault
        if (self.attempt == 0 and self.fault_step is not None and f.mode != FaultMode.during_save
                and f.kind == FaultKind.kill_node
                and self.killed_at is None and steps_completed(self.run_dir, (0,)) >= self.fault_step):
            print(f"fault injection: killing every process of node(s) {f.nodes()} after step {self.fault_step}",
                  flush=True)
            self.killed_at = time.monotonic()
            for node in f.nodes():
                self.job.kill_node(node)
            self.keepers.lose(f.nodes())  # and its memory (the first attempt: its nodes are the plan's own)
        if (f.rejoin_at_step is not None and self.killed_at and not self.rejoined and self.policy is not None
                and max((m["step"] + 1 for m in read_metrics(self.run_dir)), default=0) >= f.rejoin_at_step):
            self.rejoined = True
            self.say(f"fault injection: node(s) {f.nodes()} back, joining as new copies")
            self._spawn_copies(Path(self.coordinator.current.plan_dir), f.nodes(), now=True)

    def wait(self) -> Outcome:
        outcome = self._wait_restart_only() if self.policy is None else self._wait_in_place()
        self.keepers.lose({*outcome.lost, *self.lost})  # a node lost in place lost its memory too
        return outcome

    def _wait_in_place(self) -> Outcome:
        done: dict[int, int] = {}
        dropped: set[int] = set()  # copies dismissed: their exits are expected
        hit: list[tuple[int, int]] = []  # (slot, code) of ranks lost since `first`, decided together
        first = None
        while True:
            self._inject()
            dropped |= self.fenced_copies  # a hung node's copies, declared lost: their exits are expected
            dropped |= {c for h in self.coordinator.history for c in (h.get("aborted") or {}).get("cut") or ()}
            self.policy.poll()
            for slot, p in enumerate(self.job.procs):
                code = p.poll()
                if code is None or slot in done:
                    continue
                done[slot] = code
                copy = self.copy_of.get(slot)
                if code in (0, EXIT_LEFT) or copy in dropped:
                    continue
                node = self.job.node_of(slot)
                if code > 0 and not crashed(code):  # the program stopped itself and said why
                    self.stop()
                    return Outcome(False, [], f"copy {copy} slot {slot} on node {node} {_describe(code)}; logs in "
                                   f"{self.job.run_dir / rundir.LOGS}")
                hit.append((slot, code))
                self._seen(slot, code)  # what failed is known now; what to do, once the window closes
                first = first or time.monotonic()
            if hit and time.monotonic() - first >= self.settle:  # every failure of the window: one decision
                outcome = self._nodes_lost(hit, dropped)
                hit, first = [], None
                if outcome is not None:
                    return outcome
            if self.policy.refused:  # every copy was told to leave: re-plan and restart
                self.stop()
                return Outcome(False, list(self.lost), f"cannot go on in place: {self.policy.refused}",
                               self._detected(), crashed=self.crash_error is not None, error=self.crash_error)
            members = set(self.coordinator.current.copies)
            waiting = {s for s in range(len(self.job.procs)) if self.copy_of.get(s) not in members} - set(done)
            if waiting and set(done) | waiting == set(range(len(self.job.procs))):
                self.job.kill(waiting)  # the run ended: copies still waiting to join are not needed
                dropped |= {self.copy_of[s] for s in waiting}
                continue
            if len(done) == len(self.job.procs):
                if hit:  # every rank ended inside the settle window (a fast in-place recovery): decide it now
                    outcome = self._nodes_lost(hit, dropped)
                    hit, first = [], None
                    if outcome is not None:
                        return outcome
                left = [s for s, c in done.items() if c == EXIT_LEFT and self.copy_of.get(s) not in dropped]
                if not left and all(c == 0 or self.copy_of.get(s) in dropped for s, c in done.items()):
                    return Outcome(True)
                return Outcome(False, list(self.lost), "the survivors could not go on in place (failover.json)",
                               self._detected())
            time.sleep(0.05)

    def _seen(self, slot: int, code: int) -> None:
        """A rank ended unexpectedly: a crash (processes.crashed: its node stays up), else its node lost."""
        if crashed(code):
            self.crash_error = last_error(self.job.run_dir / rundir.LOGS, self.job.names[slot])
        elif self.job.node_of(slot) not in self.lost:
            self.lost.append(self.job.node_of(slot))

    def _nodes_lost(self, hit: list[tuple[int, int]], dropped: set[int]):
        """Ranks killed (their nodes lost) and ranks that crashed (an error exit or a fatal signal of
        their own: their copy),
        seen within one settle window: the copies hit drop out; the others go on in place, or
        (as launch/failover.decide says) every rank stops and the loop restarts."""
        failures, copies = [], set()
        for slot, code in hit:
            node, crash = self.job.node_of(slot), crashed(code)
            error = last_error(self.job.run_dir / rundir.LOGS, self.job.names[slot]) if crash else None
            if crash:
                failures.append(failover.Failure(node, failover.CRASH, f"slot {slot} on node {node} crashed "
                                                 f"({_describe(code)}: {error}); node {node} stays up", error))
                on = [slot]
            else:
                hang = self.hang is not None and self.hang[0] == node
                cause = (self.hang[1] if hang else self.evicted.get(node)
                         or f"node {node} lost ({_describe(code)}, slot {slot})")
                failures.append(failover.Failure(node, failover.HANG if hang else failover.NODE_LOST, cause))
                # the node's ranks that died: a copy started there since (a node back, rejoining) is not hit
                on = [s for s in range(len(self.job.procs))
                      if self.job.node_of(s) == node and (s == slot or self.job.procs[s].poll() is not None)]
            copies |= {self.copy_of[s] for s in on}
        seen: set = set()  # one failure per lost node (its every slot exits)
        failures = [f for f in failures if f.kind == failover.CRASH or not (f.node in seen or seen.add(f.node))]
        dropped |= copies
        self.spares -= copies
        self.job.kill([s for s in range(len(self.job.procs)) if self.copy_of.get(s) in copies])
        active = set(self.coordinator.current.copies)
        if not copies & active and not self.policy.refused:  # the coordinator already re-formed without them
            self.say(f"FAILURE: {'; '.join(f.cause for f in failures)}; copies {sorted(copies)} already dropped")
            return None
        verdict = failover.decide(failures, self.policy.plan, copies_alive=len(active - dropped),
                                  spares=len(self.spares))
        cause = "; ".join(f.cause for f in failures)
        any_crash = any(f.kind == failover.CRASH for f in failures)
        if verdict.action not in ("in_place", "spare"):
            self.say(f"FAILURE: {verdict.reason}")
            self.stop()
            return Outcome(False, list(self.lost), cause, self._detected(), crashed=any_crash,
                           error=self.crash_error if any_crash else None)
        self.policy.detected = time.time()
        self.say(f"FAILURE: {cause}; copies {sorted(copies & active)} lost, the others go on in place")
        self.coordinator.lost(sorted(copies & active))
        return None

    def _detected(self) -> float | None:
        if self.hang is not None:
            return self.hang[2]
        return time.monotonic() - self.killed_at if self.killed_at else None

    def _wait_restart_only(self) -> Outcome:
        res = self.job.wait(on_poll=lambda job: self._inject(), settle_s=self.settle)
        if res.ok:
            return Outcome(True)
        detected = self._detected()
        if res.failed_node is not None and crashed(res.code):  # its node stays up
            rank, beat = self._first_crashed()
            error = last_error(self.job.run_dir / rundir.LOGS, self.job.names[rank])
            detected = time.time() - beat.time if beat else None  # from its last sign of life
            how = _describe(self.job.procs[rank].poll())
            return Outcome(False, [], f"rank {rank} (node {self.job.node_of(rank)}) {how}: {error}", detected,
                           crashed=True, error=error)
        if res.failed_node is None or not res.signalled:
            return Outcome(False, [], res.cause + f"; logs in {self.job.run_dir / rundir.LOGS}", detected)
        if self.hang is not None:
            return Outcome(False, [self.current[self.hang[0]]], self.hang[1], self.hang[2])
        lost = [self.current[n] for n in res.failed_nodes]  # every node lost within the settle window
        return Outcome(False, lost, res.cause if len(lost) == 1 else f"nodes {lost} lost together ({res.cause})",
                       detected)

    def _first_crashed(self):
        """Of the ranks that crashed (an error exit or a fatal signal of their own), the one furthest
        behind (its peers failed of it)."""
        failed = {p.pid: r for r, p in enumerate(self.job.procs) if crashed(p.poll())}
        beats = progress.read(self.run_dir, failed)
        if not beats:
            return min(failed.values()), None
        first = min(beats.values(), key=lambda b: (b.step, b.ended, b.time))
        return failed[first.pid], first

    def stop(self) -> None:
        if self.job is not None:
            self.job.kill()
            self.job._reap()
        self._close_services()

    def _close_services(self) -> None:
        if self.services is not None:
            self.services.close()
            self.services = None


class LocalLauncher(Launcher):
    """launcher=local: the ranks here, supervised to the end by this process."""

    def submit(self) -> int:
        from orchestrator.config.errors import print_rejection

        problems = self.preflight()
        if problems:
            return print_rejection(problems)
        from orchestrator.launch.status import read_status, write_status

        first = int(read_status(self.run_dir).get("next_attempt", 0))  # a resumed run goes on numbering
        _note_a_lost_supervisor(self.run_dir, self.spec)
        write_status(self.run_dir, state="running", launcher="local", pid=os.getpid())
        workers = LocalWorkers(self.spec, self.run_dir)
        stop = _StopOnSignal(workers)
        try:
            code = supervise(self.plan, self.run_dir, workers, first_attempt=first)
        finally:
            stop.restore()
            workers.keepers.close()
        how = read_status(self.run_dir)
        if code:
            print(f"\n{how.get('state', 'failed').upper()}: {how.get('message', '')}; every rank was stopped. "
                  f"Logs: {self.run_dir / rundir.LOGS}", file=sys.stderr)
            return code
        print(f"\nCOMPLETED: {how.get('message', '')}")
        print(f"done: TensorBoard logs in {self.run_dir / rundir.TENSORBOARD}, metrics in "
              f"{self.run_dir / rundir.METRICS_JSON}, plan and pictures in {self.run_dir}")
        return EXIT_OK


def _note_a_lost_supervisor(run_dir: Path, spec) -> None:
    """A run whose earlier supervisor died (killed, or its machine lost) is resumed from its last
    complete checkpoint: said, and recorded in failover.json."""
    from orchestrator.launch.runs import state
    from orchestrator.launch.status import read_status, write_status
    from orchestrator.rundir import checkpoints as ckpt, events

    before = read_status(run_dir)
    if before.get("state") in ("running", "re-forming"):
        state(run_dir)  # marks a dead supervisor (status.supervisor_lost)
    lost = read_status(run_dir).get("supervisor_lost")
    if not lost:
        return
    write_status(run_dir, supervisor_lost=None)
    resume = ckpt.latest_complete(ckpt.url_for(spec.training.checkpoint.dir, run_dir)) or 0
    events.record(run_dir, {"mode": "supervisor_lost", "pid": lost, "resumed_from_step": resume,
                            "failed_after_step": steps_completed(run_dir, range(10**6))})
    print(f"the supervisor (pid {lost}) of this run was lost; resuming from the last complete checkpoint "
          f"(step {resume})", flush=True)


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
