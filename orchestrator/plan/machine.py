"""This machine's measured model for hardware=cpu: measured once (`orchestrate-calibrate --probe`,
orchestrator/probe.py), cached per machine, and used by every hardware=cpu plan here.

The cache lives under $ORCHESTRATOR_CACHE_DIR, else $XDG_CACHE_HOME/orchestrator, else
~/.cache/orchestrator, one file per machine (host, CPU, cores this process may use, the torch
release: read from its metadata, not imported). Torch-free: the planner reads it.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from functools import lru_cache

# the per-call host costs the probe measures (hardware.*_us; plan/overheads.py counts the calls)
CALL_KEYS = ("tp_call_us", "dtensor_op_us", "c10d_call_us", "fsdp_gather_us", "fsdp_reduce_us", "cp_call_us",
             "optimizer_us", "dtensor_optimizer_us", "pp_microbatch_us", "fsdp_gather_step_us", "fsdp_reduce_step_us")

CACHE_ENV = "ORCHESTRATOR_CACHE_DIR"  # default: $XDG_CACHE_HOME/orchestrator, else ~/.cache/orchestrator
PROBE_HOW = "orchestrate-calibrate --probe"


def cache_dir() -> "os.PathLike":
    from pathlib import Path

    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orchestrator"


@lru_cache(maxsize=1)
def machine_key() -> dict:
    """What a measurement holds for: this host, its CPU, the cores this process may use and the
    torch release the ranks run (read from its metadata, not imported)."""
    import importlib.metadata
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "none"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "cpu": cpu, "cores": cores, "torch": torch}


def cache_path(key: dict | None = None):
    import hashlib
    import json

    key = key or dict(machine_key())
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in key["host"])[:40]
    return cache_dir() / "probe" / f"{host}-{digest}.json"


def write_cache(hw: dict, measured: dict, repeats: "list[dict]" = ()) -> "os.PathLike":
    """Keep this machine's measured model (the site preset, each term's raw figures) for later plans;
    `repeats`: the site preset of each of the probe's repeats on its own (a plan's step under each
    says how far this machine's own measurements of the layout's terms move: Measurement.spread)."""
    import json

    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": dict(machine_key()), "measured_at": time.strftime("%Y-%m-%d %H:%M"), "hardware": hw,
              "terms": {k: list(v) for k, v in measured["terms"].items()}, "floored": measured["floored"],
              "raw": _plain(measured),
              "repeats": [{k: r[k] for k in MEASURED_KEYS if k in r and k != "kernel_model"} for r in repeats]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items() if k not in ("terms", "floored")}
    return x


def cached() -> dict | None:
    """This machine's cached measurement, or None (none, or unreadable: then measure again)."""
    import json

    try:
        record = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("hardware"), dict) else None


# the preset keys a measurement replaces in hardware=cpu (what the probe measures, and the kernel
# model its figures are for)
MEASURED_KEYS = ("peak_tflops", "gemm_efficiency", "hbm_gbps", "intra_node_gbps", "inter_node_gbps",
                 "intra_node_latency_us", "inter_node_latency_us", "kernel_model", "launch_overhead_us",
                 "host_cores", *CALL_KEYS)


def stock_cpu() -> dict:
    """hardware=cpu as shipped (conf/hardware/cpu.yaml over the schema's defaults), as plain values."""
    import dataclasses

    from omegaconf import OmegaConf

    from orchestrator.config.paths import CONF_DIR
    from orchestrator.config.schema import HardwareConfig

    out = {f.name: f.default for f in dataclasses.fields(HardwareConfig) if f.default is not dataclasses.MISSING}
    out.update(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "hardware" / "cpu.yaml")))
    return {k: getattr(v, "value", v) for k, v in out.items()}


# The probe times every collective call over groups of this many ranks (pairs; orchestrator/probe.py):
# a TP, CP or FSDP2 group wider than this is priced at a pair's cost per call, not measured; FSDP2
# also over a wider group where the probe ran as many processes (`fsdp_group`, --ranks 4 or more).
PROBE_GROUP = 2
FSDP_GROUP = 4  # the wider FSDP2 group the probe times when it runs as many processes
# What a prediction on this machine aims for (the measured step within 20% of the plan's): a layout
# whose step under the probe's own repeats lands outside it is not predicted that closely here.
WITHIN = 0.2


