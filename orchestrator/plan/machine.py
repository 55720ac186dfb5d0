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
from functools import lru_cache

# the per-call host costs the probe measures (hardware.*_us; plan/overheads.py counts the calls)
CALL_KEYS = ("tp_call_us", "dtensor_op_us", "c10d_call_us", "fsdp_gather_us", "fsdp_reduce_us", "cp_call_us",
             "optimizer_us", "dtensor_optimizer_us", "pp_microbatch_us")

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


def write_cache(hw: dict, measured: dict) -> "os.PathLike":
    """Keep this machine's measured model (the site preset, each term's raw figures) for later plans."""
    import json

    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": dict(machine_key()), "measured_at": time.strftime("%Y-%m-%d %H:%M"), "hardware": hw,
              "terms": {k: list(v) for k, v in measured["terms"].items()}, "floored": measured["floored"],
              "raw": _plain(measured)}
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


def on_this_machine(spec):
    """hardware=cpu with this machine's measured model where it has one (each measured key the user
    left as shipped takes the measured value), and the one line the plan says about it: which
    measurement it uses, or that its CPU figure is not a prediction for this machine and how to
    measure it. Other hardware comes back as it is, with no line."""
    import dataclasses

    from orchestrator.config.schema import KernelModel

    hw = spec.hardware
    if hw.name != "cpu":
        return spec, None
    record = cached()
    if record is None:
        return spec, (f"hardware=cpu: this machine is unmeasured, so the predicted step is not a prediction "
                      f"for it: the stock preset's one efficiency is fitted to `make demo`'s layout (TP2 PP2 "
                      f"DP2, 8 processes) on a 2-core host. Measure this machine once with `{PROBE_HOW}` "
                      f"(about a minute; cached in {cache_dir() / 'probe'}, then used by every hardware=cpu plan "
                      f"here).")
    stock, got = stock_cpu(), record["hardware"]
    changes = {}
    for key in MEASURED_KEYS:
        now = getattr(hw, key)
        if key in got and getattr(now, "value", now) == stock.get(key):  # not overridden by the user
            changes[key] = KernelModel(got[key]) if key == "kernel_model" else got[key]
    spec = dataclasses.replace(spec, hardware=dataclasses.replace(hw, **changes))
    cores = got.get("host_cores")
    probed = (record.get("raw") or {}).get("gloo", {}).get("ranks")
    world = spec.cluster.nodes * hw.gpus_per_node
    more = (f"; this layout runs {world} processes, more than the {probed} the probe ran at once: how they "
            f"share the cores is assumed (evenly), not measured ({PROBE_HOW} --ranks {min(world, 8)} measures "
            f"{min(world, 8)})" if probed and world > probed else "")
    return spec, (f"hardware=cpu: predicted with this machine's measured model ({PROBE_HOW}, "
                  f"{record.get('measured_at', '?')}, {cache_path()})"
                  + (f", which found {cores:g} cores' worth free for the ranks: other load on the host "
                     f"changes the step" if cores else "")
                  + more + "; measure again after the machine, its load or torch changes")
