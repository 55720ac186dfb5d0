"""The README's hardware=cpu examples on this machine: measured step against the predicted one,
with the stock preset (no measurement of this machine) and with this machine's cached probe
(`orchestrate-calibrate --probe`, plan/machine.py), nothing fitted on these runs.

Each example runs its layout (the README's overrides without the fault injection) with
launcher=local, `--runs` times, one at a time; the measurement is the median step after the
warm-up of each run, and the lowest of those medians (other load on a shared host comes and
goes). The probe is taken from the cache the environment names (ORCHESTRATOR_CACHE_DIR); the
stock prediction is planned in an empty cache.

During each run the cores' worth other load left it is measured: the host's busy CPU time
(/proc/stat) less the run's own (its process tree's, sampled twice a second), per second of its
timed steps, taken from the cores this process may use (what other load took, the run did not get;
with autogroup scheduling each rank, leading a session of its own, competes as a group of its own,
so `nice` does not keep it behind other load). On a shared host other load takes a share the cached
probe never saw, so the measured model is also planned at that load (`hardware.host_cores=`: a
measurement of the host over the run, nothing fitted on the run). probe.cores_now's snapshot
before and after the run (as the probe measures host_cores: a second or two of work) is printed
beside it; other load comes and goes within a run, and a snapshot can miss it either way.

A plan says whether its step is a prediction for the layout on this machine (plan.json's
`prediction`: the probe measured every part of it) or plainly not (what the probe did not
measure: more processes than it ran, a group wider than its pairs, experts, copies that commit
across the coordinator; or a step that one of the probe's own repeats moves more than 20%: the
machine's noise in what the layout pays is wider than the aim); those examples are counted apart,
not in the within-20% tally, and their measured step is printed against the plan's all the same.

Prints per example: predicted (stock, measured model, measured model at the load measured beside
the run), measured, measured / predicted, cores' worth left by other load, and whether the plan
calls it a prediction.

`--side` adds pipelines with a large bubble (SIDE: not README examples, counted apart), where how
the ranks share the cores matters most.

Run: ORCHESTRATOR_CACHE_DIR=DIR .venv/bin/python benchmarks/readme_cpu.py [--steps 12] [--runs 2] [--only NAME] [--side]
(first: ORCHESTRATOR_CACHE_DIR=DIR .venv/bin/orchestrate-calibrate --probe --ranks 8: the README's
examples run 4 and 8 processes; a probe of fewer leaves their time-sharing unmeasured)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU = ["hardware=cpu"]
EXAMPLES = {  # README section -> its layout's overrides
    "demo (make demo)": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2",
                         "layout.dp=2", "schedule=1f1b"],
    "moe": ["model=tiny_moe", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.ep=4", "layout.pp=2"],
    "failover tp2": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2"],
    "in-place dp4/shard2": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                            "layout.dp_shard=2"],
    "slurm tp2 pp2": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2"],
    "sweep tp1 pp1": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=1", "layout.pp=1"],
    "sweep tp1 pp2": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=1", "layout.pp=2"],
    "sweep tp2 pp1": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=1"],
    "sweep tp2 pp2": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2"],
}

# Not README examples (`--side`, counted apart): pipelines whose bubble is a large part of the step,
# where whether idle ranks leave their cores to the others matters most (plan/cost.py _core_share).
SIDE = {
    "side pp4 m4": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.pp=4",
                    "training.global_batch=4"],
    "side pp4 m8": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.pp=4",
                    "training.global_batch=8"],
    "side pp2 dp2 m2": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.pp=2",
                        "training.global_batch=4"],
}


def predicted(overrides: list[str], cache: str) -> tuple[float, dict]:
    """The plan's wall-clock step and its `prediction` (plan/machine.py) in the cache named."""
    env = dict(os.environ, ORCHESTRATOR_CACHE_DIR=cache)
    code = ("import sys, json; from orchestrator import compose, make_plan; "
            "p = make_plan(compose(sys.argv[1:])); print(json.dumps([p.step.wall_s, p.prediction]))")
    r = subprocess.run([sys.executable, "-c", code, *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                       check=True)
    wall, prediction = json.loads(r.stdout.strip().splitlines()[-1])
    return float(wall), prediction or {}


def world_of(overrides: list[str]) -> int:
    kv = dict(o.split("=", 1) for o in overrides if "=" in o)
    return int(kv.get("cluster.nodes", 1)) * int(kv.get("hardware.gpus_per_node", 1))


def _busy_jiffies() -> int:
    """CPU time the host's cores have been busy (/proc/stat, clock ticks): all but idle and iowait."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def _cpu_seconds() -> dict:
    """Each process' CPU time so far (/proc/PID/stat: utime + stime) and its parent, by (pid, start time)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[(int(pid), rest[19])] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
    return out


def run_watched(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, list]:
    """Run `cmd`, sampling twice a second (epoch time, the host's busy CPU seconds, the run's own):
    the run's own is its process tree's, every process that ever descended from it (its ranks lead
    sessions of their own, and a rank's parent may end first), and this process' (the sampling)."""
    import threading
    import time

    tick = os.sysconf("SC_CLK_TCK")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    tree, seen, samples, done = {proc.pid}, {}, [], threading.Event()

    def sample():
        while True:
            now = _cpu_seconds()
            for (pid, start), (parent, cpu) in sorted(now.items(), key=lambda x: x[0][0]):
                if pid in tree or parent in tree:
                    tree.add(pid)
                    seen[(pid, start)] = cpu
            samples.append((time.time(), _busy_jiffies() / tick, sum(seen.values()) + time.process_time()))
            if done.wait(0.5):
                return

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=900)
    done.set()
    watcher.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), samples