@dataclass(frozen=True)
class Measurement:
    """What a hardware=cpu plan on this machine predicts with: the cached probe's record (None:
    this machine is unmeasured) and where each measured key's value came from."""

    record: dict | None
    sources: dict = field(default_factory=dict)  # preset key -> "measured" | "below the noise" | "yours"

    def judge(self, layout) -> dict:
        """plan.json's `prediction`: whether the plan's step is a prediction for this layout on this
        machine (`is_prediction`), and if not, each reason (`not_measured`): an unmeasured machine,
        or a part of this layout the probe did not measure (more processes than it ran, a group
        wider than its pairs, experts, a per-call cost this layout pays that came out below zero)."""
        if self.record is None:
            return {"basis": "stock preset", "is_prediction": False, "not_measured": [
                f"this machine is unmeasured: the stock preset's one efficiency is fitted to `make demo`'s layout "
                f"(TP2 PP2 DP2, 8 processes) on a 2-core host; measure it once with `{PROBE_HOW}`"]}
        rec = self.record
        raw = rec.get("raw") or {}
        probed = int(raw.get("ranks") or raw.get("gloo", {}).get("ranks") or 0)  # processes sharing the cores
        group = int(raw.get("gloo", {}).get("group") or PROBE_GROUP)
        why = []
        if layout is not None:
            world = layout.world
            if probed and world > probed:
                why.append(f"{world} processes, more than the {probed} the probe ran at once: how they share "
                           f"the cores is assumed, not measured; `{PROBE_HOW} --ranks {min(world, 8)}` "
                           f"measures {min(world, 8)}")
            fsdp = layout.dp_shard * layout.cp
            wide = int((raw.get("gloo", {}).get("fsdp_group") or {}).get("group") or 0)
            for name, size in (("TP", layout.tp), ("CP", layout.cp)):
                if size > group:
                    why.append(f"{name} over {size} ranks: the probe timed its calls over groups of {group}")
            if fsdp > max(group, wide):
                why.append(f"FSDP2 over {fsdp} ranks: the probe timed its calls over groups of "
                           + (f"up to {wide}" if wide else
                              f"{group} (`{PROBE_HOW} --ranks {FSDP_GROUP}` times FSDP2 over {FSDP_GROUP})"))
            if layout.dp_replicate > 1:
                why.append(f"{layout.dp_replicate} copies of the model state, which commit each step across "
                           f"copies (an all-reduce of the gradient shards, a round trip to the coordinator): "
                           f"the probe measures neither")
            if layout.ep > 1:
                why.append(f"expert parallelism (EP{layout.ep}): the probe measures no MoE layer and no all-to-all")
            if layout.chunks > 1:
                why.append(f"{layout.chunks} model chunks per pipeline rank: the probe timed one")
            from orchestrator.plan.overheads import paid_terms

            for key in sorted(paid_terms(layout) & set(rec.get("floored") or ())):
                if self.sources.get(key) == "below the noise":  # not the user's own value
                    why.append(f"hardware.{key}, which this layout pays, came out below zero in the probe (a "
                               f"difference of two timings within their noise; 0 in the preset): not measured here; "
                               f"measure again (`{PROBE_HOW}`), or give it (hardware.{key}=...)")
        return {"basis": "probe", "is_prediction": not why, "not_measured": why,
                "cache": str(cache_path()), "measured_at": rec.get("measured_at"), "probe_ranks": probed,
                "probe_group": group, "terms": dict(self.sources)}

    def repeat_hardware(self, hw) -> list:
        """`hw` (this machine's measured model, as on_this_machine made it) under each of the probe's
        repeats on its own: every measured key the user left as measured takes that repeat's figure."""
        import dataclasses

        keep = {k for k, src in self.sources.items() if src == "yours"}
        return [dataclasses.replace(hw, **{k: v for k, v in r.items() if k not in keep and hasattr(hw, k)})
                for r in (self.record or {}).get("repeats") or ()]

    def spread(self, prediction: dict, wall_s: float, repeats_s: list, paid: set) -> dict:
        """plan.json's `prediction` with the step under each of the probe's repeats (`repeats_s`) and,
        where one of them is more than WITHIN from the plan's (the quietest of each figure), plainly
        no prediction to that closeness: the machine's own measurements of what this layout pays
        (`paid`: its per-call keys) move more than that between repeats seconds apart."""
        if not repeats_s or not wall_s:
            return prediction
        out = dict(prediction, repeats_s=[round(x, 6) for x in repeats_s])
        lo, hi = min(repeats_s), max(repeats_s)
        if (1 - WITHIN) * wall_s <= lo and hi <= (1 + WITHIN) * wall_s:
            return out
        reps = self.record.get("repeats") or []
        moved = []
        for key in sorted(paid):
            vals = [float(r[key]) for r in reps if key in r]
            if vals and self.sources.get(key) != "yours" and max(vals) > (1 + WITHIN) * max(min(vals), 1e-9):
                moved.append(f"hardware.{key} {min(vals):g}-{max(vals):g}")
        out["not_measured"] = list(prediction["not_measured"]) + [
            f"the probe's {len(repeats_s)} repeats put this layout's step at {lo:.3f}-{hi:.3f} s against the "
            f"{wall_s:.3f} s predicted from the quietest of each figure: this machine's own measurements of what "
            f"the layout pays move more than the {WITHIN:.0%} a prediction here aims for"
            + (f" ({', '.join(moved)})" if moved else "") + f" (other load on the host between repeats); "
            f"measure again on a quieter host (`{PROBE_HOW}`), or give the terms (hardware.KEY=...)"]
        out["is_prediction"] = False
        return out

    def line(self, prediction: dict, share: float = 1.0) -> str:
        """The plan's one warning about it: which measurement it predicts with, or plainly that its
        step is not a prediction for this layout (or machine) and why; `share`: how many times as
        long each rank's work takes, its processes sharing the cores (plan/cost.py _core_share)."""
        if prediction["basis"] != "probe":
            return (f"hardware=cpu: this machine is unmeasured, so the predicted step is not a prediction "
                    f"for it: the stock preset's one efficiency is fitted to `make demo`'s layout (TP2 PP2 "
                    f"DP2, 8 processes) on a 2-core host. Measure this machine once with `{PROBE_HOW}` "
                    f"(about a minute; cached in {cache_dir() / 'probe'}, then used by every hardware=cpu plan "
                    f"here).")
        cores = self.record["hardware"].get("host_cores")
        head = (f"hardware=cpu: predicted with this machine's measured model ({PROBE_HOW}, "
                f"{self.record.get('measured_at', '?')}, {cache_path()})"
                + (f", which found {cores:g} cores' worth free for the ranks: other load on the host "
                   f"changes the step" if cores else "")
                + (f"; the ranks outnumber those cores: each rank's work takes {share:.2f}x as "
                   f"long" if share > 1.0 else ""))
        if prediction["not_measured"]:
            return (head + "; but the predicted step is NOT a prediction for this layout: "
                    + "; ".join(prediction["not_measured"]))
        return head + "; measure again after the machine, its load or torch changes"


def on_this_machine(spec):
    """hardware=cpu with this machine's measured model where it has one (each measured key the user
    left as shipped takes the measured value), and the Measurement it rests on (plan.json's
    `prediction`, the plan's warning line: which measurement, or that its figure is not a prediction
    for this machine or layout). Other hardware comes back as it is, with None."""
    import dataclasses

    from orchestrator.config.schema import KernelModel

    hw = spec.hardware
    if hw.name != "cpu":
        return spec, None
    record = cached()
    if record is None:
        return spec, Measurement(None)
    stock, got = stock_cpu(), record["hardware"]
    floored = set(record.get("floored") or ())
    changes, sources = {}, {}
    for key in MEASURED_KEYS:
        now = getattr(hw, key)
        if key not in got:
            continue
        if getattr(now, "value", now) == stock.get(key):  # not overridden by the user
            changes[key] = KernelModel(got[key]) if key == "kernel_model" else got[key]
            sources[key] = ("below the noise" if key in floored else
                            "measured" if key in (record.get("terms") or {}) else "the probe's model")
        else:
            sources[key] = "yours"
    spec = dataclasses.replace(spec, hardware=dataclasses.replace(hw, **changes))
    return spec, Measurement(record, sources)
