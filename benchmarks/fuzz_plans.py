"""Fuzz the planner with hostile configurations and print what it found.

1. N configurations (default 10,000): a real base config (tiny on CPU, Llama 3 405B,
   DeepSeek-V3, Megatron 1T) with 1-6 keys set to hostile values (zero, negative, huge,
   NaN, inf, 1e-300, strings, '???', interpolations, lists, null), planned through
   the typed schema and `make_plan` (the same merge and validation Hydra's compose does).
2. A sample (default 300) through Hydra's own compose + make_plan, with overrides as a
   user would type them.
3. Command lines (default 400) through the CLI's own entry points in this process
   (`orchestrate` and `orchestrate-runs`, as their console scripts call them): hostile
   overrides, every form of the sweep grammar (`-m`), the trainer keys, cluster.nodelist and
   cluster.topology (files that are not topologies, paths that cannot exist), run, sweep and
   checkpoint paths the file system cannot hold, and `orchestrate-runs` sub-commands on wrong
   paths and foreign or damaged run directories. Each must end with a documented exit status
   (0, 1, 2, 130, 141) and never in a traceback or an "internal error"; `cancel` must never
   signal a process that is not the run's own launcher.
4. A sample (default 30) of the same command lines in a new process each.

Counts exceptions (any, for (1) and (2) `make_plan` must not raise), hangs (a plan over
one second of CPU: the figure does not depend on what else the machine runs), and nonsense
plans marked valid (`sane` below). Run:
    .venv/bin/python benchmarks/fuzz_plans.py [--n 10000] [--compose 300] [--typed 400] [--cli 30] [--seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
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


EXITS = (0, 1, 2, 130, 141)  # cli.py's documented exit statuses
SWEEP_TEMPLATES = (
    "{k}={a},{b}", "{k}=choice({a},{b})", "{k}=range({i},{j})", "{k}=range({i},{j},{s})", "{k}=range({f},{g},{h})",
    "{k}=interval({i},{j})", "{k}=glob({p})", "{k}=glob({p},exclude=[{q}])", "{k}=glob([{p},{q}])",
    "{k}=sort({a},{b},{c})", "{k}=sort({a},{b},reverse=true)", "{k}=shuffle({a},{b},{c})", "{k}=shuffle(range({i},{j}))",
    "{k}=shuffle({a},seed={i})", "{k}=tag(t,choice({a},{b}))", "{k}=tag({a},{b})", "+{k}x={a},{b}", "++{k}={a},{b}",
    "~{k}", "{k}='{a},{b}',{c}", "{k}=[{a},{b}],[{c}]", "{k}={{x:{a}}},{{y:{b}}}", "{k}=choice(", "{k}=range()",
    "{k}=sort(shuffle({a},{b},{c}))", "{k}=range({i},{j},0)", "{k}=range(0,{big})", "hydra.job.name={a},{b}",
)
SWEEP_ATOMS = ("1", "2", "4", "0", "-1", "1.5", "nan", "inf", "null", "true", "abc", "'q r'", "''", "[]", "${nope}",
               "tiny", "h100_sxm", "auto", "1e300")
GLOBS = ("*", "h*", "tiny*", "zz*", "*_*", "[", "cpu", "")
TRAINER = {
    "trainer": ("orchestrator", "torchtitan", "megatron", "command", "nope", "null", "1"),
    "trainer.command": ("''", "python", "'python -c pass'", "\"unterminated 'quote\"", "'$(reboot)'", "'a;b|c'",
                        "'" + "x" * 300 + "'", "null", "5", "[a,b]"),
    "trainer.args": ("[]", "[--x=1]", "['a b',c]", "[[1]]", "[{a:1}]", "5", "abc", "null", "['--job.dump_folder=/']",
                     "[${nope}]"),
    "trainer.version": ("'0.2.0'", "'v1'", "''", "null", "1", "[1]"),
    "trainer.config_file": ("/nonexistent.toml", "''", "'" + "y" * 300 + "'", "null"),
    "trainer.stack": ("torchtitan", "nope", "null"),
}
NODELISTS = tuple(f"'{v}'" for v in ("node[1-4]", "node[1-8]", "node[4-1]", "node[1-100000000]", "r[1-2000]n[1-2000]",
                                       "a[", "a]", "", ",,,", "node[01-03],login", "n[1-2,x]", "node[1-4]" * 3,
                                       "node 1")) + ("node[1-4]", "null", "[n1,n2]", "5", "n1,n2")
RUN_PATH_KEYS = ("hydra.run.dir", "training.checkpoint.dir", "hydra.sweep.dir")


def fixtures(tmp: Path) -> dict:
    """Files and folders the typed command lines point at: topologies that are not, run
    directories that are foreign or damaged (copies of a real dry run, one file spoiled each)."""
    import io
    import shutil
    from contextlib import redirect_stderr, redirect_stdout

    from orchestrator.cli import main as orchestrate

    topo = tmp / "topo"
    topo.mkdir(parents=True)
    (topo / "good.conf").write_text("SwitchName=s1 Nodes=node[1-4]\nSwitchName=s2 Nodes=node[5-8]\n"
                                    "SwitchName=top Switches=s[1-2]\n")
    (topo / "garbage.conf").write_text("this is not a topology\nSwitchName=\nNodes=[[[\n")
    (topo / "binary.conf").write_bytes(bytes(range(256)) * 4)
    (topo / "empty.conf").write_text("")
    (topo / "loop.conf").write_text("SwitchName=a Switches=b\nSwitchName=b Switches=a\n")
    topologies = [str(topo / n) for n in ("good.conf", "garbage.conf", "binary.conf", "empty.conf", "loop.conf")]
    topologies += [str(topo), str(tmp / "missing.conf"), str(tmp / ("z" * 300)), "/dev/null", "/proc/self/mem"]

    runs = tmp / "runs"
    good = runs / "good"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        try:
            orchestrate(["hardware=cpu", "model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=2", "figures=false",
                         f"hydra.run.dir={good}"])
        except SystemExit:
            pass
    spoil = {"plan.json": ("{", "[]", "{}", '{"config": 5}', '{"config": {"training": 5}}'),
             "status.json": ("[]", "5", "{", '{"state": "running", "launcher": "local", "pid": -1}',
                             '{"state": "running", "pid": 0}', '{"state": "running", "pid": "abc"}',
                             '{"state": "running", "launcher": "local", "pid": 1}', '{"state": 5, "message": [1]}'),
             "metrics.jsonl": ("5\n", '{"step": "x"}\n', '{"step": 1, "loss": "x", "step_time_s": "y"}\n', "\x00\x01"),
             "slurm_jobs.jsonl": ('{"job_id": "notajob", "folder": "/nonexistent"}\n', "[]\n", '{"job_id": null}\n'),
             "manifest.json": ("[]", "{", '{"code": 5, "versions": [1]}'),
             ".hydra/overrides.yaml": (": : :", "{a: 1}", "- 5\n", "- [a]\n", ""),
             ".hydra/hydra.yaml": (": : :", "hydra: 5", "{}"),
             "failover.json": ("{", "5", '[{"mode": 5}]'),
             "attempt1/plan.json": ("{", "[]")}
    dirs = [good]
    for name, contents in spoil.items():
        for j, text in enumerate(contents):
            d = runs / f"{name.replace('/', '_')}{j}"
            shutil.copytree(good, d)
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
            dirs.append(d)
    (runs / "empty").mkdir()
    (runs / "sweep").mkdir()
    (runs / "sweep" / "sweep.json").write_text('{"points": []}')
    (runs / "a_file").write_text("not a run")
    dirs += [runs / "empty", runs / "sweep", runs / "a_file", runs / "missing", tmp / ("r" * 300),
             Path("/"), Path("/proc/self"), Path("")]
    return {"topologies": topologies, "runs": dirs, "root": runs}


KINDS = ("override", "sweep", "trainer", "placement", "paths", "runs", "runs")


def typed_case(rng: random.Random, keys, fx: dict, tmp: Path, i: int, kind: str | None = None) -> tuple[str, str, list[str]]:
    """One hostile command line: (its kind, "orchestrate" | "orchestrate-runs", its arguments)."""
    kind = kind or rng.choice(KINDS)
    base = rng.choice(BASES[:2]) + ["figures=false"]
    here = [f"hydra.run.dir={tmp}/{i}", f"hydra.sweep.dir={tmp}/{i}s"]
    if kind == "override":
        return kind, "orchestrate", base + [hostile_override(rng, keys) for _ in range(rng.randint(1, 3))] + here
    if kind == "sweep":
        names = [k for k, _ in keys] + ["hardware", "model", "schedule", "recipe", "stack", "fabric", "trainer"]
        sweeps = []
        for _ in range(rng.randint(1, 3)):
            a, b, c = (rng.choice(SWEEP_ATOMS) for _ in range(3))
            sweeps.append(rng.choice(SWEEP_TEMPLATES).format(
                k=rng.choice(names), a=a, b=b, c=c, i=rng.randint(-3, 9), j=rng.randint(-3, 9), s=rng.choice((1, 2, -1, 3)),
                f=rng.choice((0.5, 1.0, -1.5)), g=rng.choice((2.0, 3.5)), h=rng.choice((0.5, 0.25, -0.5)),
                p=rng.choice(GLOBS), q=rng.choice(GLOBS), big=rng.choice((10, 10**6, 10**12))))
        return kind, "orchestrate", ["-m"] + base + sweeps + here
    if kind == "trainer":
        chosen = rng.sample(sorted(TRAINER), rng.randint(1, 3))
        return kind, "orchestrate", base + [f"{k}={rng.choice(TRAINER[k])}" for k in chosen] + here
    if kind == "placement":
        extra = []
        if rng.random() < 0.7:
            extra.append(f"cluster.nodelist={rng.choice(NODELISTS)}")
        if rng.random() < 0.7 or not extra:
            extra.append(f"cluster.topology={rng.choice(fx['topologies'])}")
        return kind, "orchestrate", base + extra + [f"cluster.nodes={rng.choice((1, 2, 4, 8))}"] + here
    if kind == "paths":
        key = rng.choice(RUN_PATH_KEYS)
        path = rng.choice((f"{tmp}/{'p' * 300}", f"{tmp}/{i}/{'q' * 256}", f"{fx['root']}/a_file/x", "/proc/x",
                           f"{tmp}/{'d/' * 2100}", "''", f"{tmp}/a b", "file:///proc/1/x", "nope://x", f"{tmp}/../.."))
        extra = [f"{key}={path}"] + (["training.checkpoint.every=2"] if rng.random() < 0.5 else [])
        return kind, "orchestrate", (["-m"] if key == "hydra.sweep.dir" else []) + base + extra + \
            [h for h in here if not h.startswith(key + "=")]
    command = rng.choice(("list", "status", "logs", "cancel", "resume", "resume"))
    if command == "list":
        return kind, "orchestrate-runs", ["list", "--root", str(rng.choice(fx["runs"] + [fx["root"]]))]
    args = [command, str(rng.choice(fx["runs"]))]
    if command == "resume" and rng.random() < 0.5:
        args.append(hostile_override(rng, keys))
    return kind, "orchestrate-runs", args


def run_in_process(program: str, argv: list[str]) -> tuple[int, str]:
    """The exit status and output of one command line through the console script's own function."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from orchestrator.cli import main, runs_main

    out, mask = io.StringIO(), os.umask(0o022)
    os.umask(mask)
    try:
        with redirect_stdout(out), redirect_stderr(out):
            (main if program == "orchestrate" else runs_main)(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - escaping the entry point is exactly what is counted
        import traceback

        code, _ = -1, out.write(traceback.format_exc())
    finally:
        os.umask(mask)  # a run sets owner-only for itself and its children
    return code, out.getvalue()


def bad_outcome(code: int, text: str) -> bool:
    return code not in EXITS or "Traceback" in text or "internal error" in text


def fuzz_typed(n: int, rng: random.Random, tmp: Path, round_robin: bool = False) -> dict:
    """`n` hostile command lines through the entry points, in this process (with `round_robin`,
    the kinds in turn, so a small sample has every kind), in `tmp` as the current folder."""
    import signal

    from orchestrator.config.schema import Config

    keys, fx = leaf_keys(Config), fixtures(tmp)
    bystander = subprocess.Popen(["sleep", "3600"])  # a process that is not a run's: cancel must leave it be
    found = {"runs": 0, "exit_codes": {}, "tracebacks": [], "timeouts": [], "kinds": {}, "slowest_s": 0.0}

    def too_long(*_):
        raise TimeoutError("over 120 s")

    old, cwd = signal.signal(signal.SIGALRM, too_long), os.getcwd()
    os.chdir(tmp)  # a relative path typed on a command line lands here, not in the checkout
    try:
        for i in range(n):
            kind, program, argv = typed_case(rng, keys, fx, tmp, i, KINDS[i % len(KINDS)] if round_robin else None)
            t0 = time.perf_counter()
            signal.alarm(120)
            try:
                code, text = run_in_process(program, argv)
            except TimeoutError:
                found["timeouts"].append((program, argv))
                continue
            finally:
                signal.alarm(0)
            found["slowest_s"] = max(found["slowest_s"], time.perf_counter() - t0)
            found["runs"] += 1
            found["exit_codes"][code] = found["exit_codes"].get(code, 0) + 1
            by_kind = found["kinds"].setdefault(kind, {})
            by_kind[code] = by_kind.get(code, 0) + 1
            if bad_outcome(code, text):
                found["tracebacks"].append((program, argv, code, text[-600:]))
    finally:
        os.chdir(cwd)
        signal.signal(signal.SIGALRM, old)
        if bystander.poll() is not None:
            found["tracebacks"].append(("orchestrate-runs", ["cancel"], -1, "a process that was not a run's was killed"))
        bystander.kill()
        bystander.wait()
    return found


def fuzz_cli(n: int, rng: random.Random, tmp: Path) -> dict:
    """The same command lines, each in a new process (`python -m orchestrator`, orchestrate-runs)."""
    from orchestrator.config.schema import Config

    keys, fx = leaf_keys(Config), fixtures(tmp / "fx")
    found = {"runs": 0, "exit_codes": {}, "tracebacks": [], "timeouts": []}
    for i in range(n):
        _, program, argv = typed_case(rng, keys, fx, tmp, i)
        entry = (["-m", "orchestrator"] if program == "orchestrate" else
                 ["-c", "from orchestrator.cli import runs_main; runs_main()"])
        try:
            r = subprocess.run([sys.executable, *entry, *argv], cwd=tmp, capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
        except subprocess.TimeoutExpired:
            found["timeouts"].append((program, argv))
            continue
        found["runs"] += 1
        found["exit_codes"][r.returncode] = found["exit_codes"].get(r.returncode, 0) + 1
        if bad_outcome(r.returncode, r.stdout + r.stderr):
            found["tracebacks"].append((program, argv, r.returncode, (r.stdout + r.stderr)[-500:]))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--compose", type=int, default=300)
    ap.add_argument("--typed", type=int, default=400)
    ap.add_argument("--cli", type=int, default=30)
    ap.add_argument("--show", type=int, default=5, help="how many failures of each kind to print")
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
        t = fuzz_typed(args.typed, rng, Path(tmp) / "typed")
        print(f"CLI entry points on {args.typed} hostile command lines, in process ({time.perf_counter() - t0:.0f} s, "
              f"slowest {t['slowest_s']:.1f} s): exit codes {dict(sorted(t['exit_codes'].items()))}, "
              f"{len(t['tracebacks'])} tracebacks, internal errors or other codes, {len(t['timeouts'])} over 120 s")
        print("  exit codes by kind: " + ", ".join(f"{k} {dict(sorted(v.items()))}" for k, v in sorted(t["kinds"].items())))
        t0 = time.perf_counter()
        c = fuzz_cli(args.cli, rng, Path(tmp) / "cli")
    print(f"CLI on {args.cli} hostile command lines, a process each ({time.perf_counter() - t0:.0f} s): exit codes "
          f"{dict(sorted(c['exit_codes'].items()))}, {len(c['tracebacks'])} tracebacks or other codes, "
          f"{len(c['timeouts'])} timeouts")
    for name, found in (("dicts", a), ("compose", b)):
        for key in ("exceptions", "hangs", "nonsense"):
            for item in found[key][:5]:
                print(f"  {name} {key}: {item}")
    for item in t["tracebacks"][:args.show] + t["timeouts"][:args.show] + c["tracebacks"][:args.show]:
        print(f"  cli: {item}")

if __name__ == "__main__":
    main()
