"""The resolved layout: one small class owns the degrees (as torchtitan's ParallelDims does).

Degrees, the batch split, the pipeline stages and the schedule, and the two rank grids
built from one order string as Megatron-Core builds them:

- the dense grid (tp, cp, dp, pp; ep has size 1 there) carries attention, dense MLPs,
  embeddings, and the data-parallel (FSDP/ZeRO) group dp x cp;
- the expert grid (etp in tp's slot, ep, edp in dp's slot, pp; cp has size 1 there)
  carries the routed experts: all-to-all inside an ep group, expert gradients reduced
  over edp = world / (etp x ep x pp).

Both grids share the order and the pipeline groups, so expert parallelism folds in
context and data parallelism (Megatron-Core, torchtitan) rather than only data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.config.schedules import ScheduleSpec
from orchestrator.plan.topology import RankGrid

EXPERT_NAMES = {"tp": "etp", "dp": "edp"}  # an order token -> its axis in the expert grid


def layout_label(tp: int, cp: int, pp: int, dp: int, ep: int = 1, etp: int | None = None, vp: int = 1) -> str:
    """"TP8 CP1 PP16 DP64" (+ EP, ETP, VP where they are not trivial): the one spelling of a layout."""
    out = f"TP{tp} CP{cp} PP{pp} DP{dp}"
    if ep > 1:
        out += f" EP{ep}" + (f" ETP{etp}" if etp not in (None, tp) else "")
    return out + (f" VP{vp}" if vp > 1 else "")


@dataclass
class Layout:
    world: int
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    etp: int
    vp: int
    zero: int
    dp_shard: int  # ranks sharding one copy of the model state (FSDP/ZeRO); dp / dp_shard copies
    micro_batch: int
    microbatches: int
    stage_layers: list[int]  # layers per pipeline rank
    schedule: ScheduleSpec
    order: list[str] | None  # innermost first; None = auto (chosen from the traffic)
    experts: int = 0  # routed experts of the model; 0 = dense (the expert grid carries nothing)
    pipeline_rules: str = "torch"  # whose rules the layout was validated under (stack.pipeline_rules)
    # Transformer layers of every virtual stage in pipeline order, where the stack sets them
    # itself (stack.pipeline_accounting: the embedding and the loss take a layer's place each)
    chunk_layers: list[int] | None = None

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks that hold the same experts."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def dp_replicate(self) -> int:
        """Whole copies of the model state (HSDP's replicate dimension)."""
        return self.dp // self.dp_shard

    @property
    def chunks(self) -> int:
        """Model chunks (virtual stages) per pipeline rank."""
        return self.schedule.chunks(self.vp)

    @property
    def replica(self) -> int:
        """GPUs that must all be alive together: a dense replica, widened to whole expert groups."""
        return self.pp * math.lcm(self.tp * self.cp, self.etp * self.ep)

    def label(self) -> str:
        return layout_label(self.tp, self.cp, self.pp, self.dp, self.ep, self.etp, self.vp)

    def dense_grid(self, order: list[str]) -> RankGrid:
        return RankGrid({"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}, order)

    def expert_grid(self, order: list[str]) -> RankGrid:
        sizes = {"etp": self.etp, "cp": 1, "ep": self.ep, "edp": self.edp, "pp": self.pp}
        return RankGrid(sizes, [EXPERT_NAMES.get(a, a) for a in order])

    def virtual_stages(self) -> list[tuple[int, int]]:
        """Layer ranges [start, end) of every virtual stage, in pipeline order: each rank's
        layers split as evenly as possible over its chunks, placed by the schedule."""
        pp, n = self.pp, self.chunks
        sizes = list(self.chunk_layers or [])
        for j in range(pp * n if not sizes else 0):
            r = self.schedule.rank_of_stage(j, pp)
            k = self.schedule.stages_of_rank(r, pp, self.vp).index(j)
            layers = self.stage_layers[r]
            sizes.append(layers // n + (1 if k < layers % n else 0))
        out, start = [], 0
        for size in sizes:
            out.append((start, start + size))
            start += size
        return out

    def to_json(self, order: list[str]) -> dict:
        ranges = self.virtual_stages()
        last = len(ranges) - 1
        return {
            "tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "etp": self.etp,
            "edp": self.edp, "vp": self.vp, "zero": self.zero, "dp_shard": self.dp_shard,
            "dp_replicate": self.dp_replicate, "order": order, "microbatches": self.microbatches,
            "micro_batch": self.micro_batch, "stage_layers": self.stage_layers, "schedule": self.schedule.name,
            "pipeline_rules": self.pipeline_rules,
            "label": self.label(),
            # What each pipeline rank runs, so the runtime derives nothing.
            "stages": [{"pp_rank": r, "virtual": [
                {"stage": j, "layers": list(ranges[j]), "first": j == 0, "last": j == last}
                for j in self.schedule.stages_of_rank(r, self.pp, self.vp)]} for r in range(self.pp)],
            "num_stages": len(ranges),
        }
