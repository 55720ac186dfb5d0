"""Trainers other than this project's runtime: which stacks each may train, what it refuses
before launch, the command line each rank runs, and where each RANK goes. Torch-free.

- `torchtitan` and `megatron` render the framework's own arguments from the plan
  (frameworks/torchtitan.py, frameworks/megatron.py) after `trainer.command`, then `trainer.args`;
- `command` runs `trainer.command` as it is (a torchrun-compatible program that reads the
  plan through orchestrator.runtime).

Placement: a framework builds its process groups from RANK in its own fixed order; the
launcher gives the rank on each GPU the RANK whose framework coordinates are the plan's
coordinates of that GPU (`rank_map`), so the framework's groups are the plan's groups on the
plan's nodes. `command` and the built-in runtime build their meshes from the plan's explicit
rank grid and keep RANK = the plan's rank.
"""
from __future__ import annotations

import shlex
import unicodedata
from pathlib import Path

from orchestrator.rundir import run_dir_of
from orchestrator.config.errors import Problem
from orchestrator.config.schema import Config, TrainerName
import orchestrator.frameworks.megatron as megatron
import orchestrator.frameworks.torchtitan as torchtitan
from orchestrator.plan.layout import Layout
from orchestrator.plan.topology import RankGrid

FRAMEWORKS = {TrainerName.torchtitan: torchtitan, TrainerName.megatron: megatron}
MAX_WORDS = 4096


def external(spec_or_json) -> bool:
    """True when the ranks run something other than the built-in runtime."""
    return trainer_name(spec_or_json) != TrainerName.orchestrator


def trainer_name(spec_or_json) -> TrainerName:
    if isinstance(spec_or_json, dict):
        return TrainerName(spec_or_json["config"].get("trainer", {}).get("name", "orchestrator"))
    spec = getattr(spec_or_json, "spec", spec_or_json)  # a Plan or its Config
    return spec.trainer.name


def words_problem(key: str, text: str) -> tuple[list[str], Problem | None]:
    """`text` split as shell words (run without a shell): control characters and unbalanced
    quotes are refused, naming the key."""
    bad = sorted({repr(c) for c in text if unicodedata.category(c) == "Cc"})
    if bad:
        return [], Problem(key, f"{text[:80]!r} holds control character(s) {', '.join(bad)}; each rank runs it as "
                                f"shell words without a shell, so a newline or escape cannot be meant.",
                           "write the program and its arguments on one line (a script on the cluster for anything "
                           "more).")
    try:
        words = shlex.split(text)
    except ValueError as e:
        return [], Problem(key, f"{text[:80]!r} does not split into shell words ({e}).",
                           "balance the quotes; it is split with shlex and run without a shell.")
    if not words or len(words) > MAX_WORDS:
        return [], Problem(key, f"must be a program and its arguments (1 to {MAX_WORDS} words), got {len(words)}.",
                           "e.g. trainer.command='python train.py --lr 3e-4'.")
    return words, None


def command_words(spec: Config) -> tuple[list[str], list[str], list[Problem]]:
    """trainer.command and trainer.args as argv words, with every problem in them."""
    t, head, tail, problems = spec.trainer, [], [], []
    if not t.command:
        problems.append(Problem("trainer.command", f"trainer={t.name.value} needs the program each rank runs.",
                                "set trainer.command='python train.py --lr 3e-4' (shell words, no shell)."))
    else:
        words, p = words_problem("trainer.command", t.command)
        head += words
        problems += [p] if p else []
    for i, a in enumerate(t.args):
        words, p = words_problem(f"trainer.args[{i}]", str(a))
        tail += words
        problems += [p] if p else []
    return head, tail, problems


def trainer_problems(spec: Config, layout: Layout) -> list[Problem]:
    """What a launcher refuses before it starts an external trainer."""
    name = spec.trainer.name
    *_, problems = command_words(spec)
    fw = FRAMEWORKS.get(name)
    if fw is not None:
        if spec.stack.name not in fw.STACKS:
            problems.append(Problem("stack, trainer", f"trainer={name.value} trains as {'/'.join(fw.STACKS)} does; "
                                    f"stack={spec.stack.name} plans another framework's run.",
                                    f"drop stack= (trainer={name.value} plans on stack={fw.STACKS[0]}), or use "
                                    f"trainer=command for a program of your own."))
        problems += fw.problems(spec, layout)
        url = spec.training.checkpoint.dir or ""
        if "://" in url and not url.startswith("file://"):  # both frameworks save to a file system path
            problems.append(Problem("training.checkpoint.dir", f"trainer={name.value} saves its checkpoints to a "
                                    f"path, not {url!r}.", "use a path on a shared file system."))
    if name == TrainerName.torchtitan:
        problems += torchtitan.version_problems(spec.trainer.version)
    elif spec.trainer.version is not None:
        problems.append(Problem("trainer.version", f"only trainer=torchtitan renders for a release line; "
                                f"trainer={name.value} has one way.", "unset trainer.version."))
    if spec.trainer.config_file is not None and name != TrainerName.torchtitan:
        problems.append(Problem("trainer.config_file", "is torchtitan's --job.config_file.",
                                "unset it, or put the file in trainer.args."))
    return problems


