"""Fuzz the planner with hostile configurations and print what it found.

1. N configurations (default 10,000): a real base config (tiny on CPU, Llama 3 405B,
   DeepSeek-V3, Megatron 1T) with 1-6 keys set to hostile values (zero, negative, huge,
   NaN, inf, 1e-300, strings, '???', interpolations, lists, null), planned through
   the typed schema and `make_plan` (the same merge and validation Hydra's compose does).
2. A sample (default 300) through Hydra's own compose + make_plan, with overrides as a
   user would type them.
3. A sample (default 30) through the CLI in a new process: exit 0 or 2, never a traceback.

Counts exceptions (any, for (1) and (2) `make_plan` must not raise), hangs (a plan over
one second of CPU: the figure does not depend on what else the machine runs), and nonsense
plans marked valid (`sane` below). Run:
    .venv/bin/python benchmarks/fuzz_plans.py [--n 10000] [--compose 300] [--cli 30] [--seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASES = (["hardware=cpu", "model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4"], ["recipe=llama3_405b"],
         ["recipe=deepseek_v3"], ["recipe=megatron_1t"], ["recipe=llama3_405b", "layout=auto"])
INTS = (0, -1, 1, 2, 3, 7, 8, 64, 1000, 10**6, 10**12, 2**63 - 1, -(2**31))
FLOATS = (0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-300, 1e300, 0.5, 1.5, 2.0)
STRINGS = ("", "???", "${nope}", "auto", "x" * 300, "a\nb", "$(reboot)", "../..")


def leaf_keys(cls, prefix: str = "") -> list[tuple[str, type]]:
    """Every leaf key of the schema with its type (the launcher's keys are launcher-specific)."""
    import typing

    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += leaf_keys(t, f"{prefix}{f.name}.")
        elif typing.get_origin(t) is typing.Union and dataclasses.is_dataclass(typing.get_args(t)[0]):
            out += leaf_keys(typing.get_args(t)[0], f"{prefix}{f.name}.")
        elif f.name != "launcher":
            out.append((f"{prefix}{f.name}", t))
    return out


def hostile(rng: random.Random, t) -> object:
    r = rng.random()
    if r < 0.35:
        return rng.choice(INTS)
    if r < 0.65:
        return rng.choice(FLOATS)
    if r < 0.8:
        return rng.choice(STRINGS)
    if r < 0.9:
        return rng.choice([None, True, False, [], [1, 2], {"a": 1}])
    return rng.randint(1, 64)


def set_key(d: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for p in path:
        d = d.setdefault(p, {}) if isinstance(d.get(p), dict) or p not in d else d[p]
        if not isinstance(d, dict):
            return
    d[last] = value


def sane(plan) -> list[str]:
    """What would make a plan marked valid nonsense: every figure finite and in range."""
    if not plan.valid:
        return [] if plan.errors and all(e.key and e.message and e.fix for e in plan.errors) else [
            f"rejected without key, message and fix: {plan.errors}"]
    bad = []
    d, st, mem, hw = plan.layout, plan.step, plan.memory, plan.spec.hardware
    nums = {"total_s": st.total_s, "wall_s": st.wall_s, "mfu": plan.mfu, "hfu": plan.hfu,
            "tokens_per_s": plan.tokens_per_s, "per_gpu_bytes": mem.per_gpu_bytes,
            **{f"step.{k}": v for k, v in st.to_json().items()}}
    bad += [f"{k}={v} is not finite" for k, v in nums.items() if not math.isfinite(v)]
    if not st.total_s > 0 or not 0 < plan.mfu <= 1 or not 0 < plan.hfu <= 1:
        bad.append(f"step {st.total_s}, MFU {plan.mfu}, HFU {plan.hfu} out of range")
    if not mem.fits or mem.per_gpu_bytes <= 0:
        bad.append(f"memory {mem.per_gpu_bytes} of {mem.capacity_bytes} marked valid")
    if d.tp * d.cp * d.pp * d.dp != plan.world_size:
        bad.append(f"degrees {d.label()} do not multiply to {plan.world_size}")
    if plan.tflops_per_gpu > hw.peak_tflops:
        bad.append(f"{plan.tflops_per_gpu} TFLOP/s above the peak {hw.peak_tflops}")
    return bad


def check(plan, seconds: float) -> list[str]:
    out = sane(plan)
    if seconds > 1.0:
        out.append(f"took {seconds:.2f} s")
    return out


def fuzz_dicts(n: int, rng: random.Random) -> dict:
    from orchestrator import compose, make_plan
    from orchestrator.config.compose import to_dict, typed
    from orchestrator.config.schema import Config

    keys = leaf_keys(Config)
    bases = [to_dict(typed(compose(b))) for b in BASES]
    found = {"configs": 0, "exceptions": [], "hangs": [], "nonsense": [], "valid": 0, "slowest_s": 0.0}
    for i in range(n):
        cfg = _copy(rng.choice(bases))
        changes = {k: hostile(rng, t) for k, t in rng.sample(keys, rng.randint(1, 6))}
        for k, v in changes.items():
            set_key(cfg, k, v)
        t0 = time.process_time()
        try:
            plan = make_plan(cfg)
        except Exception as e:  # the contract: never
            found["exceptions"].append((changes, f"{type(e).__name__}: {e}"))
            continue
        dt = time.process_time() - t0
        found["configs"] += 1
        found["slowest_s"] = max(found["slowest_s"], dt)
        found["valid"] += plan.valid
        for problem in check(plan, dt):
            (found["hangs"] if problem.startswith("took") else found["nonsense"]).append((changes, problem))
    return found


def _copy(d):
    import copy

    return copy.deepcopy(d)


def hostile_override(rng: random.Random, keys) -> str:
    key, _ = rng.choice(keys)
    v = hostile(rng, None)
    text = {None: "null", True: "true", False: "false"}.get(v, None) if not isinstance(v, (list, dict)) else None
    if text is None:
        text = "[1,2]" if isinstance(v, list) else str(v).replace("\n", "")
    return f"{key}={text}" if rng.random() < 0.9 else f"+{key}x={text}"


def fuzz_compose(n: int, rng: random.Random) -> dict:
    from orchestrator import compose, make_plan
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.schema import Config

    keys = leaf_keys(Config)
    found = {"configs": 0, "rejected_at_compose": 0, "exceptions": [], "hangs": [], "nonsense": [], "valid": 0}
    for _ in range(n):
        overrides = rng.choice(BASES) + [hostile_override(rng, keys) for _ in range(rng.randint(1, 4))]
        try:
            cfg = compose(overrides)
        except ConfigError as e:
            found["rejected_at_compose"] += 1
            if not all(p.key and p.message and p.fix for p in e.problems):
                found["nonsense"].append((overrides, f"compose problem without key, message or fix: {e.problems}"))
            continue
        except Exception as e:
            found["exceptions"].append((overrides, f"compose raised {type(e).__name__}: {e}"))
            continue
        t0 = time.process_time()
        try:
            plan = make_plan(cfg)
        except Exception as e:
            found["exceptions"].append((overrides, f"{type(e).__name__}: {e}"))
            continue
        found["configs"] += 1
        found["valid"] += plan.valid
        for problem in check(plan, time.process_time() - t0):
            (found["hangs"] if problem.startswith("took") else found["nonsense"]).append((overrides, problem))
    return found


def fuzz_cli(n: int, rng: random.Random, tmp: Path) -> dict:
    from orchestrator.config.schema import Config

    keys = leaf_keys(Config)
    found = {"runs": 0, "exit_codes": {}, "tracebacks": [], "timeouts": []}
    for i in range(n):
        overrides = rng.choice(BASES) + [hostile_override(rng, keys) for _ in range(rng.randint(1, 3))]
        cmd = [sys.executable, "-m", "orchestrator", *overrides, "figures=false", f"hydra.run.dir={tmp}/{i}"]
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            found["timeouts"].append(overrides)
            continue
        found["runs"] += 1
        found["exit_codes"][r.returncode] = found["exit_codes"].get(r.returncode, 0) + 1
        if "Traceback" in r.stdout + r.stderr or r.returncode not in (0, 2):
            found["tracebacks"].append((overrides, r.returncode, (r.stdout + r.stderr)[-500:]))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--compose", type=int, default=300)
    ap.add_argument("--cli", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    a = fuzz_dicts(args.n, rng)
    print(f"make_plan on {args.n} hostile configs ({time.perf_counter() - t0:.0f} s): {a['valid']} valid, "
          f"{len(a['exceptions'])} exceptions, {len(a['hangs'])} plans over 1 s (slowest {a['slowest_s']:.3f} s), "
          f"{len(a['nonsense'])} nonsense plans marked valid")
    t0 = time.perf_counter()
    b = fuzz_compose(args.compose, rng)
    print(f"Hydra compose + make_plan on {args.compose} hostile override sets ({time.perf_counter() - t0:.0f} s): "
          f"{b['rejected_at_compose']} refused at compose (key + fix), {b['valid']} valid plans, "
          f"{len(b['exceptions'])} exceptions, {len(b['hangs'])} over 1 s, {len(b['nonsense'])} nonsense")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        c = fuzz_cli(args.cli, rng, Path(tmp))
    print(f"CLI on {args.cli} hostile command lines ({time.perf_counter() - t0:.0f} s): exit codes "
          f"{dict(sorted(c['exit_codes'].items()))}, {len(c['tracebacks'])} tracebacks or other codes, "
          f"{len(c['timeouts'])} timeouts")
    for name, found in (("dicts", a), ("compose", b)):
        for key in ("exceptions", "hangs", "nonsense"):
            for item in found[key][:5]:
                print(f"  {name} {key}: {item}")
    for item in c["tracebacks"][:5]:
        print(f"  cli: {item}")


if __name__ == "__main__":
    main()
