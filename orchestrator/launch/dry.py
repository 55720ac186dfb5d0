"""launcher=dry: plan only. Nothing is started; the plan and its pictures are the result."""
from __future__ import annotations

from orchestrator.launch.base import Launcher


class DryLauncher(Launcher):
    def preflight(self):
        return []  # nothing will run: fault, checkpoint and resume settings do not matter yet

    def submit(self) -> int:
        return 0
