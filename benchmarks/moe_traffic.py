"""Expert parallelism as it runs against the plan, on this machine (tiny_moe, gloo on CPU):

- all-to-all bytes per step per GPU: the plan's figure (uniform routing) against what the
  runtime sent (counted in the all-to-all calls: dispatch and combine, forward and backward),
  mean and busiest rank;
- load imbalance per MoE layer (busiest expert / mean) at the first and the last step, with
  the auxiliary-loss-free bias steering the router;
- seconds in the all-to-all calls per step (busiest rank) against the whole step.

Run: .venv/bin/python benchmarks/moe_traffic.py [steps]
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["hardware=cpu", "model=tiny_moe", "launcher=local", "figures=false"]
LAYOUTS = {
    "EP4 x DP4 (1 x 4)": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.ep=4"],
    "TP2 x DP4, EP4 (2 x 4)": ["cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.etp=1",
                               "layout.ep=4"],
    "EP4 x PP2 (2 x 4)": ["cluster.nodes=2", "hardware.gpus_per_node=4", "layout.ep=4", "layout.pp=2"],
}


def scalars(tb_dir: Path, prefix: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0}).Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"] if t.startswith(prefix)}


def measure(name: str, overrides: list[str], steps: int, run: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "orchestrator", *COMMON, *overrides, f"training.steps={steps}",
                        f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    plan = json.loads((run / "plan.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    (ep,) = [a for a in plan["axes"] if a["name"] == "ep"]
    sent = metrics["ep_bytes_per_rank"][1:]  # step 0 pays one-off start-up in its time, not bytes
    # The plan's per-GPU figure is the pace-setting pipeline stage's: compare its ranks.
    g = plan["ranks"]
    paced = [r for r in range(plan["world_size"])
             if (r // g["strides"]["pp"]) % g["sizes"]["pp"] == plan["step"]["stage"]]
    mean = statistics.mean(statistics.mean(s[r] for r in paced) for s in sent)
    busiest = statistics.mean(max(s) for s in sent)
    tb = run / "tensorboard"
    imb = scalars(tb, "moe/imbalance/")
    a2a = scalars(tb, "time/ep_all_to_all_s_max")["time/ep_all_to_all_s_max"][1:]
    step = metrics["step_time_s"][1:]
    print(f"== {name}: {steps} steps, plan {plan['layout']['label']}")
    print(f"  all-to-all bytes/step/GPU (stage {plan['step']['stage']}): plan {ep['bytes_per_step'] / 1e6:.3f} MB, "
          f"measured mean {mean / 1e6:.3f} MB ({mean / ep['bytes_per_step']:.2f}x), busiest rank {busiest / 1e6:.3f} MB")
    for tag in sorted(imb):
        v = imb[tag]
        print(f"  imbalance {tag.split('/')[-1]}: step 1 {v[0]:.2f}, step {len(v)} {v[-1]:.2f}, "
              f"mean {statistics.mean(v):.2f}")
    print(f"  all-to-all time/step (busiest rank) {statistics.median(a2a) * 1e3:.1f} ms of a "
          f"{statistics.median(step) * 1e3:.0f} ms step ({statistics.median(a2a) / statistics.median(step):.0%})")


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(LAYOUTS.items()):
            measure(name, overrides, steps, Path(tmp) / f"run{i}")


if __name__ == "__main__":
    main()
