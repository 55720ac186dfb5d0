"""The token stream: deterministic, indexed by sample, split by DP rank, optionally from a file."""
import numpy as np
import pytest
import torch

from orchestrator.train.data import TokenSource


def test_every_layout_reads_the_same_samples():
    src = TokenSource(vocab=512, seq_len=64, seed=3)
    whole = src.indices(step=5, global_batch=16, dp=1, dp_rank=0)
    split = [i for r in range(4) for i in src.indices(step=5, global_batch=16, dp=4, dp_rank=r)]
    assert whole == split == list(range(80, 96))
    assert torch.equal(src.sample(81), TokenSource(512, 64, seed=3).sample(81))
    assert not torch.equal(src.sample(81), src.sample(82))
    assert src.sample(7).shape == (65,) and int(src.sample(7).max()) < 512


def test_tokens_from_a_file_through_fsspec(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    src = TokenSource(vocab=50000, seq_len=9, path=f"file://{path}")
    assert src.sample(0).tolist() == list(range(10))
    assert src.sample(3).tolist() == list(range(30, 40))
    assert src.batch([1, 2]).shape == (2, 10)
    with pytest.raises(ValueError, match="fewer than one sample"):
        TokenSource(vocab=100, seq_len=5000, path=str(path))
