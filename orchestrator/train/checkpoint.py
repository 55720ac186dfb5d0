"""Distributed checkpoints (DCP) on any fsspec URL, resharded on load: the torch side.

Where saves live, which one is the latest and what a resume may change is the
torch-free half in rundir/checkpoints.py.
"""
from __future__ import annotations

import json
import os

from orchestrator.rundir import checkpoints as saves


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_dicts(parts, optimizers) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optim = {}, {}
    for (_, part), opt in zip(parts, optimizers):
        model.update(get_model_state_dict(part, options=_options()))
        optim.update(get_optimizer_state_dict(part, opt, options=_options()))
    return model, optim


class PendingSave:
    """A save in flight: `finish()` waits for every rank, has each hash the files it wrote,
    and then (rank 0) writes files.json, meta.json and COMPLETE, in that order."""

    def __init__(self, future, url: str, step: int, meta: dict, rank: int, keep: int, group=None):
        self.future, self.url, self.step, self.meta, self.rank, self.keep = future, url, step, meta, rank, keep
        self.group = group  # the ranks that coordinate (None: every rank of the job)

    def finish(self) -> None:
        import torch.distributed as dist

        if self.future is not None:
            self.future.result()
        dist.barrier(group=self.group)
        mine = saves.digest_own_files(self.url, self.step, self.rank)
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if self.rank == 0:
            files = {k: v for part in everyone for k, v in part.items()}
            files.update(saves.digest_own_files(self.url, self.step, None))
            saves.write_file_list(self.url, self.step, files)
            _mark_complete(self.url, self.step, self.meta, self.keep)
        dist.barrier(group=self.group)


