"""The three large recipes' re-plan after one node is lost: before (the batch split evenly,
failover.batch_policy=even: the old rule) and after (every whole surviving replica, the
global batch split unevenly: batch_policy=keep, the default).

Run: .venv/bin/python benchmarks/replan_whole.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import compose, make_plan  # noqa: E402
from orchestrator.plan.replan import replan_on_survivors  # noqa: E402


def row(name: str, rp) -> str:
    if rp.plan is None:
        return f"  {name:<6} nothing goes on: {rp.problems[-1]}"
    lay, tr = rp.plan.layout, rp.spec.training
    return (f"  {name:<6} {rp.nodes:>5} nodes, dp {lay.dp:>3}, global batch {tr.global_batch}, {lay.microbatches} "
            f"micro-batches (slowest), step {rp.plan.step.wall_s:.2f} s, {rp.spare_gpus} healthy GPUs idle, "
            f"{tr.global_batch * tr.seq_len / rp.plan.step.wall_s / 1e6:.2f} M tok/s")


def main() -> None:
    for recipe in ("llama3_405b", "llama3_405b_16k", "megatron_1t"):
        plan = make_plan(compose([f"recipe={recipe}", "launcher=dry"]))
        sp = plan.spec
        tok = sp.training.global_batch * sp.training.seq_len / plan.step.wall_s / 1e6
        print(f"{recipe}: {sp.cluster.nodes} nodes, {plan.layout.label()}, global batch {sp.training.global_batch}, "
              f"step {plan.step.wall_s:.2f} s, {tok:.2f} M tok/s; one node lost:")
        even = make_plan(compose([f"recipe={recipe}", "launcher=dry", "failover.batch_policy=even"]))
        print(row("before", replan_on_survivors(even, sp.cluster.nodes - 1)))
        print(row("after", replan_on_survivors(plan, sp.cluster.nodes - 1)))


if __name__ == "__main__":
    main()
