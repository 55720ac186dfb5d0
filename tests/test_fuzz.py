"""Nothing breaks the planner: hostile values anywhere give a plan or the project's own
rejection (key, message, fix), never an exception, a hang or a nonsense plan marked valid; and
nothing typed on a command line ends in a traceback. benchmarks/fuzz_plans.py runs the same
checks on 10,000 configurations, through Hydra's compose and on hundreds of command lines."""
import dataclasses
import os
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from fuzz_plans import BASES, KINDS, fuzz_typed, leaf_keys, sane  # noqa: E402

from orchestrator import compose, make_plan  # noqa: E402
from orchestrator.config.compose import typed  # noqa: E402
from orchestrator.config.schema import Config  # noqa: E402

KEYS = [k for k, _ in leaf_keys(Config)]
BASE_CONFIGS = [typed(compose(b)) for b in BASES]
HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 8, 1000, 10**12, 2**63 - 1, -(2**31)]), st.integers(-10, 10**7),
    st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-300, 1e300, 0.5]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "???", "${nope}", "auto", "x" * 300, "a\nb", "$(reboot)", "gpipe", "full", "tp-cp-ep-dp-pp"]),
    st.sampled_from([None, True, False, [], [1, 2], ["tp", "dp"], {"a": 1}]),
)


def _with(cfg: Config, dotted: str, value) -> Config:
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    child = getattr(cfg, head)
    if not dataclasses.is_dataclass(child):
        return cfg
    return dataclasses.replace(cfg, **{head: _with(child, rest, value)})


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(range(len(BASES))), changes=st.dictionaries(st.sampled_from(KEYS), HOSTILE, min_size=1,
                                                                       max_size=5))
def test_hostile_values_never_break_the_planner(base, changes):
    cfg = BASE_CONFIGS[base]
    for key, value in changes.items():
        cfg = _with(cfg, key, value)
    plan = make_plan(cfg)  # must not raise; how long it takes is benchmarks/fuzz_plans.py's to say
    assert sane(plan) == [], changes


def test_typed_command_lines_end_in_a_documented_exit_status(tmp_path):
    """A sample of fuzz_plans' command lines, every kind in turn: hostile overrides, the sweep
    grammar, the trainer keys, cluster.nodelist/topology, paths the file system cannot hold, and
    orchestrate-runs on foreign and damaged run directories (cancel must leave others' processes be)."""
    import random

    found = fuzz_typed(2 * len(KINDS), random.Random(0), tmp_path, round_robin=True)
    assert found["tracebacks"] == [] and found["timeouts"] == [], found["tracebacks"][:3] + found["timeouts"][:3]
    assert set(found["kinds"]) == set(KINDS)


def test_paths_the_file_system_cannot_hold_are_refused_naming_the_key(tmp_path):
    """A name longer than the file system allows (NAME_MAX, 255 bytes here) in a run, sweep or
    checkpoint path, or in a run directory given to orchestrate-runs: exit 2 naming the key."""
    from conftest import run_cli_here
    from fuzz_plans import run_in_process

    long = tmp_path / ("x" * 300)
    tiny = ["hardware=cpu", "model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=2", "figures=false"]
    for key, args in (("training.checkpoint.dir", [f"training.checkpoint.dir={long}"]),
                      ("training.checkpoint.dir", ["launcher=local", "training.checkpoint.every=2",
                                                   f"training.checkpoint.dir=file://{long}"]),
                      ("hydra.run.dir", [f"hydra.run.dir={long}"]), ("hydra.sweep.dir", ["-m", f"hydra.sweep.dir={long}"]),
                      ("hydra.run.dir", ["hydra.run.dir=''"])):
        r = run_cli_here([*tiny, *args], tmp_path / "x")
        assert r.returncode == 2 and f"[{key}]" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-800:])
    assert not os.path.exists(long)  # (Path.exists raises on a name this long)
    for args in (["status", str(long)], ["list", "--root", str(long)]):
        code, text = run_in_process("orchestrate-runs", args)
        assert code == 2 and "is 300 bytes long" in text and "Traceback" not in text, (args, text[-800:])
