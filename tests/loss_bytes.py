"""Run as a script beside megatron-core (tests/frameworks.py env): the HBM traffic of the loss over
the vocabulary, forward and backward, from the bf16 logits to the bf16 gradient the output layer's
backward takes, for each implementation plan/kernels.LOSSES prices, counted on the stacks'
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
fresh tensors they write. With the traffic, the most logit-sized memory alive at once (bytes per
logit), from the bf16 logits the output layer hands the loss (dropped once the forward returns, as
the model's forward does) to the bf16 gradient it takes back: each logit-sized storage from the op
or fused region that makes it until it is freed. Prints one JSON object: per implementation, 2-byte
units per logit and "<impl>_peak_bytes"; for the compiled loss, whose buffers Inductor allocates out of
sight, the logit-sized tensors it saves for the backward ("inductor_saved_bytes")."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_bytes import Count, _bytes, _tensors  # noqa: E402
from live_bytes import Storages  # noqa: E402

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
        self.storages = Storages(min_elements=TOKENS * VOCAB)  # the logit-sized ones alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func._opname}"
        if self.paused:
            return func(*args, **(kwargs or {}))
        if name in INDEXED:
            ins = {id(t) for t in _tensors((args, kwargs or {}))}
            result = func(*args, **(kwargs or {}))
            self.indexed += _bytes([t for t in _tensors(result) if t.dim() > 0 and id(t) not in ins])
        else:
            result = super().__torch_dispatch__(func, types, args, kwargs)
        self.storages.note(result, name)
        return result

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
            self.storages.note(out, fn.__name__)
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


def counted(loss_of) -> tuple[float, float]:
    """Forward and backward of `loss_of(logits, labels)` -> per-token losses, under a LossCount: the
    traffic (2-byte units per logit) and the peak of logit-sized memory (bytes per logit)."""
    leaf, labels = _data()
    mode = LossCount()
    with mode:
        logits = leaf.clone()  # the output layer's bf16 logits: a fresh tensor the loss is handed
        loss = loss_of(logits, labels, mode)
        del logits  # the model's forward returns: only what the loss saved stays
        # Megatron's per-token losses take a per-token gradient (its loss mask); torch's is the mean
        loss.backward(torch.ones_like(loss) / loss.numel() if loss.dim() else None)
    assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16
    clone = 2 * TOKENS * VOCAB * 2  # the clone's read and write are the test's, not the loss's
    return units(mode.total() - clone), mode.storages.peak / (TOKENS * VOCAB)


def torch_loss(logits, labels, mode=None):
    """torchtitan's cross_entropy_loss (torchtitan/components/loss.py): the mean over the tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def torch_parallel_loss():
    """torch's vocabulary-parallel loss (torch.distributed.tensor.parallel.loss_parallel: torchtitan's and
    this runtime's loss wherever TP > 1), on a tensor-parallel group of one. Its DTensor handlers run
    local kernels out of this mode's sight, so the local functions they call are run here in their place,
    as autograd calls them: forward, _log_softmax (the fp32 logits in) then _nll_loss_forward on its
    result; backward, _nll_loss_and_log_softmax_backward on that saved result (the log_softmax backward
    handler only casts, to fp32 from fp32: nothing)."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss as lp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    mean = 1  # torch's Reduction.MEAN, F.cross_entropy's default

    class LossParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, target):
            res = lp._log_softmax(x, 1, False, mesh, 0)
            loss, total = lp._nll_loss_forward(res, target, None, None, mean, -100, res.shape, 1, mesh, 0)
            ctx.save_for_backward(res, target, total)
            return loss

        @staticmethod
        def backward(ctx, grad):
            res, target, total = ctx.saved_tensors
            return lp._nll_loss_and_log_softmax_backward(grad, res, target, None, mean, -100, total, res.shape, 1,
                                                         mesh, 0), None

    def loss(logits, labels, mode=None):
        return LossParallel.apply(logits.flatten(0, 1).float(), labels.flatten(0, 1))
    return loss


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


def inductor() -> tuple[float, float]:
    import torch._inductor.scheduler as sched

    sizes: list[int] = []
    codegen = sched.Scheduler.codegen

    def counting(self):
        sizes.append(sum(n.get_read_write_buffers_sizes() for n in self.nodes))
        return codegen(self)
    sched.Scheduler.codegen = counting
    logits, labels = _data()
    saved: list[int] = []

    def pack(t):
        if t.numel() >= TOKENS * VOCAB:
            saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.compile(torch_loss)(logits, labels)
    loss.backward()
    assert len(sizes) == 2, f"expected a forward and a backward graph, Inductor compiled {len(sizes)}"
    return units(sum(sizes)), sum(saved) / (TOKENS * VOCAB)


def main() -> None:
    out = {}
    try:
        impls = {"torch": torch_loss, "megatron": megatron_loss(False), "megatron_fused": megatron_loss(True)}
    except ImportError as e:  # run without megatron-core on the path
        out["megatron_error"] = str(e)
        impls = {"torch": torch_loss}
    impls["torch_parallel"] = torch_parallel_loss()
    for impl, loss_of in impls.items():
        out[impl], out[impl + "_peak_bytes"] = counted(loss_of)
    out["inductor"], out["inductor_saved_bytes"] = inductor()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
