"""Failover and checkpoint figures on this machine.

1. Time from a node loss to the first step after resume, split into detection,
   re-plan, restart (processes up, groups built) and checkpoint load: 2 emulated
   nodes x 2 ranks, DP4, node 1 killed after step 3, checkpoints every 2 steps.
2. Failover without a restart (two copies of the state: DP4 with dp_shard 2 on 2 x 2):
   the survivors drop the lost copy in place, a warm spare takes it, a node that comes back
   rejoins; each event's recovery time (failure detected, or decision for a rejoin, to the
   first step completed by the new generation) and steps lost.
3. Checkpoint save/load throughput of DCP (FsspecWriter/Reader on a local path)
   against torch.save/torch.load of the same model and Adam state, one process.

Run: .venv/bin/python benchmarks/failover_time.py
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def failover_breakdown(tmp: Path) -> None:
    run = tmp / "fo"
    subprocess.run([sys.executable, "-m", "orchestrator", "hardware=cpu", "model=tiny", "launcher=local",
                    "figures=false", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                    "training.steps=5", "training.checkpoint.every=2", "fault.kill_node=1", "fault.at_step=3",
                    f"hydra.run.dir={run}"], cwd=ROOT, check=True, capture_output=True)
    (ev,) = json.loads((run / "failover.json").read_text())
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in recs if r["attempt"] == 1)
    first_start = first["time"] - first["step_time_s"]
    load = float(re.search(r"resumed from .* in ([0-9.]+) s", (run / "attempt1" / "logs" / "rank0.log")
                           .read_text()).group(1))
    s = ev["seconds"]
    # The event is recorded once the new plan exists: the failure was detection + re-plan before.
    failed_at = ev["time"] - s["detection"] - s["replan"]
    restart = first_start - ev["time"] - load
    total = first["time"] - failed_at
    print(f"node loss -> first step after resume: {total:.2f} s = detection {s['detection']:.3f} s + "
          f"re-plan {s['replan']:.3f} s + restart {restart:.2f} s + checkpoint load {load:.2f} s + "
          f"first step {first['step_time_s']:.2f} s (+ bookkeeping "
          f"{total - s['detection'] - s['replan'] - restart - load - first['step_time_s']:.2f} s); "
          f"{ev['steps_lost']} step(s) lost, DP {ev['old_layout']['dp']} -> {ev['new_layout']['dp']}")


INPLACE = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "layout.dp=4", "layout.dp_shard=2",
           "hardware.gpus_per_node=2", "cluster.nodes=2", "failover.quorum_s=5", "fault.kill_node=1",
           "fault.at_step=3"]


def without_restart(tmp: Path) -> None:
    for name, extra in (("in place, then rejoin", ["training.steps=40", "fault.rejoin_at_step=5"]),
                        ("warm spare", ["training.steps=8", "cluster.spare_nodes=1"])):
        run = tmp / name.split()[0]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "orchestrator", *INPLACE, *extra, f"hydra.run.dir={run}"], cwd=ROOT,
                       check=True, capture_output=True)
        wall = time.perf_counter() - t0
        for ev in json.loads((run / "failover.json").read_text()):
            print(f"{name}: {ev['mode']} at step {ev['step']}, DP {ev['old_layout']['dp']} -> "
                  f"{ev['new_layout']['dp']}, recovered in {ev['recovery_s']:.2f} s, {ev['steps_lost']} step(s) "
                  f"lost, {ev.get('steps_redone', 0)} redone (whole run {wall:.1f} s)")


def throughput(tmp: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from orchestrator.train.checkpoint import state_dicts
    from orchestrator.train.model import Transformer

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    from orchestrator.config.schema import ModelConfig

    cfg = ModelConfig(name="bench", layers=8, hidden=512, ffn_hidden=1536, heads=8, kv_heads=4, vocab=32000,
                      rope_theta=1e4)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 32000, (1, 16))).sum().backward()
    opt.step()
    m, o = state_dicts([(0, model)], [opt])
    state = {"model": m, "optim": o}
    nbytes = sum(v.numel() * v.element_size() for d in (m, o) for v in d.values() if torch.is_tensor(v))

    def timed(fn, n=3):
        best = float("inf")
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    save_dcp = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(str(tmp / "dcp"))))
    load_dcp = timed(lambda: dcp.load(state, storage_reader=FsspecReader(str(tmp / "dcp"))))
    save_pt = timed(lambda: torch.save(state, tmp / "state.pt"))
    load_pt = timed(lambda: torch.load(tmp / "state.pt", weights_only=False))
    mb = nbytes / 1e6
    print(f"checkpoint of {mb:.0f} MB (model + Adam state, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params), best of 3: DCP save {mb / save_dcp:.0f} MB/s, load {mb / load_dcp:.0f} MB/s; "
          f"torch.save {mb / save_pt:.0f} MB/s, torch.load {mb / load_pt:.0f} MB/s")
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        failover_breakdown(Path(tmp))
        without_restart(Path(tmp))
        throughput(Path(tmp))


if __name__ == "__main__":
    main()