def left_by_others(samples: list, start: float, end: float) -> float:
    """The cores' worth other load left a run from `start` to `end` (epoch seconds: its timed steps):
    the cores this process may use less the host's busy CPU time that was not the run's, per second,
    between the samples that bracket the window most closely from inside (the whole run's where
    fewer than two fall in it)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    inside = [x for x in samples if start <= x[0] <= end]
    (t0, busy0, ours0), (t1, busy1, ours1) = (inside[0], inside[-1]) if len(inside) >= 2 else (samples[0], samples[-1])
    others = max((busy1 - busy0) - (ours1 - ours0), 0.0) / max(t1 - t0, 1e-9)
    return round(min(float(allowed), max(allowed - others, 1.0)), 2)


def within(ratio: float) -> bool:
    """Measured / predicted within what a prediction here aims for (plan/machine.py WITHIN)."""
    from orchestrator.plan.machine import WITHIN

    return 1 - WITHIN <= ratio <= 1 + WITHIN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="example names (default: all)")
    ap.add_argument("--side", action="store_true", help="also the side layouts (SIDE), counted apart")
    args = ap.parse_args()
    from orchestrator import rundir
    from orchestrator.probe import cores_now
    from orchestrator.rundir import read_steps, timed

    cache = os.environ.get("ORCHESTRATOR_CACHE_DIR")
    empty = tempfile.mkdtemp(prefix="readme_cpu_nocache_")
    tmp = Path(tempfile.mkdtemp(prefix="readme_cpu_"))
    common = [f"training.steps={args.steps}", "figures=false"]
    print(f"{'example':<22} {'stock':>7} {'model':>7} {'@load':>7} {'measured':>9} {'/stock':>7} {'/model':>7} "
          f"{'/@load':>7} {'cores':>5}  prediction?")
    tally = {"stock": 0, "model": 0, "load": 0, "predicted": 0, "labelled": 0}
    labelled = []
    every = {"stock": 0, "model": 0, "load": 0}
    for n, (name, lay) in enumerate({**EXAMPLES, **(SIDE if args.side else {})}.items()):
        if args.only and name not in args.only:
            continue
        over = CPU + lay + common
        stock, _ = predicted(over, empty)
        model, prediction = predicted(over, cache) if cache else (float("nan"), {})
        runs = []
        for k in range(args.runs):
            run = tmp / f"{name.split()[0]}-{n}-{k}"
            env = dict(os.environ, ORCHESTRATOR_CACHE_DIR=cache or empty)
            before = cores_now(world_of(over))
            r, samples = run_watched([sys.executable, "-m", "orchestrator", *over, "launcher=local",
                                      f"hydra.run.dir={run}"], cwd=ROOT, env=env)
            snapshot = (before + cores_now(world_of(over))) / 2
            steps = list(timed(read_steps(run))) if r.returncode == 0 else []
            got = [float(x["step_time_s"]) for x in steps]
            if got:
                counted = rundir.measured(steps)  # the steps measured_step_s counts (after the warm-up)
                window = (min(float(x["time"]) - float(x["step_time_s"]) for x in counted),
                          max(float(x["time"]) for x in counted))
                runs.append((rundir.measured_step_s(got), left_by_others(samples, *window), snapshot))
            else:
                print(f"  {name}: run {k} failed: {r.stderr[-300:]}")
        if not runs:
            continue
        meas, cores, _ = min(runs)
        at_load, _ = predicted(over + [f"hardware.host_cores={cores:.2f}"], cache) if cache else (float("nan"), {})
        is_prediction = bool(prediction.get("is_prediction"))
        if name in SIDE:
            print(f"{name:<22} {stock:7.3f} {model:7.3f} {at_load:7.3f} {meas:9.3f} {meas / stock:7.2f} "
                  f"{meas / model:7.2f} {meas / at_load:7.2f} {cores:5.2f}  side "
                  f"({'prediction' if is_prediction else 'labelled'})", flush=True)
            continue
        tally["predicted" if is_prediction else "labelled"] += 1
        for key, pred in (("stock", stock), ("model", model), ("load", at_load)):
            every[key] += within(meas / pred)
            tally[key] += is_prediction and within(meas / pred)
        if not is_prediction:
            labelled.append((name, prediction.get("not_measured") or ["no probe"]))
        print(f"{name:<22} {stock:7.3f} {model:7.3f} {at_load:7.3f} {meas:9.3f} {meas / stock:7.2f} "
              f"{meas / model:7.2f} {meas / at_load:7.2f} {cores:5.2f}  {'yes' if is_prediction else 'NO (labelled)'}"
              f"   (medians {', '.join(f'{m:.3f} at {c:.2f} cores (snapshot {snap:.2f})' for m, c, snap in runs)})",
              flush=True)
    p = tally["predicted"]
    print(f"\nof the {p} examples the plan calls a prediction, within 20%: stock preset {tally['stock']}, measured "
          f"model {tally['model']}, measured model at the load measured beside the run {tally['load']}")
    print(f"of all {p + tally['labelled']} examples, within 20%: stock preset {every['stock']}, measured model "
          f"{every['model']}, at the load measured beside the run {every['load']}")
    print(f"labelled not a prediction for their layout (counted apart): {tally['labelled']}")
    for name, why in labelled:
        print(f"  {name}: " + "; ".join(why))


if __name__ == "__main__":
    main()
