"""Distributed checkpoints (DCP) on any fsspec URL, resharded on load.

Layout of a checkpoint directory (`training.checkpoint.dir`, default RUN_DIR/checkpoints):

    step_00000004/               one save: DCP shards + .metadata, then
    step_00000004/files.json     every file's size and SHA-256 (each rank hashes what it wrote),
    step_00000004/meta.json      the data position, RNG state, model, batch and plan, and
    step_00000004/COMPLETE       written last, by rank 0, after every rank finished writing
    step_00000004/DAMAGED        (only if a load found a file missing or altered: why)

Only a save with COMPLETE and without DAMAGED is ever loaded ("latest" = the highest
complete step), and only after its files match files.json (saves written before it was named
so hold the same list as manifest.json, read alike); a damaged one is marked,
kept for inspection and skipped. A directory without COMPLETE is an interrupted save and
is deleted at the next save or load. Model and optimizer state are logical tensors keyed by the model's own
parameter names (`torch.distributed.checkpoint.state_dict` helpers, optimizer
state flattened so a different PP split loads it), so any TP/PP/DP layout can
load any other's checkpoint. meta.json holds the step to resume at (the data
position: the stream is indexed by step), the model shape and batch the run
had, and the plan that wrote it. This is the torch-free half (where saves live,
which is the latest, what a resume may change); train/checkpoint.py writes and reads
the tensors.
"""
from __future__ import annotations

import hashlib
import json
import re

from orchestrator import rundir

STEP_DIR = re.compile(r"step_(\d{8})$")
MARKER = "COMPLETE"
DAMAGED = "DAMAGED"
FILES_JSON = "files.json"  # the save's file list (the run's manifest.json is rundir.RUN_MANIFEST)
OLD_FILES_JSON = "manifest.json"  # the same list in saves written before it was renamed
SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's data files: __<writing rank>_<n>.distcp


def fs_of(url: str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def url_for(setting: str | None, run_dir) -> str:
    """`training.checkpoint.dir`, or RUN_DIR/checkpoints when it is unset."""
    return setting or f"{run_dir}/{rundir.CHECKPOINTS}"


def step_dir(url: str, step: int) -> str:
    return f"{url.rstrip('/')}/step_{step:08d}"


def saves(url: str) -> list[tuple[int, str, str]]:
    """(step, path, state) for every save under `url`, oldest first; state is
    "complete", "damaged" or "incomplete"."""
    fs, root = fs_of(url)
    if not fs.exists(root):
        return []
    out = []
    for p in fs.ls(root, detail=False):
        p = p.rstrip("/")
        m = STEP_DIR.search(p)
        if m:
            names = {n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False)}
            state = "damaged" if DAMAGED in names else "complete" if MARKER in names else "incomplete"
            out.append((int(m.group(1)), p, state))
    return sorted(out)


def list_saves(url: str) -> list[tuple[int, str, bool]]:
    """(step, path, loadable) for every save under `url`, oldest first."""
    return [(s, p, state == "complete") for s, p, state in saves(url)]


def complete_steps(url: str) -> list[int]:
    """Steps of complete, undamaged saves, newest first."""
    return [s for s, _, state in reversed(saves(url)) if state == "complete"]


def latest_complete(url: str) -> int | None:
    done = complete_steps(url)
    return done[0] if done else None


def read_meta(url: str, step: int) -> dict:
    fs, path = fs_of(step_dir(url, step))
    with fs.open(f"{path}/meta.json", "r") as f:
        return json.load(f)


def file_digest(fs, path: str) -> dict:
    """Size and SHA-256 of one file, read in 8 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def digest_own_files(url: str, step: int, rank: int | None) -> dict:
    """The digests of the files one rank wrote (its DCP shards), or with rank None of the
    files no rank owns (.metadata)."""
    fs, path = fs_of(step_dir(url, step))
    out = {}
    for p in fs.ls(path, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        m = SHARD.match(name)
        if (m and rank is not None and int(m.group(1)) == rank) or (m is None and rank is None and name == ".metadata"):
            out[name] = file_digest(fs, f"{path}/{name}")
    return out


def write_file_list(url: str, step: int, files: dict) -> None:
    fs, path = fs_of(step_dir(url, step))
    with fs.open(f"{path}/{FILES_JSON}", "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1, sort_keys=True)


def verify(url: str, step: int, part: int = 0, parts: int = 1) -> list[str]:
    """What is wrong with a save: its meta.json, its file list, and every part-th file of the
    list (size and SHA-256), so `parts` ranks can share the reading. [] = intact."""
    fs, path = fs_of(step_dir(url, step))
    try:
        listed = f"{path}/{FILES_JSON}"
        if not fs.exists(listed) and fs.exists(f"{path}/{OLD_FILES_JSON}"):
            listed = f"{path}/{OLD_FILES_JSON}"
        with fs.open(listed, "r") as f:
            files = json.load(f)["files"]
        if part == 0:
            read_meta(url, step)
    except Exception as e:  # a missing or unreadable file list or meta.json
        return [f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} ({FILES_JSON} or meta.json)"]
    out = []
    for i, (name, want) in enumerate(sorted(files.items())):
        if i % parts != part:
            continue
        try:
            got = file_digest(fs, f"{path}/{name}")
        except (OSError, FileNotFoundError) as e:
            out.append(f"{name}: missing ({type(e).__name__})")
            continue
        if got["bytes"] != want["bytes"]:
            out.append(f"{name}: {got['bytes']} bytes, {FILES_JSON} says {want['bytes']}")
        elif got["sha256"] != want["sha256"]:
            out.append(f"{name}: its contents changed (SHA-256 differs from {FILES_JSON})")
    return out


def mark_damaged(url: str, step: int, problems: list[str]) -> None:
    """Keep a damaged save for inspection, out of every "latest" from now on."""
    fs, path = fs_of(step_dir(url, step))
    with fs.open(f"{path}/{DAMAGED}", "w") as f:
        f.write("\n".join(problems) + "\n")


def clean_incomplete(url: str, keep: int | None = None) -> list[int]:
    """Delete interrupted saves, and complete ones beyond the newest `keep` (damaged saves are
    kept for inspection and do not count). Returns the deleted steps."""
    fs, _ = fs_of(url)
    found = saves(url)
    removed = []
    complete = [s for s, _, state in found if state == "complete"]
    keep_steps = set(complete[-keep:]) if keep else set(complete)
    for s, path, state in found:
        if state == "incomplete" or (state == "complete" and s not in keep_steps):
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
