"""Which storages are alive, for the counting scripts (tests/loss_bytes.py, tests/torchtitan_act_bytes.py):
each storage an op makes is noted from the op that makes it until it is freed (StorageWeakRef); views share
their base's storage, so nothing is counted twice; a freed storage's address taken again is a new one."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves


class Storages:
    """Storages made by ops (not those made `outside`: weights, inputs), of `min_elements` or more
    elements, alive now; the most alive at once since `reset`."""

    def __init__(self, outside=(), min_elements: int = 0):
        self.outside = {t.untyped_storage().data_ptr() for t in outside}
        self.min_elements = min_elements
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.peak = 0

    def alive(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(v[1] for v in self.live.values())

    def reset(self) -> None:
        self.peak = self.alive()

    def note(self, out, made_by: str = "") -> None:
        """The storages of the tensors in `out`, just made by `made_by`; the peak updated."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() >= self.min_elements:
                st = t.untyped_storage()
                old = self.live.get(st.data_ptr())
                if st.nbytes() and st.data_ptr() not in self.outside and (old is None or old[0].expired()):
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), f"{made_by} {tuple(t.shape)} {t.dtype}")
        self.peak = max(self.peak, self.alive())
