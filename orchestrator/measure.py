"""Measured feeds back: compare finished runs with their plans and refit the efficiency.

    orchestrate-calibrate RUN_DIR [RUN_DIR ...] [--write PATH]
    orchestrate-calibrate --probe [--ranks N] [--repeat K] [--write PATH]

`--probe` measures this machine's components instead (orchestrator/probe.py: GEMM rate,
memory bandwidth, per-op overhead, gloo latency and bandwidth within a pair of processes,
each collective call's host time as the runtime issues it, the runtime's own model under each
parallelism, and the cores' worth N processes get at once; K probes, each figure the quietest of
them) and writes a
site preset built on `hardware=cpu` with them, by
default to outputs/probe/hardware-site.yaml under the working directory; its overrides are
printed as one line too, so it can be used without copying it into conf/hardware/. The
measurement is also cached for this machine (host, CPU, cores, torch release) under
$ORCHESTRATOR_CACHE_DIR, else $XDG_CACHE_HOME/orchestrator or ~/.cache/orchestrator, and every
later `hardware=cpu` plan on this machine predicts with it (probe.on_this_machine; a key given
on the command line still wins); without it, a hardware=cpu plan says its step is not a
prediction for this machine and how to measure it.

Each run directory holds the `plan.json` the run was launched with and its measured
step times (`metrics.jsonl` / `metrics.json`, written by the runtime, or the TensorBoard
scalar `time/step_s`); after a failover each attempt is compared with its own plan. The
measured MFU is the plan's model FLOPs per step over (world x peak x median measured step,
the first step of each attempt left out as warm-up); the refit kernel efficiency is the
least-squares scale from the plan's useful fraction to the measured MFU (published/calibrate.py).

It prints the refit value as a one-line override (`hardware.kernel_efficiency=...`) and
writes a hardware preset with it: by default into the first run directory
(`RUN_DIR/hardware-NAME-calibrated.yaml`), never into the source tree unless `--write`
names a path there (e.g. conf/hardware/site.yaml, then `hardware=site`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator import rundir
from orchestrator.published.calibrate import fit_measured
from orchestrator.rundir import read_steps
from orchestrator.rundir.metrics import attempt_plan, measured_mfu, step_stats


@dataclass
class Measured:
    run: Path
    attempt: int
    hardware: str
    predicted_step_s: float
    measured_step_s: float
    predicted_mfu: float
    measured_mfu: float
    useful_fraction: float  # predicted MFU at kernel efficiency 1


def measured_step_time(run: Path, skip_first: int = rundir.WARMUP_STEPS) -> float:
    """The run's measured step: its latest attempt's median after the warm-up (rundir.measured_step_s)."""
    steps = rundir.last_attempt_times(run)
    if not steps and (run / rundir.TENSORBOARD).exists():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run / rundir.TENSORBOARD)).Reload()
        steps = [e.value for e in acc.Scalars("time/step_s")]
    if not steps:
        raise ValueError(f"{run}: no measured step times (metrics.jsonl, metrics.json or tensorboard/)")
    return rundir.measured_step_s(steps, skip_first)


def read_run(run: Path) -> list[Measured]:
    """One measurement per attempt of a run, each against the plan it ran."""
    by_attempt: dict[int, list[float]] = {}
    for rec in rundir.timed(read_steps(run, latest=False)):  # every attempt measured its own layout
        by_attempt.setdefault(int(rec.get("attempt", 0)), []).append(float(rec["step_time_s"]))
    if not by_attempt:
        by_attempt = {0: [measured_step_time(run, skip_first=0)]}  # TensorBoard only
    out = []
    for attempt, times in sorted(by_attempt.items()):
        plan = attempt_plan(run, attempt)
        hw = plan["config"]["hardware"]
        step = step_stats(times)["median_s"]
        out.append(Measured(run, attempt, hw["name"], plan["step"]["wall_s"], step, plan["mfu"],
                            measured_mfu(plan, step), plan["mfu"] / hw["kernel_efficiency"]))
    return out


def _significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orchestrate-calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="run directories (plan.json + metrics)")
    ap.add_argument("--write", type=Path, help="write the refit hardware preset here "
                                               "(default: RUN_DIR/hardware-NAME-calibrated.yaml of the first run)")
    ap.add_argument("--probe", action="store_true", help="measure this machine's components, write a site preset")
    ap.add_argument("--ranks", type=int, default=2, help="processes whose share of the cores is measured "
                                                         "(2, 4, 6 or 8: as many as your runs start)")
    ap.add_argument("--repeat", type=int, default=3, help="probes, seconds apart; each figure the quietest of them")
    args = ap.parse_args(argv)
    if args.probe:
        return run_probe(args.ranks, args.write, args.repeat)
    if not args.runs:
        print("error: name run directories to refit from, or --probe to measure this machine", file=sys.stderr)
        return 2
    rows: list[Measured] = []
    for run in args.runs:
        try:
            rows += read_run(run)
        except (OSError, KeyError, ValueError, TypeError) as e:
            print(f"error: {run}: {e}", file=sys.stderr)
            return 2
    names = {r.hardware for r in rows}
    if len(names) != 1:
        print(f"error: runs on different hardware {sorted(names)}; calibrate one preset at a time", file=sys.stderr)
        return 2
    name = names.pop()
    print(f"{'run':<48} {'pred step':>10} {'meas step':>10} {'pred MFU':>9} {'meas MFU':>9}")
    for r in rows:
        where = str(r.run) + (f" #{r.attempt}" if r.attempt else "")
        print(f"{where[-48:]:<48} {r.predicted_step_s:10.4f} {r.measured_step_s:10.4f} "
              f"{r.predicted_mfu:9.2%} {r.measured_mfu:9.2%}")
    plan = attempt_plan(rows[0].run, rows[0].attempt)
    hwc = plan["config"]["hardware"]
    model = plan["config"].get("cost", {}).get("kernel_model") or hwc.get("kernel_model", "constant")
    if model == "constant":  # MFU = useful fraction x kernel efficiency: closed-form least squares
        try:
            eff = _significant(fit_measured([(r.useful_fraction, r.measured_mfu) for r in rows]))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        key, old = "kernel_efficiency", hwc["kernel_efficiency"]
    else:  # the shape-aware model: scale the GEMM ceiling by how much faster or slower the runs were
        ratio = statistics.median(r.predicted_step_s / r.measured_step_s for r in rows)
        key, old = "gemm_efficiency", hwc["gemm_efficiency"]
        eff = _significant(min(1.0, old * ratio))
    print(f"refit {key} for hardware={name} ({model} kernel model): {eff:g} (was {old:g}); predicted steps "
          f"scale by about {old / eff:.3g}x")
    print(f"use it as an override:  hardware={name} hardware.{key}={eff:g}")
    out = args.write or rows[0].run / f"hardware-{name}-calibrated.yaml"
    hw = dict(hwc, **{key: eff})
    from omegaconf import OmegaConf

    runs = ", ".join(str(r) for r in dict.fromkeys(r.run for r in rows))
    out.write_text(f"# Refit by orchestrate-calibrate on {time.strftime('%Y-%m-%d')} from {len(rows)} measured "
                   f"attempt(s): {runs}\n# {key} was {old:g}; the other values are the runs' preset.\n"
                   + OmegaConf.to_yaml(hw))
    print(f"wrote {out} (copy it to conf/hardware/<name>.yaml to select it as hardware=<name>)")
    return 0


def probe_overrides(hw: dict, base: dict) -> list[str]:
    """The site preset as hardware=cpu overrides (the keys the probe measured)."""
    return ["hardware=cpu"] + [f"hardware.{k}={v}" for k, v in hw.items() if k != "name" and base.get(k) != v]


def run_probe(ranks: int, write: Path | None, repeat: int = 1) -> int:
    from omegaconf import OmegaConf

    from orchestrator.config.compose import compose, to_dict
    from orchestrator.plan.machine import write_cache
    from orchestrator.probe import derive, probe, quietest, site_preset

    if not (2 <= ranks <= 8 and ranks % 2 == 0):
        print(f"error: --ranks {ranks}: the probe measures how 2, 4, 6 or 8 local processes share the cores (its "
              f"calls are timed over pairs). Fix: --ranks 2", file=sys.stderr)
        return 2
    if not 1 <= repeat <= 20:
        print(f"error: --repeat {repeat}: the probe runs 1 to 20 times. Fix: --repeat 3", file=sys.stderr)
        return 2
    t = time.perf_counter()
    results = [probe(ranks) for _ in range(repeat)]
    measured = derive(quietest(results))
    base = to_dict(compose(["hardware=cpu"]))["hardware"]
    hw = site_preset(measured, base)
    # each repeat on its own as well: a plan's step under each says how far this machine's own
    # measurements of its terms move (plan/machine.py Measurement.spread)
    each = [site_preset(derive(quietest([r])), base) for r in results] if repeat > 1 else []
    g = measured["gloo"]
    print(f"probe ({repeat} x, the quietest of each figure; {time.perf_counter() - t:.1f} s): GEMM " + ", ".join(
        f"{n}^3 {r * 1e3:.2f}" for n, r in measured["gemm_tflops"].items()) + " GFLOP/s; memory "
          f"{measured['hbm_gbps']:.1f} GB/s; {measured['op_overhead_us']:.1f} us per bare op, "
          f"{measured['layer_op_us']:.1f} us per kernel of "
          f"the runtime's block (fwd+bwd); gloo "
          f"all-reduce within a pair {g['latency_us']:.0f} us, {g['bus_gbps']:.2f} GB/s bus; "
          f"per call as the runtime issues it: DTensor redistribute {g['tp_call_us']:.0f} us, "
          f"+{g['dtensor_op_us']:.1f} us per DTensor op in the model ({g['bare_dtensor_op_us']:.1f} us bare), "
          f"c10d {g['c10d_call_us']:.0f} us, CP's {g['cp_call_us']:.0f} us, FSDP2 unit "
          f"gathers {g['fsdp_gather_us']:.0f} us per micro-batch, reduce-scatter {g['fsdp_reduce_us']:.0f} us"
          + (f" (over {g['fsdp_group']['group']}: +{g['fsdp_gather_step_us']:.0f} and "
             f"+{g['fsdp_reduce_step_us']:.0f} us per rank beyond a pair)" if g.get("fsdp_group") else "") + "; "
          f"AdamW {g['optimizer_us']:.0f} us per parameter tensor, +{g['dtensor_optimizer_us']:.0f} us as a DTensor; "
          f"the pipelining schedule {g['pp_microbatch_us']:.0f} us per micro-batch; "
          f"the runtime's model (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in g["model_ms"].items()) + "; "
          f"{measured['host_cores']:g} cores' worth for {measured.get('ranks', g['ranks'])} processes at once "
          f"({measured['cores_allowed']} allowed)")
    out = write or Path("outputs") / "probe" / "hardware-site.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Measured by orchestrate-calibrate --probe on {time.strftime('%Y-%m-%d %H:%M')} "
                   f"(orchestrator/probe.py); the rest is the cpu preset.\n" + OmegaConf.to_yaml(hw))
    print(f"wrote {out} (copy it to conf/hardware/site.yaml to select hardware=site)")
    if measured["floored"]:
        print("below the noise (measured difference under zero, zero in the preset): " + ", ".join(measured["floored"]))
    cache = write_cache(hw, measured, each)
    print(f"cached for this machine: {cache} (every hardware=cpu plan here now predicts with it; "
          f"keys given on the command line still win)")
    print("use it as overrides:  " + " ".join(probe_overrides(hw, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
