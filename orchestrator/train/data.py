"""A deterministic, seedable token stream that every layout reads the same way.

Global sample i of the stream is a fixed sequence of seq_len + 1 tokens (inputs
and next-token labels). Step t consumes samples [t*B, (t+1)*B), M = B/b micro-batches
of b samples; data-parallel rank r takes a contiguous run of them (`share`: M/dp each
when dp divides M, else the first M % dp ranks take one more) and cuts it into
micro-batches in order. The position in the stream is just the next step, so
resuming at step t under any DP degree reads exactly the samples not yet seen.

Without a file, samples are synthetic but learnable: a random start and stride
modulo the vocabulary with a little noise, all from a generator seeded by
(seed, i). With `path` (any fsspec URL), samples are read from a flat file of
uint16 or int32 tokens, wrapping around at the end.
"""
from __future__ import annotations

import numpy as np
import torch

from orchestrator.plan.split import share  # noqa: F401 (the data order's split, one definition)


class TokenSource:
    def __init__(self, vocab: int, seq_len: int, seed: int = 0, path: str | None = None, dtype: str = "uint16"):
        self.vocab, self.seq_len, self.seed, self.path = vocab, seq_len, seed, path
        self.dtype = np.dtype(dtype)
        self._n_tokens = None
        if path:
            import fsspec

            with fsspec.open(path, "rb") as f:
                f.seek(0, 2)
                self._n_tokens = f.tell() // self.dtype.itemsize
            if self._n_tokens < seq_len + 1:
                raise ValueError(f"training.data {path!r} holds {self._n_tokens} tokens, fewer than one sample "
                                 f"of seq_len + 1 = {seq_len + 1}")

    def sample(self, index: int) -> torch.Tensor:
        n = self.seq_len + 1
        if self.path:
            import fsspec

            start = (index * n) % (self._n_tokens - n + 1)
            with fsspec.open(self.path, "rb") as f:
                f.seek(start * self.dtype.itemsize)
                buf = np.frombuffer(f.read(n * self.dtype.itemsize), dtype=self.dtype)
            return torch.from_numpy(buf.astype(np.int64) % self.vocab)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(self.vocab, (1,), generator=g)
        stride = torch.randint(1, 8, (1,), generator=g)
        seq = (start + stride * torch.arange(n)) % self.vocab
        noise = torch.rand(n, generator=g) < 0.05
        return torch.where(noise, torch.randint(self.vocab, (n,), generator=g), seq)

    def indices(self, step: int, global_batch: int, dp: int, dp_rank: int, micro_batch: int = 1) -> list[int]:
        first, count = share(global_batch // micro_batch, dp, dp_rank)
        start = step * global_batch + first * micro_batch
        return list(range(start, start + count * micro_batch))

    def batch(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self.sample(i) for i in indices])

