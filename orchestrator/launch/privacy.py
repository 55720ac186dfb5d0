"""Who may read and change a run: its owner only, by default.

The run directory, its plans, manifests, logs, checkpoints and the job's control secret
are created owner-only (umask 077 for the orchestrate process and every rank it starts;
the directory itself 0700). `launcher.group_readable=true` lets the group read (umask
027, directory 0750), never write. A run directory or a local checkpoint directory
that belongs to another user is refused (someone else's files would be trusted as this
run's plan, code and weights) unless `launcher.allow_other_owner=true` says so.
"""
from __future__ import annotations

import os
from pathlib import Path

from orchestrator import rundir
from orchestrator.config.errors import Problem


def owner_only(run_dir: Path, group_readable: bool) -> None:
    """From now on this process and its children create owner-only (or group-readable) files."""
    os.umask(0o027 if group_readable else 0o077)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if run_dir.stat().st_uid == os.getuid():
        os.chmod(run_dir, 0o750 if group_readable else 0o700)


def other_owner(run_dir: Path, checkpoint_dir: str | None, allow: bool) -> list[Problem]:
    """A run directory or local checkpoint directory owned by someone else: refused unless allowed."""
    if allow:
        return []
    out = []
    ckpt = Path(run_dir) / rundir.CHECKPOINTS if not checkpoint_dir else Path(checkpoint_dir.removeprefix("file://"))
    if checkpoint_dir and "://" in checkpoint_dir.removeprefix("file://"):
        ckpt = None  # an object store: its own access control applies
    for what, path in (("run directory", Path(run_dir)), ("checkpoint directory", ckpt)):
        if path is None or not path.exists():
            continue
        uid = path.stat().st_uid
        if uid != os.getuid():
            out.append(Problem("launcher.allow_other_owner",
                               f"the {what} {path} belongs to user id {uid}, not to you ({os.getuid()}): its plan, "
                               f"code and checkpoints would be trusted as this run's",
                               "resume your own copy of it, or set launcher.allow_other_owner=true if you trust it"))
    return out
