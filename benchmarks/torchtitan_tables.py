"""Predicted against published throughput for torchtitan's own benchmark tables, validation only
(nothing here is fitted): pytorch/torchtitan@31a17bf benchmarks/llama3_h100_202412_torchtitan.md,
Llama 3.1 8B on H100 (96 GB HBM2e, 2.4 TB/s, capped at 500 W), Tables 1-3.

Columns: the planner with the torchtitan stack as it runs (eager elementwise unless
torch.compile, FlashAttention-2 through SDPA: plan/kernels.py) and with both fused (what the
planner assumed before, as for Megatron/TE). The 500 W power cap is not modelled: the GPU's
GEMM ceiling is the fitted H100 SXM one, so every row keeps an over-prediction of that order.

Run: .venv/bin/python benchmarks/torchtitan_tables.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H100_GT = ["hardware=h100_sxm", "hardware.gpu_memory_gb=96", "hardware.hbm_gbps=2400", "stack=torchtitan",
           "model=llama3_8b", "layout.tp=1"]
FSDP_8B = ["training.seq_len=8192", "training.micro_batch=2", "training.recompute=selective"]
COMPILE = ["stack.fused_elementwise=true"]


def cases() -> list[tuple[str, list[str], int]]:
    out = [("T1 FSDP8 eager", ["cluster.nodes=1", "layout.dp=8", "training.global_batch=16", *FSDP_8B], 5762),
           ("T1 FSDP8 compile", ["cluster.nodes=1", "layout.dp=8", "training.global_batch=16", *FSDP_8B, *COMPILE],
            6667),
           ("T3 FSDP128 eager", ["cluster.nodes=16", "layout.dp=128", "training.global_batch=256", *FSDP_8B], 5605),
           ("T3 FSDP128 compile", ["cluster.nodes=16", "layout.dp=128", "training.global_batch=256", *FSDP_8B,
                                   *COMPILE], 6514),
           ("T3 FSDP128 compile+fp8", ["cluster.nodes=16", "layout.dp=128", "training.global_batch=256", *FSDP_8B,
                                       *COMPILE, "training.precision=fp8"], 8380)]
    for cp, seq, tps in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548)):
        out.append((f"T2 CP{cp} {seq // 1024}K compile+fp8",
                    ["cluster.nodes=1", f"layout.dp={8 // cp}", f"layout.cp={cp}", f"training.seq_len={seq}",
                     f"training.global_batch={8 // cp}", "training.micro_batch=1", "training.recompute=full",
                     "training.precision=fp8", *COMPILE], tps))
    return out


def main() -> None:
    from orchestrator import compose, make_plan

    print(f"{'row':<26} {'published':>9} | {'as torchtitan runs':>18} {'ratio':>5} | {'all fused':>9} {'ratio':>5}"
          "   (tokens/s per GPU)")
    for name, ov, tps in cases():
        got = []
        for extra in ([], ["stack.fused_elementwise=true", "stack.attention_kernel=fused"]):
            p = make_plan(compose(H100_GT + ov + extra))
            got.append(p.tokens_per_s / p.world_size if p.valid else None)
        cells = " | ".join(f"{g:>9.0f} {g / tps:5.2f}" if g else f"{'refused':>9} {'':>5}" for g in got)
        print(f"{name:<26} {tps:>9} | {cells.replace(' | ', '          | ', 1)}")


if __name__ == "__main__":
    main()
