"""Run as a script beside megatron-core (tests/frameworks.py env): the HBM traffic of the loss over
the vocabulary, forward and backward, from the bf16 logits to the bf16 gradient the output layer's
backward takes, for each implementation plan/kernels.LOSS_ELEMENTS prices, counted on the stacks'
own code on this CPU:
- torch: F.cross_entropy(logits.float()) in eager (torchtitan's cross_entropy_loss, this runtime's
  loss_fn), op by op under a TorchDispatchMode (tests/fsdp2_bytes.Count: the tensors each op reads
  and writes);
- megatron: megatron-core's vocab_parallel_cross_entropy (tensor_parallel/cross_entropy.py), the
  same way, on a tensor-parallel group of one;
- megatron_fused: its fused_vocab_parallel_cross_entropy (fusions/fused_cross_entropy.py), whose
  four regions run under Megatron's jit_fuser: each region counted as one fused kernel, what it
  reads and writes (its tensor arguments and results), the ops outside them op by op;
- inductor: the torch loss through torch.compile, the bytes Inductor's scheduler says its fused
  kernels read and write (Scheduler nodes' get_read_write_buffers_sizes; caches off so it compiles).
Ops that index a few elements of a logit-sized tensor (nll_loss, index, index_put_) count only the
fresh tensors they write. Prints one JSON object: per implementation, 2-byte units per logit."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_bytes import Count, _bytes, _tensors  # noqa: E402

TOKENS, VOCAB = 64, 4096
INDEXED = {"aten.nll_loss_forward", "aten.nll_loss_backward", "aten.index", "aten.index_put_", "aten.index_put"}
VIEWS = {"aten.view", "aten._unsafe_view", "aten.transpose", "aten.t", "aten.expand", "aten.as_strided",
         "aten.unsqueeze", "aten.squeeze", "aten.reshape", "aten.split", "aten.split_with_sizes", "aten.slice",
         "aten.select", "aten.alias", "aten.detach", "aten.lift_fresh", "aten.view_as"}


class LossCount(Count):
    """Count's reads and writes, but for indexing ops (only the fresh tensors they write), views (none)
    and while a fused region runs (the region is counted as a whole)."""

    def __init__(self):
        super().__init__(lambda name: name not in VIEWS)
        self.paused = False
        self.indexed = 0
        self.regions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func._opname}"
        if self.paused:
            return func(*args, **(kwargs or {}))
        if name in INDEXED:
            ins = {id(t) for t in _tensors((args, kwargs or {}))}
            result = func(*args, **(kwargs or {}))
            self.indexed += _bytes([t for t in _tensors(result) if t.dim() > 0 and id(t) not in ins])
            return result
        return super().__torch_dispatch__(func, types, args, kwargs)

    def region(self, fn):
        """A fused kernel: reads its tensor arguments, writes its results (in-place ones too)."""
        def run(*args, **kwargs):
            reads = [t for t in _tensors((args, kwargs)) if t.dim() > 0]
            self.paused = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self.paused = False
            self.regions += _bytes(list({id(t): t for t in reads}.values()))
            self.regions += _bytes([t for t in _tensors(out) if t.dim() > 0])
            return out
        return run

    def total(self) -> int:
        return sum(o["read_bytes"] + o["write_bytes"] for o in self.ops.values()) + self.indexed + self.regions


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, 1, VOCAB, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS, 1), generator=g)
    return logits, labels


def units(nbytes: int) -> float:
    return nbytes / (TOKENS * VOCAB * 2)


def counted(loss_of) -> float:
    """Forward and backward of `loss_of(logits, labels)` -> per-token losses, under a LossCount."""
    logits, labels = _data()
    mode = LossCount()
    with mode:
        loss = loss_of(logits, labels, mode)
        # Megatron's per-token losses take a per-token gradient (its loss mask); torch's is the mean
        loss.backward(torch.ones_like(loss) / loss.numel() if loss.dim() else None)
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    return units(mode.total())


def torch_loss(logits, labels, mode=None):
    """torchtitan's cross_entropy_loss (torchtitan/components/loss.py): the mean over the tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def megatron_loss(fused: bool):
    import megatron.core.jit as jit
    import torch.distributed as dist

    class One:  # a tensor-parallel group of one rank
        def rank(self):
            return 0

        def size(self):
            return 1

    dist.all_reduce = lambda tensor, *a, **k: None  # over one rank, the identity
    if not fused:
        from megatron.core.tensor_parallel import cross_entropy as ce

        ce.get_tensor_model_parallel_group = lambda: One()
        ce.get_tensor_model_parallel_rank = lambda: 0
        ce.get_tensor_model_parallel_world_size = lambda: 1
        return lambda logits, labels, mode: ce.vocab_parallel_cross_entropy(logits, labels)

    holder = {}
    jit.jit_fuser = lambda fn: (lambda *a, **k: holder["mode"].region(fn)(*a, **k))
    from megatron.core.fusions import fused_cross_entropy as fce

    def loss(logits, labels, mode):
        holder["mode"] = mode
        return fce.fused_vocab_parallel_cross_entropy(logits, labels, One())
    return loss


def inductor() -> float:
    import torch._inductor.scheduler as sched

    sizes: list[int] = []
    codegen = sched.Scheduler.codegen

    def counting(self):
        sizes.append(sum(n.get_read_write_buffers_sizes() for n in self.nodes))
        return codegen(self)
    sched.Scheduler.codegen = counting
    logits, labels = _data()
    torch.compile(torch_loss)(logits, labels).backward()
    assert len(sizes) == 2, f"expected a forward and a backward graph, Inductor compiled {len(sizes)}"
    return units(sum(sizes))


def main() -> None:
    out = {"torch": counted(torch_loss)}
    try:
        out["megatron"] = counted(megatron_loss(False))
        out["megatron_fused"] = counted(megatron_loss(True))
    except ImportError as e:  # run without megatron-core on the path
        out["megatron_error"] = str(e)
    out["inductor"] = inductor()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
