"""The GPU path on one GPU: the tiny model and a reduced Llama-3-8B shape (2 of its 32
layers, seq 2048) in bf16 with CUDA + NCCL (world 1; host scalars over the cpu:gloo side
backend), trained for a few steps by the real launcher; prints the plan's predicted step
against the measured median. Without CUDA it says no GPU is present and exits 0.

Run: .venv/bin/python benchmarks/gpu_path.py [hardware preset, default h100_sxm]
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "tiny": ["model=tiny", "training.seq_len=256", "training.global_batch=8"],
    "llama3_8b (2 layers)": ["model=llama3_8b", "model.layers=2", "training.seq_len=2048",
                             "training.global_batch=4", "training.micro_batch=1"],
}


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no GPU present (torch.cuda.is_available() is False): the GPU path was not run")
        return 0
    hardware = sys.argv[1] if len(sys.argv) > 1 else "h100_sxm"
    print(f"GPU: {torch.cuda.get_device_name(0)}; planned as hardware={hardware}")
    for name, extra in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            r = subprocess.run([sys.executable, "-m", "orchestrator", f"hardware={hardware}", "cluster.nodes=1",
                                "hardware.gpus_per_node=1", "training.precision=bf16", "training.steps=12",
                                "launcher=local", "figures=false", *extra, f"hydra.run.dir={run}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=900)
            if r.returncode:
                print(f"{name}: FAILED (exit {r.returncode})\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
                continue
            predicted = json.loads((run / "plan.json").read_text())["step"]["wall_s"]
            steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            measured = statistics.median(s["step_time_s"] for s in steps[2:])
            print(f"{name}: predicted {predicted * 1e3:.2f} ms/step, measured {measured * 1e3:.2f} ms/step "
                  f"(median of {len(steps) - 2}), ratio {measured / predicted:.2f}; final loss {steps[-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
