"""Distributed checkpoints (DCP) on any fsspec URL, resharded on load.

Layout of a checkpoint directory (`training.checkpoint.dir`, default RUN_DIR/checkpoints):

    step_00000004/           one save: DCP shards + .metadata, then meta.json
    step_00000004/COMPLETE   written last, by rank 0, after every rank finished writing

Only a save with COMPLETE is ever loaded ("latest" = the highest complete step);
a directory without it is an interrupted save and is deleted at the next save or
load. Model and optimizer state are logical tensors keyed by the model's own
parameter names (`torch.distributed.checkpoint.state_dict` helpers, optimizer
state flattened so a different PP split loads it), so any TP/PP/DP layout can
load any other's checkpoint. meta.json holds the step to resume at (the data
position: the stream is indexed by step), the model shape and batch the run
had, and the plan that wrote it. The reading side used before launching
(`latest_complete`, `read_meta`) needs no torch.
"""
from __future__ import annotations

import json
import re

STEP_DIR = re.compile(r"step_(\d{8})$")
MARKER = "COMPLETE"


def _fs(url: str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def url_for(setting: str | None, run_dir) -> str:
    """`training.checkpoint.dir`, or RUN_DIR/checkpoints when it is unset."""
    return setting or str(run_dir) + "/checkpoints"


def step_dir(url: str, step: int) -> str:
    return f"{url.rstrip('/')}/step_{step:08d}"


def list_saves(url: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) for every save under `url`, oldest first."""
    fs, root = _fs(url)
    if not fs.exists(root):
        return []
    out = []
    for p in fs.ls(root, detail=False):
        m = STEP_DIR.search(p.rstrip("/"))
        if m:
            out.append((int(m.group(1)), p.rstrip("/"), fs.exists(f"{p.rstrip('/')}/{MARKER}")))
    return sorted(out)


def latest_complete(url: str) -> int | None:
    done = [s for s, _, ok in list_saves(url) if ok]
    return done[-1] if done else None


def read_meta(url: str, step: int) -> dict:
    fs, _ = _fs(url)
    _, path = _fs(step_dir(url, step))
    with fs.open(f"{path}/meta.json", "r") as f:
        return json.load(f)


def clean_incomplete(url: str, keep: int | None = None) -> list[int]:
    """Delete interrupted saves, and complete ones beyond the newest `keep`. Returns deleted steps."""
    fs, _ = _fs(url)
    saves = list_saves(url)
    removed = []
    complete = [s for s, _, ok in saves if ok]
    keep_steps = set(complete[-keep:]) if keep else set(complete)
    for s, path, ok in saves:
        if not ok or s not in keep_steps:
            fs.rm(path, recursive=True)
            removed.append(s)
    return removed


SHAPE_KEYS = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "head_dim", "mlp", "tied_embeddings")


def compatibility_problems(meta: dict, model: dict, training: dict) -> list[tuple[str, str]]:
    """(key, message) for every way this run cannot resume from a checkpoint's meta."""
    out = []
    for k in SHAPE_KEYS:
        if meta["model"].get(k) != model.get(k):
            out.append((f"model.{k}", f"the checkpoint at step {meta['step']} has model.{k}={meta['model'].get(k)!r} "
                                      f"but this run has {model.get(k)!r}"))
    for k in ("global_batch", "seq_len"):
        if meta["training"][k] != training[k] and not training.get("resume", {}).get("allow_batch_change"):
            out.append((f"training.{k}", f"the checkpoint was trained with training.{k}={meta['training'][k]} "
                                         f"but this run has {training[k]}"))
    return out


# ---- the torch side ----------------------------------------------------------------------------
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
    """An asynchronous save in flight: `finish()` waits for every rank, then marks it complete."""

    def __init__(self, future, url: str, step: int, meta: dict, rank: int, keep: int):
        self.future, self.url, self.step, self.meta, self.rank, self.keep = future, url, step, meta, rank, keep

    def finish(self) -> None:
        import torch.distributed as dist

        if self.future is not None:
            self.future.result()
        dist.barrier()
        if self.rank == 0:
            _mark_complete(self.url, self.step, self.meta, self.keep)
        dist.barrier()


def _mark_complete(url: str, step: int, meta: dict, keep: int) -> None:
    fs, p = _fs(step_dir(url, step))
    with fs.open(f"{p}/meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    with fs.open(f"{p}/{MARKER}", "w") as f:
        f.write(str(step))
    clean_incomplete(url, keep=keep)


def save(url: str, step: int, parts, optimizers, meta: dict, rank: int, keep: int, fault_hook=None,
         asynchronous: bool = False, group=None) -> PendingSave:
    """Save collectively; mark complete only after every rank has written. With
    `asynchronous`, the state is staged and written in the background: call
    `finish()` on the result before the next save (the worker does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    path = step_dir(url, step)
    if rank == 0:
        clean_incomplete(url)
    dist.barrier()
    model, optim = state_dicts(parts, optimizers)
    if fault_hook is not None:
        fault_hook()  # fault injection: die in the middle of a save
    if asynchronous:
        # The background save talks on its own process group: sharing the training group
        # from another thread interleaves collectives (gloo aborts on the mismatch).
        future = dcp.async_save({"model": model, "optim": optim}, storage_writer=FsspecWriter(path),
                                process_group=group)
        return PendingSave(future, url, step, meta, rank, keep)
    dcp.save({"model": model, "optim": optim}, storage_writer=FsspecWriter(path))
    pending = PendingSave(None, url, step, meta, rank, keep)
    pending.finish()
    return pending


def load(url: str, step: int, parts, optimizers) -> None:
    """Load a checkpoint written under any layout into this one (DCP reshards on load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optim = state_dicts(parts, optimizers)
    state = {"model": model, "optim": optim}
    dcp.load(state, storage_reader=FsspecReader(step_dir(url, step)))
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for (_, part), opt in zip(parts, optimizers):
        names = set(get_model_state_dict(part, options=_options()).keys())  # wrapper-free names
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names}, options=_options())
        mine = {k: v for k, v in state["optim"].items() if k.split(".", 1)[1].rsplit(".", 1)[0] in names}
        set_optimizer_state_dict(part, opt, mine, options=_options())