def _mark_complete(url: str, step: int, meta: dict, keep: int) -> None:
    fs, p = saves.fs_of(saves.step_dir(url, step))
    with fs.open(f"{p}/meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    with fs.open(f"{p}/{saves.MARKER}", "w") as f:
        f.write(str(step))
    saves.clean_incomplete(url, keep=keep)


def save(url: str, step: int, parts, optimizers, meta: dict, rank: int, keep: int, fault_hook=None,
         asynchronous: bool = False, group=None) -> PendingSave:
    """Save collectively; mark complete only after every rank has written. With
    `asynchronous`, the state is staged and written in the background: call
    `finish()` on the result before the next save (the worker does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    path = saves.step_dir(url, step)
    if rank == 0:
        saves.clean_incomplete(url)
    dist.barrier()
    model, optim = state_dicts(parts, optimizers)
    if fault_hook is not None:
        fault_hook()  # fault injection: die in the middle of a save
    if asynchronous:
        # The background save talks on its own process group: sharing the training group
        # from another thread interleaves collectives (gloo aborts on the mismatch).
        future = dcp.async_save({"model": model, "optim": optim}, storage_writer=FsspecWriter(path),
                                process_group=group)
        return PendingSave(future, url, step, meta, rank, keep, group)
    dcp.save({"model": model, "optim": optim}, storage_writer=FsspecWriter(path))
    pending = PendingSave(None, url, step, meta, rank, keep)
    pending.finish()
    return pending


def load_intact(url: str, parts, optimizers, on_damaged=None) -> int | None:
    """Load the newest complete save whose files match its files.json (every rank checks a share
    of them); a damaged one is marked, reported through `on_damaged(step, problems)` and
    skipped. Returns the step loaded, or None when there is no intact save."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for step in saves.complete_steps(url):
        mine = saves.verify(url, step, part=rank, parts=world)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        problems = [p for part in everyone for p in part]
        if problems:
            if rank == 0:
                saves.mark_damaged(url, step, problems)
                if on_damaged is not None:
                    on_damaged(step, problems)
            dist.barrier()
            continue
        load(url, step, parts, optimizers)
        return step
    return None


def load(url: str, step: int, parts, optimizers) -> None:
    """Load a checkpoint written under any layout into this one (DCP reshards on load)."""
    load_dir(saves.step_dir(url, step), parts, optimizers)


def load_dir(path: str, parts, optimizers) -> None:
    """Load the DCP save at `path` (any fsspec URL: a checkpoint's step directory, or a snapshot
    fetched into this process's memory) into this layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optim = state_dicts(parts, optimizers)
    state = {"model": model, "optim": optim}
    dcp.load(state, storage_reader=FsspecReader(path))
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for (_, part), opt in zip(parts, optimizers):
        names = set(get_model_state_dict(part, options=_options()).keys())  # wrapper-free names
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names}, options=_options())
        mine = {k: v for k, v in state["optim"].items() if k.split(".", 1)[1].rsplit(".", 1)[0] in names}
        set_optimizer_state_dict(part, opt, mine, options=_options())


# ---- snapshots in a peer node's host memory (train/keeper.py) ------------------------------------
SNAPSHOT_META = "snapshot_meta.json"  # rank 0's: what a checkpoint's meta.json holds (data position, RNG)
MEMORY = "memory://orchestrator-snapshots"  # this process's fsspec memory file system


class PendingSnapshot:
    """A snapshot in flight: DCP writes this rank's shard into this process's memory (staged, then
    written on a background thread with its own process group), then the files go to the keepers.
    `finish()` waits for it; what went wrong is said, never raised (the file system still holds
    the run)."""

    def __init__(self, step: int, staged_s: float, thread):
        self.step, self.staged_s, self.thread = step, staged_s, thread
        self.error: str | None = None
        self.held = 0  # keepers that took it (when `error`: fewer than asked)
        self.sent_s = 0.0

    def finish(self) -> "PendingSnapshot":
        self.thread.join()
        return self


def snapshot(step: int, parts, optimizers, meta: dict, rank: int, world: int, group, keepers: list, key: bytes,
             attempt: int = 0) -> PendingSnapshot:
    """Stage this rank's state (a CPU copy) and, in the background, write it with DCP into memory
    and hand the files to `keepers` (its own node's and its buddy's: keeper.buddies)."""
    import threading
    import time

    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from orchestrator.train.keeper import Client

    path = f"{MEMORY}/{os.getpid()}/step_{step}"
    t0 = time.perf_counter()
    model, optim = state_dicts(parts, optimizers)
    future = dcp.async_save({"model": model, "optim": optim}, storage_writer=FsspecWriter(path, sync_files=False),
                            process_group=group)
    pending = PendingSnapshot(step, time.perf_counter() - t0, None)

    def send():
        t1 = time.perf_counter()
        fs = fsspec.filesystem("memory")
        try:
            future.result()
            files = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(path)}
            if rank == 0:
                files[SNAPSHOT_META] = json.dumps(meta).encode()
            failed = []
            for addr in keepers:  # each on its own: one keeper gone (its node lost) leaves the other's copy
                try:
                    Client(addr, key).put(step, rank, world, files, attempt)
                except Exception as e:  # noqa: BLE001 - said below
                    failed.append(f"{addr}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if failed:
                pending.error = (f"{'no keeper' if len(failed) == len(keepers) else 'not every keeper'} took it "
                                 f"({'; '.join(failed)})")
                pending.held = len(keepers) - len(failed)
        except Exception as e:  # noqa: BLE001 - any failure leaves this snapshot incomplete; said by finish's caller
            pending.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            pending.held = 0
        finally:
            drop_memory(path)
            pending.sent_s = time.perf_counter() - t1

    pending.thread = threading.Thread(target=send, name=f"snapshot-{step}", daemon=True)
    pending.thread.start()
    return pending


def fetch_snapshot(point: dict, key: bytes) -> tuple[str, dict]:
    """Every rank's files of the snapshot `point` (keeper.restore_point) from the keepers holding
    them, into this process's memory: (the DCP path to load, rank 0's meta). Raises OSError (or
    the keeper's wire.Refused) when a keeper does not give a rank's files."""
    import fsspec

    from orchestrator.train.keeper import Client

    fs = fsspec.filesystem("memory")
    path = f"{MEMORY}/{os.getpid()}/restore_{point['step']}"
    drop_memory(path)
    meta = None
    try:
        for r in range(int(point["world"])):
            errors = []
            for addr in point["holders"][str(r)]:
                try:
                    files = Client(addr, key).get(int(point["step"]), r)
                    break
                except Exception as e:  # noqa: BLE001 - try the other holder
                    errors.append(f"{addr}: {type(e).__name__}: {e}")
            else:
                raise OSError(f"rank {r}'s snapshot of step {point['step']}: " + "; ".join(errors))
            for name, data in files.items():
                if name == SNAPSHOT_META:
                    meta = json.loads(data)
                else:
                    fs.pipe_file(f"{path}/{name}", data)
        if meta is None:
            raise OSError(f"the snapshot of step {point['step']} holds no {SNAPSHOT_META}")
    except BaseException:
        drop_memory(path)  # nothing half-fetched stays in memory
        raise
    return path, meta


def drop_memory(path: str) -> None:
    """Free what this process holds in memory at `path` (a snapshot written or fetched)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)
