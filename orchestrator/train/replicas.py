"""What crosses the copies of the model state, owned by the runtime so a lost copy can be
dropped in place (layout.dp_shard < dp; launch/control.py is the other side).

Each copy trains in its own torch world (its FSDP, TP, CP and PP groups never span
copies). Per generation the copies build one kind of gloo group straight over the job's
rendezvous store, outside torch's registry: `replica` (the ranks at the same position in
every copy: gradient averaging, and the state a newcomer receives). Nothing per step spans
all N ranks: the loss and the stop flag are summed inside each copy and cross copies
through the copy leaders' commit messages (the coordinator answers with the totals); with
more copies than the commit tree's fan-in they are summed on the way up a tree of leaders
(train/tree.py): each leader then also serves an Aggregator for its children.
When a copy is known lost, the coordinator aborts the survivors' pending cross-copy collectives
at once (launch/control.py): it sets the generation's abort key on every shard of the job's store,
which every rank watches on its copy's shard, on a connection of its own (one blocked `wait` a rank,
nothing per step; a TCPStore client serves one operation at a time, and the training thread's may be
in a group's lazy connect; each server holds the watchers of its share of the copies); a rank
waiting in a cross-copy collective (in slices, `_wait`) then leaves it as failed, and a rank
whose own copy is named lost leaves the run (fenced: a copy declared lost never comes back as a
zombie). The collective timeout stays the last resort, for a loss nobody noticed.
When a collective fails, the groups are dropped (references released and collected, so
their sockets close and the other survivors fail fast instead of waiting for the timeout)
and the copy's leader asks the coordinator what the next generation is.

Store traffic per rebuild (N ranks, R copies of N/R ranks): N/R groups of R members, made
with gloo's lazy init (TORCH_GLOO_LAZY_INIT), so a rank publishes its address once and reads
only the peers it talks to: ring all-reduce 2, the state broadcast 1 (R-1 for its root).
About 3N store operations a rebuild, whatever R; gloo's full mesh would be N(R-1) reads. Only
these groups are rebuilt (a copy's own world is not: a lost copy changes none of the others'). The
store runs K shards (rundir.store_shards, one per ~4k ranks; failover.store_shards) and each group's
keys live on its position's shard (rundir.store_shard), so the N/R groups rebuild on min(K, N/R)
servers at once: 3R x ceil(N/R / K) operations on the busiest (plan/goodput.rebuild_s, which the
plan and benchmarks/failover_sim.py charge). Every key is under the job's prefix (ORCH_JOB): the
store cannot authenticate.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestrator import rundir
from orchestrator.train import tree, wire

log = logging.getLogger("orchestrator")
ABORT_SLICE = timedelta(seconds=0.05)  # a cross-copy wait looks at the abort flag this often (no cost when done)
REACH_S = 1.0  # after a partition abort a leader gives each ring neighbour this long to answer on the data path
ABORT_GRACE_S = 1.0  # a collective failed by a peer: how long the abort, if it is why, may take to reach the watcher


def connect_store(addr: str, timeout_s: float = 120.0) -> dist.Store:
    """A client of the job's store, under the job's key prefix (ORCH_JOB); retried with a short
    connect timeout (a client that starts its connect before the server listens can
    otherwise hang for the whole timeout)."""
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=1))
            store.set_timeout(timedelta(seconds=timeout_s))
            job = os.environ.get(rundir.ENV_JOB)
            return dist.PrefixStore(job, store) if job else store
        except (RuntimeError, dist.DistError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class JobStores:
    """The job's store as one rank sees it: its shards (ENV_STORE, rundir.store_shards), a client
    per shard this rank talks to, connected on first use. Every key of one group lives on one shard
    (rundir.store_shard): a copy's own world on its copy's, a cross-copy group on its position's.
    A rank talks to at most two shards (its copy's, its position's); with one shard, one client."""

    def __init__(self, value: str):
        self.addresses = rundir.store_addresses(value)
        self.clients: dict[int, dist.Store] = {}

    @property
    def shards(self) -> int:
        return len(self.addresses)

    def shard(self, i: int) -> dist.Store:
        if i not in self.clients:
            self.clients[i] = connect_store(self.addresses[i])
        return self.clients[i]

    def of_copy(self, copy: int) -> int:
        """The shard of copy `copy`'s own world (and of its ranks' abort watchers)."""
        return rundir.store_shard(copy, self.shards)

    def of_position(self, local: int) -> int:
        """The shard of the cross-copy group of the ranks at position `local` in every copy."""
        return rundir.store_shard(local, self.shards)

    def for_copy(self, copy: int) -> dist.Store:
        return self.shard(self.of_copy(copy))

    def for_position(self, local: int) -> dist.Store:
        return self.shard(self.of_position(local))


class Replicas:
    def __init__(self, stores: JobStores | None, control: str | None, copy: int, local_rank: int, copy_size: int,
                 timeout_s: float, copies: list[int]):
        self.stores, self.copy, self.local, self.size = stores, copy, local_rank, copy_size
        self.timeout_s, self.timeout = timeout_s, timedelta(seconds=timeout_s)
        self.gen, self.copies = -1, list(copies)
        self.replica = None
        self.client = self.agg = self.server = None
        self.parents: dict[str, wire.Client] = {}  # aggregator address -> our connection to it
        self.up: wire.Client | None = None  # this generation's parent (None: the coordinator)
        self.direct_gen = -1  # the generation the coordinator told us to report to it directly in
        self.waiter = None
        self.aborted = -1  # the latest generation whose cross-copy collectives the coordinator aborted
        self.lost_by_abort: list[int] = []
        self._abort_seen = threading.Condition()
        self._gen_changed = threading.Event()
        self._done = False
        self.on_fenced = None  # called before a fenced rank leaves
        self.abort_dead: dict[int, list] = {}  # generation -> the copies its abort named ([]: a partition)
        self.reach_server = None  # the leader's listener its peers try after a partition abort (`reach`)
        self.next_step = 0  # the step whose cross-copy collective comes next (the last committed + 1)
        self.cut_from: int | None = None  # fault.kind=cut_copy: from this step this copy is cut off (injected)
        if stores is not None:  # watched on its copy's shard (the abort key is set on every shard)
            threading.Thread(target=self._watch_aborts, args=(stores.addresses[stores.of_copy(copy)],),
                             name="abort-watch", daemon=True).start()
        if control and local_rank == 0:  # the copy's leader speaks for it
            self.client = wire.Client(control, wire.env_secret())
            self.k = tree.fan_in(len(copies))
            if self.k < len(copies):
                self._serve_tree()

    def _watch_aborts(self, addr: str) -> None:
        """Wake this rank out of its generation's cross-copy collectives when the coordinator aborts
        them (a blocked wait on the store, on a connection of its own: the training thread's may be
        busy in a group's lazy connect). Bounded waits, looked at again while the run goes on."""
        try:
            store = connect_store(addr)
        except (RuntimeError, dist.DistError):
            return  # no watcher: the collectives time out as before
        while not self._done:
            gen = self.gen
            if gen < 0:
                self._gen_changed.wait(1.0)
                self._gen_changed.clear()
                continue
            key, t0 = rundir.abort_key(gen), time.monotonic()
            try:
                store.wait([key], timedelta(seconds=30))
                dead = json.loads(store.get(key).decode() or "[]")
            except (RuntimeError, dist.DistError, ValueError):
                if time.monotonic() - t0 < 1.0:  # the store is gone (the run is ending): do not spin
                    time.sleep(1.0)
                continue  # not yet (the wait's own bound): look again
            with self._abort_seen:
                self.abort_dead[gen] = list(dead)
                if dead:
                    self.lost_by_abort = list(dead)
                self.aborted = max(self.aborted, gen)
                self._abort_seen.notify_all()
            if self.copy in dead and self.gen == gen:  # this copy was declared lost: it must not come back
                log.info(f"copy {self.copy} was declared lost in generation {gen}: leaving the run (fenced)")
                if self.on_fenced is not None:
                    self.on_fenced()  # (the trainer's: its progress beat forgotten, a dismissed copy is no hang)
                logging.shutdown()
                os._exit(rundir.EXIT_LEFT)
            while self.gen == gen and not self._done:
                self._gen_changed.wait(1.0)
                self._gen_changed.clear()

    def _wait(self, work) -> None:
        """Wait for a cross-copy collective, in slices, leaving it as failed when the coordinator
        aborted this generation (a copy known lost) before it completed."""
        gen, deadline = self.gen, time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(ABORT_SLICE)
                return
            except RuntimeError as e:
                if "Operation timed out" not in str(e):
                    # the collective itself failed (a peer reset, gloo's own timeout). When the coordinator
                    # aborted this generation, that is why: the copies it declared lost leave only after its
                    # abort key is set, so the abort reaches this rank's watcher at the same moment (bounded)
                    if self._aborted_within(gen, ABORT_GRACE_S):
                        raise self._abort_error(gen) from e
                    raise
            if self.aborted >= gen:
                raise self._abort_error(gen)
            if time.monotonic() > deadline:  # the last resort, whatever gloo's own timeout says
                raise RuntimeError(f"generation {gen}'s cross-copy collective timed out after the collective "
                                   f"timeout ({self.timeout_s:.0f} s) with no abort")

    def _aborted_within(self, gen: int, seconds: float) -> bool:
        with self._abort_seen:
            return self._abort_seen.wait_for(lambda: self.aborted >= gen, timeout=seconds)

    def _abort_error(self, gen: int) -> RuntimeError:
        return RuntimeError(f"generation {gen}'s cross-copy collective aborted by the coordinator: "
                            f"copies {self.lost_by_abort} lost")

    @property
    def index(self) -> int:
        """This copy's place in the data order of the current generation."""
        return self.copies.index(self.copy)

    def _serve_tree(self) -> None:
        """This leader's aggregator (its children's commits come to it), announced to the coordinator."""
        from orchestrator.train.control_server import ControlServer

        key = wire.env_secret()
        self.agg = tree.Aggregator(self.copy, self._to_parent, lambda body, cb: self.client.submit(body, cb))
        self.server = ControlServer(self.agg, key, host=self.client.sock.getsockname()[0])
        self.client.listen(self._pushed)
        self.client.send({"op": "hi", "copy": self.copy, "gen": self.gen, "addr": self.server.address()})
        self.key = key

    def _pushed(self, msg: dict) -> None:
        """The coordinator's `report` (a change began): this generation's commits go to it directly."""
        if msg.get("op") == "report" and isinstance(msg.get("gen"), int):
            self.direct_gen = max(self.direct_gen, msg["gen"])
            waiter = self.waiter
            if waiter is not None and msg["gen"] >= self.gen:
                waiter(None)

    def _to_parent(self, body: dict, callback) -> None:
        (self.up or self.client).submit(body, callback)

    def _find_parent(self) -> None:
        """This generation's parent in the tree (asked once a generation; "" is the coordinator)."""
        self.tree_gen = self.gen
        try:
            answer = self.client.request({"op": "tree", "copy": self.copy, "gen": self.gen, "step": 0}, self.timeout_s)
        except (OSError, ConnectionError):
            answer = {}
        addr = answer.get("parent", "")
        if answer.get("k", self.k) != self.k:  # a leader started with another count of copies
            self.k = answer["k"]
            self.agg.configure(self.gen, self.copies, self.k)
        self.up = None
        if addr:
            if addr not in self.parents or self.parents[addr].closed:
                try:
                    self.parents[addr] = wire.Client(addr, self.key, connect_s=5.0)
                except (OSError, ConnectionError, wire.Refused):
                    return  # unreachable: this generation's commits go to the coordinator
            self.up = self.parents[addr]

    def tree_for(self, gen: int, copies: list[int]) -> None:
        """Generation `gen` for the commit tree: this leader's children, its parent looked up at the
        generation's first commit. The fan-in is the coordinator's (fixed at the job's start; the
        `tree` answer carries it)."""
        self.gen, self.copies = gen, list(copies)
        self._gen_changed.set()
        if self.agg is not None:
            self.agg.configure(gen, self.copies, self.k)
            self.tree_gen = None

    def build(self, gen: int, copies: list[int]) -> None:
        """The groups of generation `gen` over `copies` (every member calls this)."""
        self.drop()
        self.tree_for(gen, copies)
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # pairs connect on first use: O(peers used) store reads
        rep = dist.PrefixStore(f"gen{gen}/replica{self.local}", self.stores.for_position(self.local))
        self.replica = dist.ProcessGroupGloo(rep, self.index, len(self.copies), self.timeout)
        if self.client is not None:  # where its peers try this leader after a partition abort (`reach`)
            if self.reach_server is None:
                self.reach_server = _Listener(self.client.sock.getsockname()[0])
            self.stores.for_copy(self.copy).set(_reach_key(gen, self.copy), self.reach_server.addr)

    def drop(self) -> None:
        """Release this generation's groups now: their sockets close, and peers blocked on them
        fail at once instead of after the timeout. The group is destroyed on a thread of its own:
        a gloo group whose lazily connecting pair waits on a dead peer blocks its destructor until
        the collective timeout, and a copy stuck there would report after the quorum closed and be
        evicted although healthy (torch releases the GIL while a process group is destroyed)."""
        box = [self.replica] if self.replica is not None else []
        self.replica = None
        if box:
            threading.Thread(target=_release, args=(box,), name="replica-drop", daemon=True).start()

    def ask(self, msg: dict, timeout_s: float | None = None) -> dict:
        """The leader asks the coordinator; every rank of the copy gets the same answer."""
        box = [None]
        if self.client is not None:
            try:
                box[0] = self.client.request({**msg, "copy": self.copy, "gen": self.gen}, timeout_s)
            except (OSError, ConnectionError, wire.Refused) as e:
                box[0] = {"op": "exit", "reason": f"the coordinator went away ({type(e).__name__}: {e})"}
        dist.broadcast_object_list(box, src=0)  # inside the copy's own world
        return box[0]

    def commit(self, step: int, ok: bool, sums: torch.Tensor, busy_s: float = 0.0, saving: bool = False) -> dict:
        """End of a step: the copy's (loss, count, stop) summed inside the copy, with whether every
        rank got through the cross-copy collectives; the leader asks to commit (or reports the
        failure) with them, and the answer carries the totals over every copy. `busy_s`: the
        leader's time on the copy's own work before it waited on the other copies (its peers in
        the copy are in lockstep with it through the copy's collectives): the coordinator's
        straggler measure; `saving`: a checkpoint save shared that time (not counted against it)."""
        totals = self.copy_totals(sums, ok)
        body = {"op": "failed" if totals[3] > 0 else "commit", "step": step, "sums": totals[:3],
                "busy": float(busy_s), "saving": bool(saving)}
        if body["op"] == "failed" and self.client is not None and self.abort_dead.get(self.gen) == []:
            body.update(self.reach())  # a partition abort: which neighbours its data path reaches
        if body["op"] == "commit":
            self.next_step = step + 1
        # The coordinator answers within its commit deadline plus the quorum window; past that it is gone.
        if self.agg is None or body["op"] == "failed" or self.direct_gen >= self.gen:
            return self.ask(body, timeout_s=4 * self.timeout_s + 60)
        box = [None]
        if self.client is not None:
            box[0] = self._up_the_tree({**body, "copy": self.copy, "gen": self.gen}, 4 * self.timeout_s + 60)
        dist.broadcast_object_list(box, src=0)  # inside the copy's own world
        return box[0]

    def _up_the_tree(self, body: dict, timeout_s: float) -> dict:
        """The leader's commit through its aggregator (or its parent's); the coordinator directly
        when the tree cannot take it (a parent gone, `rehome`, the coordinator's push)."""
        if getattr(self, "tree_gen", None) != self.gen:
            self._find_parent()
        done, box = threading.Event(), []

        def settle(answer):
            if not box:
                box.append(answer)
            done.set()
        self.waiter = settle
        try:
            if self.direct_gen < self.gen:
                if self.agg.kids:  # an aggregator takes its own copy's commit first
                    self.agg.handle(body, settle)
                else:
                    self._to_parent(body, settle)
                done.wait(timeout_s)
        finally:
            self.waiter = None
        answer = box[0] if box else None
        if answer is None or answer.get("op") in ("rehome", "report"):
            try:
                return self.client.request(body, timeout_s)
            except (OSError, ConnectionError, wire.Refused) as e:
                return {"op": "exit", "reason": f"the coordinator went away ({type(e).__name__}: {e})"}
        return answer

    @staticmethod
    def copy_totals(sums: torch.Tensor, ok: bool) -> list[float]:
        """(loss, count, stop) summed over this copy's world, and how many of its ranks failed a
        cross-copy collective: host scalars, on the world's host-side backend (world.host_reduce)."""
        flag = torch.tensor([float(x) for x in sums] + [0.0 if ok else 1.0], dtype=torch.float64)
        dist.all_reduce(flag)  # on the world's host-side backend (cpu:gloo beside nccl, world.backend_for)
        return flag.tolist()

    def reach(self) -> dict:
        """{"reached": [...], "unreached": [...]}: the copies of this generation at this leader's ring
        neighbours (tree.reach_peers) that answer on the data path within REACH_S (their leader's
        listener, announced in the job's store at build), asked at once. What the coordinator reads
        to name the copy cut off (launch/control.Coordinator.cut_off)."""
        from concurrent.futures import ThreadPoolExecutor

        gen, pos = self.gen, self.index
        peers = [self.copies[p] for p in tree.reach_peers(pos, len(self.copies))]
        cut = self._cut()

        def answers(c: int) -> bool:
            if cut:  # fault injection: this copy's data path is cut (its tries fail as they would)
                return False
            try:
                store = self.stores.for_copy(c)
                store.wait([_reach_key(gen, c)], timedelta(seconds=REACH_S))
                host, port = store.get(_reach_key(gen, c)).decode().rsplit(":", 1)
                import socket

                socket.create_connection((host, int(port)), timeout=REACH_S).close()
                return True
            except (OSError, RuntimeError, ValueError, dist.DistError):
                return False
        if not peers:
            return {"reached": [], "unreached": []}
        with ThreadPoolExecutor(max_workers=len(peers), thread_name_prefix="reach") as ex:
            ok = list(ex.map(answers, peers))
        out = {"reached": [c for c, y in zip(peers, ok) if y], "unreached": [c for c, y in zip(peers, ok) if not y]}
        log.info(f"copy {self.copy}, generation {gen} aborted with no copy named: tried its neighbours on the data "
                 f"path: reached {out['reached']}, not {out['unreached']}")
        return out

    def _cut(self) -> bool:
        """fault.kind=cut_copy: this copy is cut off from the others (from cut_from on, its first generation)."""
        return self.cut_from is not None and self.next_step >= self.cut_from

    def finish(self) -> None:
        """The copy is done: say so, so that its connection closing is not read as a loss."""
        self._done = True
        self._gen_changed.set()
        if self.client is not None:
            try:
                self.client.send({"op": "bye", "copy": self.copy, "gen": self.gen})
            except OSError:
                pass
            self.client.close()
        if self.server is not None:
            self.server.close()
        for c in self.parents.values():
            c.close()

    def all_reduce(self, pg, tensor: torch.Tensor) -> None:
        """SUM over one of our groups (they are not in torch's registry: the group's own call); left
        as failed when the coordinator aborts the generation (`_wait`)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        if self._cut():  # fault injection: none of its data reaches the others; it waits, alive, as they do
            if self.reach_server is not None:
                self.reach_server.close()  # its neighbours' tries fail as on a cut path
            return self._wait(_Never())
        self._wait(pg.allreduce([tensor], opts))

    def broadcast_state(self, tensors: list[torch.Tensor], src_index: int) -> None:
        """Every tensor of this position's state from the copy at `src_index` (a newcomer
        receives what a healthy copy holds; the others send or receive the same)."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        opts = dist.BroadcastOptions()
        opts.rootRank = src_index
        self.replica.broadcast([flat], opts).wait()
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()


def _reach_key(gen: int, copy: int) -> str:
    return f"reach/gen{gen}/copy{copy}"


class _Listener:
    """A leader's listener on the data path: a neighbour's connect succeeding is all a try asks."""

    def __init__(self, host: str):
        import socket

        self.sock = socket.create_server((host, 0), backlog=128)
        self.addr = f"{host}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="reach-listen", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        import socket

        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _Never:
    """A collective that never completes (fault.kind=cut_copy): `_wait` leaves it on the abort or the timeout."""

    def wait(self, timeout=None):
        time.sleep(timeout.total_seconds() if timeout is not None else 0.05)
        raise RuntimeError("Operation timed out (injected: fault.kind=cut_copy)")


def _release(box: list) -> None:
    box.clear()  # the last reference: the group's destructor runs here, not on the training thread
    gc.collect()
