"""What crosses the copies of the model state, owned by the runtime so a lost copy can be
dropped in place (layout.dp_shard < dp; launch/control.py is the other side).

Each copy trains in its own torch world (its FSDP, TP, CP and PP groups never span
copies). Per generation the copies build two kinds of gloo groups straight over the job's
rendezvous store, outside torch's registry: `live` (every rank of every copy: loss and
stop flag) and `replica` (the ranks at the same position in every copy: gradient
averaging, and the state a newcomer receives). When a collective on them fails, the
groups are dropped (references released and collected, so their sockets close and the
other survivors fail fast instead of waiting for the timeout) and the copy's leader asks
the coordinator what the next generation is.
"""
from __future__ import annotations

import gc
import json
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def connect_store(addr: str, timeout_s: float = 120.0) -> dist.TCPStore:
    """A client of the job's store; retried with a short connect timeout (a client that
    starts its connect before the server listens can otherwise hang for the whole timeout)."""
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=1))
            store.set_timeout(timedelta(seconds=timeout_s))
            return store
        except (RuntimeError, dist.DistError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Replicas:
    def __init__(self, store: dist.TCPStore, control: str | None, copy: int, local_rank: int, copy_size: int,
                 timeout_s: float, copies: list[int]):
        self.store, self.copy, self.local, self.size = store, copy, local_rank, copy_size
        self.timeout = timedelta(seconds=timeout_s)
        self.gen, self.copies = -1, list(copies)
        self.live = self.replica = None
        self.sock = self.rfile = None
        if control and local_rank == 0:  # the copy's leader speaks for it
            host, port = control.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=None)
            self.rfile = self.sock.makefile("r")

    @property
    def index(self) -> int:
        """This copy's place in the data order of the current generation."""
        return self.copies.index(self.copy)

    def build(self, gen: int, copies: list[int]) -> None:
        """The groups of generation `gen` over `copies` (every member calls this)."""
        self.drop()
        self.gen, self.copies = gen, list(copies)
        n = len(self.copies)
        live = dist.PrefixStore(f"gen{gen}/live", self.store)
        self.live = dist.ProcessGroupGloo(live, self.index * self.size + self.local, n * self.size, self.timeout)
        rep = dist.PrefixStore(f"gen{gen}/replica{self.local}", self.store)
        self.replica = dist.ProcessGroupGloo(rep, self.index, n, self.timeout)

    def drop(self) -> None:
        """Release this generation's groups now: their sockets close, and peers blocked on them
        fail at once instead of after the timeout."""
        self.live = self.replica = None
        gc.collect()

    def ask(self, msg: dict) -> dict:
        """The leader asks the coordinator; every rank of the copy gets the same answer."""
        box = [None]
        if self.sock is not None:
            self.sock.sendall((json.dumps({**msg, "copy": self.copy, "gen": self.gen}) + "\n").encode())
            line = self.rfile.readline()
            box[0] = json.loads(line) if line else {"op": "exit", "reason": "the coordinator went away"}
        dist.broadcast_object_list(box, src=0)  # inside the copy's own world
        return box[0]

    @staticmethod
    def all_reduce(pg, tensor: torch.Tensor) -> None:
        """SUM over one of our groups (they are not in torch's registry: the group's own call)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        pg.allreduce([tensor], opts).wait()

    def agree(self, ok: bool) -> bool:
        """Did every rank of this copy get through the cross-copy collectives?"""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

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
