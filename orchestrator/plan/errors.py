"""The planner's own error: every problem names the key, the numbers and a fix."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Problem:
    key: str  # the config key(s) at fault, e.g. "layout.dp" or "layout.tp, model.heads"
    message: str  # what is wrong, with the numbers
    fix: str = ""  # what to do

    def __str__(self) -> str:
        return f"[{self.key}] {self.message}" + (f" Fix: {self.fix}" if self.fix else "")

    def to_dict(self) -> dict:
        return asdict(self)


class PlanError(Exception):
    """A configuration that cannot run. Carries every problem found, not only the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = [f"{len(self.problems)} problem(s) with this configuration:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))
