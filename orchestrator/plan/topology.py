"""Rank placement: one rule builds every group of every axis from an order string.

As in Megatron-Core's RankGenerator, the order lists the axes innermost first.
The innermost axis owns consecutive ranks, which share a node. A rank's
coordinate on an axis is (rank // stride) % size, where the stride is the
product of the sizes of the axes inside it; a group of an axis is every rank
that agrees on all other coordinates. The same rule serves any order, and any
grid: the dense one (tp, cp, dp, pp) and the expert one (etp, ep, edp, pp) are
two grids over the same ranks from one order string (plan/layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

ORDER_AXES = ("tp", "cp", "ep", "dp", "pp")  # the tokens of an order string (Megatron's default order)


class OrderError(ValueError):
    pass


def parse_order(order) -> list[str] | None:
    """`auto` -> None; a list or a 'tp-cp-ep-dp-pp' string -> innermost-first axes."""
    if order is None or (isinstance(order, str) and order.strip().lower() == "auto"):
        return None
    if isinstance(order, str):
        items = [x.strip().lower() for x in order.replace(",", "-").replace(" ", "-").split("-") if x.strip()]
    elif isinstance(order, (list, tuple)):
        items = [str(x).strip().lower() for x in order]
    else:
        raise OrderError(f"must be 'auto', a list of axis names or a 'tp-cp-ep-dp-pp' string, got {type(order).__name__}")
    unknown = [f"[{i}]={x!r}" for i, x in enumerate(items) if x not in ORDER_AXES]
    if unknown:
        raise OrderError(f"{', '.join(unknown)}: not an axis name; use the names {list(ORDER_AXES)}")
    twice = [f"[{i}]={x!r}" for i, x in enumerate(items) if x in items[:i]]
    if twice:
        raise OrderError(f"{', '.join(twice)}: named before (each axis once)")
    # Axes left out (size 1, or ep for a dense model) go outermost, in canonical order.
    return items + [a for a in ORDER_AXES if a not in items]


@dataclass(frozen=True)
class Tier:
    name: str
    size: int  # GPUs per block; a group within one block uses this tier
    gbps: float  # bandwidth per GPU, GB/s
    latency_us: float


def tiers_for(spec) -> list[Tier]:
    """NVLink inside the NVLink domain (a node, or the fabric's: 72 GPUs on an NVL72), then the
    fabric's tiers (rack, pod, cluster; the hardware preset's when the fabric names none),
    or one flat network."""
    hw, fabric = spec.hardware, spec.fabric
    out = [Tier("nvlink", fabric.nvlink_domain or hw.gpus_per_node, hw.intra_node_gbps, hw.intra_node_latency_us)]
    for t in sorted(fabric.tiers or hw.tiers, key=lambda t: t.size):
        bw = (t.gbps if t.gbps is not None else hw.inter_node_gbps) / max(t.oversubscription, 1e-9)
        out.append(Tier(t.name, t.size, bw, t.latency_us))
    if len(out) == 1:
        out.append(Tier("network", 1 << 62, hw.inter_node_gbps, hw.inter_node_latency_us))
    return out


class RankGrid:
    """Sizes per axis and an innermost-first order -> coordinates and groups."""

    def __init__(self, sizes: dict[str, int], order: list[str]):
        self.order = list(order)
        self.sizes = {a: int(sizes.get(a, 1)) for a in self.order}
        self.strides: dict[str, int] = {}
        s = 1
        for a in self.order:
            self.strides[a] = s
            s *= self.sizes[a]
        self.world = s

    def coords(self, rank: int) -> dict[str, int]:
        return {a: (rank // self.strides[a]) % self.sizes[a] for a in self.order}

    def rank(self, coords: dict[str, int]) -> int:
        return sum(coords.get(a, 0) * self.strides[a] for a in self.order)

    @cached_property
    def _cube(self) -> np.ndarray:
        # C order: the outermost axis first, so the innermost axis is the last dimension.
        shape = [self.sizes[a] for a in reversed(self.order)]
        return np.arange(self.world, dtype=np.int64).reshape(shape)

    def ranks_cube(self) -> np.ndarray:
        """Every rank, indexed by coordinates outermost axis first."""
        return self._cube

    def groups(self, axes) -> np.ndarray:
        """Every group of the given axis (or axes, flattened): shape [n_groups, group_size].

        Within a group, members are ordered by the given axes, first axis fastest.
        """
        axes = [axes] if isinstance(axes, str) else list(axes)
        dims = list(reversed(self.order))  # dimension index of each axis in the cube
        moved = [dims.index(a) for a in reversed(axes)]
        rest = [i for i in range(len(dims)) if i not in moved]
        size = int(np.prod([self.sizes[a] for a in axes])) if axes else 1
        return np.transpose(self._cube, rest + moved).reshape(-1, size)

    def group_of(self, rank: int, axes) -> list[int]:
        g = self.groups(axes)
        row = np.nonzero((g == rank).any(axis=1))[0][0]
        return g[row].tolist()

    def tier_of(self, axes, tiers: list[Tier]) -> Tier:
        """The smallest tier whose blocks hold every group of these axes whole."""
        g = self.groups(axes)
        if g.shape[1] == 1:
            return tiers[0]
        lo, hi = g.min(axis=1), g.max(axis=1)
        for t in tiers:
            if np.all(lo // t.size == hi // t.size):
                return t
        return tiers[-1]

    def straddling(self, axes, block: int) -> np.ndarray:
        """Boolean per group: does it span more than one block (node) of `block` ranks?"""
        g = self.groups(axes)
        return (g // block).min(axis=1) != (g // block).max(axis=1)

    def to_json(self) -> dict:
        return {
            "order": self.order,
            "sizes": {a: self.sizes[a] for a in self.order},
            "strides": self.strides,
            "rule": "coord[a] = (rank // strides[a]) % sizes[a]; rank = sum(coord[a] * strides[a])",
        }