def release(plan_json: dict, python: str | None = None) -> tuple[str | None, str]:
    """The release line to render for, and how it was chosen: trainer.version if given, else the
    torchtitan installed for `python` (the interpreter that starts the ranks), asked with it;
    the newest line when it cannot tell. (None, '') for trainers without release lines."""
    import subprocess
    import sys

    if trainer_name(plan_json) != TrainerName.torchtitan:
        return None, ""
    given = plan_json["config"].get("trainer", {}).get("version")
    if given:
        return torchtitan.line_of(given), f"trainer.version={given}"
    python = python or sys.executable
    try:
        r = subprocess.run([python, "-c", torchtitan.VERSION_QUERY], capture_output=True, text=True, timeout=120)
        found = r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    if torchtitan.line_of(found) in torchtitan.LINES:
        return torchtitan.line_of(found), f"torchtitan {found} installed for {python}"
    why = f"torchtitan {found} is installed for {python}" if found else f"{python} has no torchtitan here"
    return torchtitan.DEFAULT, f"{why}; rendered for the newest line (set trainer.version to choose)"


def release_problems(plan, python: str | None = None) -> list[Problem]:
    """What the release line the job renders for refuses, found before launch: with trainer.version
    unset the line is the one installed for `python` (the interpreter that starts the ranks),
    asked now as the launch will ask it (validation checked a given trainer.version's line)."""
    if trainer_name(plan) != TrainerName.torchtitan or plan.spec.trainer.version or not plan.valid:
        return []
    pj = plan.to_json()
    line, _ = release(pj, python)
    return torchtitan.LINES[line].problems(plan.spec, _layout(pj), _module_names(pj, plan.spec))


def argv(plan_json: dict, plan_dir: Path, line: str | None = None) -> list[str]:
    """The command line every rank of this attempt runs (the same on every rank), for release
    `line` of the framework (torchtitan: its default line when None)."""
    from orchestrator.config.compose import typed

    spec = typed(plan_json["config"])
    head, tail, problems = command_words(spec)
    fw = FRAMEWORKS.get(spec.trainer.name)
    if fw is torchtitan:
        line = line or torchtitan.line_of(spec.trainer.version) or torchtitan.DEFAULT
        problems += torchtitan.LINES[line].problems(spec, _layout(plan_json), _module_names(plan_json, spec))
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    if fw is torchtitan:
        before, after = torchtitan.render(plan_json, run_dir_of(plan_dir), Path(plan_dir), line)
        return head + before + tail + after
    rendered = fw.render(plan_json, run_dir_of(plan_dir), Path(plan_dir)) if fw is not None else []
    return head + rendered + tail


def env(plan_json: dict) -> dict[str, str | None]:
    """The variables the framework needs in every rank's environment (None: must be unset)."""
    fw = FRAMEWORKS.get(trainer_name(plan_json))
    return fw.env(plan_json) if fw is not None else {}


def _layout(plan_json: dict):
    """What a release line's problems read of the layout (ep, etp, pp, cp)."""
    from types import SimpleNamespace

    return SimpleNamespace(**{k: plan_json["layout"][k] for k in ("ep", "etp", "pp", "cp")})


def _module_names(plan_json: dict, spec: Config) -> bool:
    return torchtitan.module_parts(plan_json) is not None


def files(plan_json: dict, line: str | None = None) -> dict[str, str]:
    """name -> text of the files this attempt's command line names (written beside its plan)."""
    fw = FRAMEWORKS.get(trainer_name(plan_json))
    if fw is torchtitan:
        return fw.files(plan_json, line or torchtitan.line_of(plan_json["config"]["trainer"].get("version"))
                        or torchtitan.DEFAULT)
    return fw.files(plan_json) if fw is not None else {}


def rank_map(plan_json: dict) -> list[int]:
    """RANK for the GPU at each position (node * gpus_per_node + local index): the framework's
    rank whose coordinates in the framework's own order are the plan's at that position."""
    grid = RankGrid(plan_json["ranks"]["sizes"], plan_json["ranks"]["order"])
    fw = FRAMEWORKS.get(trainer_name(plan_json))
    if fw is None:
        return list(range(grid.world))
    return [fw.framework_rank(grid.coords(p), plan_json) for p in range(grid.world)]


def placement_problems(plan) -> list[Problem]:
    """A framework's expert-parallel groups must be the plan's too: its dense groups are made
    the plan's by rank_map, and its expert groups follow from the same RANKs."""
    fw = FRAMEWORKS.get(trainer_name(plan))
    if fw is None or plan.layout is None or plan.layout.ep == 1 or not plan.valid:
        return []
    pj = plan.to_json()
    pos = {r: p for p, r in enumerate(rank_map(pj))}
    if fw is torchtitan:  # the line asked for, else every line (the installed one is asked at launch)
        lines = [torchtitan.line_of(plan.spec.trainer.version)] if plan.spec.trainer.version else list(fw.LINES)
        theirs = {frozenset(pos[r] for r in g) for line in lines for g in fw.expert_groups(pj, line)}
    else:
        theirs = {frozenset(pos[r] for r in g) for g in fw.expert_groups(pj)}
    if theirs == {frozenset(g) for g in plan.expert_grid().groups("ep").tolist()}:
        return []
    return [Problem("layout.order, layout.ep", f"with the plan's order {'-'.join(plan.order)}, "
                    f"{trainer_name(plan).value} would build expert-parallel groups other than the plan's (it "
                    f"carves them from its own rank order).", "use layout.order=auto, or an order with ep "
                    "inside dp and pp outermost (e.g. layout.order=tp-cp-ep-dp-pp).")]
