"""layout=auto speed: median time of the search for the 16,384-GPU Llama 3 405B stage
(and the 8,192-GPU one, Megatron's 1T, DeepSeek-V3 with its expert degrees and DualPipe),
in process, after composing the config once.

Run: .venv/bin/python benchmarks/search_speed.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from orchestrator import compose, make_plan

    for recipe, gpus in (("llama3_405b_16k", 16384), ("llama3_405b", 8192), ("llama3_405b_long_context", 16384),
                         ("megatron_1t", 3072), ("deepseek_v3", 2048)):
        cfg = compose([f"recipe={recipe}", "layout=auto"])
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan = make_plan(cfg)
            times.append(time.perf_counter() - t0)
        s = plan.search
        print(f"{recipe:<26} {gpus:>6} GPUs: search median {statistics.median(times):.3f} s over {len(times)} "
              f"runs, {s['candidates']} degree tuples, {s['fitting']} fit; chosen {s['top'][0]['layout']}")


if __name__ == "__main__":
    main()
