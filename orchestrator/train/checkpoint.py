"""Distributed checkpoints (DCP) on any fsspec URL, resharded on load: the torch side.

Where saves live, which one is the latest and what a resume may change is the
torch-free half in rundir/checkpoints.py.
"""
from __future__ import annotations

import json

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optim = state_dicts(parts, optimizers)
    state = {"model": model, "optim": optim}
    dcp.load(state, storage_reader=FsspecReader(saves.step_dir(url, step)))
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for (_, part), opt in zip(parts, optimizers):
        names = set(get_model_state_dict(part, options=_options()).keys())  # wrapper-free names
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names}, options=_options())
        mine = {k: v for k, v in state["optim"].items() if k.split(".", 1)[1].rsplit(".", 1)[0] in names}
        set_optimizer_state_dict(part, opt, mine, options=_options())
