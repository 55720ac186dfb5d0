"""Every rejection names the key, the numbers and a fix; problems are collected, not stopped at."""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from orchestrator.rundir import EXIT_REJECTED  # noqa: F401 (the exit statuses live with the launch contract)


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


class ConfigError(PlanError):
    """The configuration could not even be composed (unknown key, option or value).
    `partial` is the config composed without the refused overrides, when there is one."""

    def __init__(self, problems: list[Problem], partial=None):
        super().__init__(problems)
        self.partial = partial




def print_rejection(problems: list[Problem], nothing: str = "launched", stream=None) -> int:
    """The one way a refusal is printed. Returns the exit status to use."""
    stream = stream or sys.stderr
    print(f"\nREJECTED: {len(problems)} problem(s); nothing was {nothing}.", file=stream)
    for p in dict.fromkeys(str(p) for p in problems):  # the same problem once
        print(f"  - {p}", file=stream)
    return EXIT_REJECTED
