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
had, and the plan that wrote it. This is the torch-free half (where saves live,
which is the latest, what a resume may change); train/checkpoint.py writes and reads
the tensors.
"""
from __future__ import annotations

import json
import re

STEP_DIR = re.compile(r"step_(\d{8})$")
MARKER = "COMPLETE"


def fs_of(url: str):
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
    fs, root = fs_of(url)
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
    fs, _ = fs_of(url)
    _, path = fs_of(step_dir(url, step))
    with fs.open(f"{path}/meta.json", "r") as f:
        return json.load(f)


def clean_incomplete(url: str, keep: int | None = None) -> list[int]:
    """Delete interrupted saves, and complete ones beyond the newest `keep`. Returns deleted steps."""
    fs, _ = fs_of(url)
    saves = list_saves(url)
    removed = []
    complete = [s for s, _, ok in saves if ok]
    keep_steps = set(complete[-keep:]) if keep else set(complete)
    for s, path, ok in saves:
        if not ok or s not in keep_steps:
            fs.rm(path, recursive=True)
            removed.append(s)
    return removed


# What a resume may not silently change: every model field (the tensors' meaning) and the
# data stream (batch, sequence, seed). `training.resume.allow` names the ones a run may
# change on purpose (a longer context, a new seed); they are printed and recorded.
BATCH_KEYS = ("training.global_batch", "training.seq_len")
DATA_KEYS = BATCH_KEYS + ("training.seed",)


def _flat(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_keys(meta: dict, model: dict, training: dict) -> dict[str, tuple]:
    """Every resume-relevant key whose value differs: key -> (checkpoint's, this run's)."""
    saved = _flat(meta.get("model", {}), "model.")
    mine = _flat(model, "model.")
    out = {k: (saved.get(k), mine.get(k)) for k in sorted(set(saved) | set(mine))
           if k != "model.name" and saved.get(k) != mine.get(k)}
    for key in DATA_KEYS:
        leaf = key.split(".", 1)[1]
        if leaf in meta.get("training", {}) and meta["training"][leaf] != training.get(leaf):
            out[key] = (meta["training"][leaf], training.get(leaf))
    return out


def compatibility_problems(meta: dict, model: dict, training: dict) -> list[tuple[str, str]]:
    """(key, message) for every way this run cannot resume from a checkpoint's meta."""
    resume = training.get("resume", {})
    allowed = set(resume.get("allow", [])) | (set(BATCH_KEYS) if resume.get("allow_batch_change") else set())
    return [(k, f"the checkpoint at step {meta.get('step')} was written with {k}={old!r} but this run has {new!r}")
            for k, (old, new) in changed_keys(meta, model, training).items() if k not in allowed]
