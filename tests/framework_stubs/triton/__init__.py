"""A stand-in for triton on a machine without a GPU: enough for a framework module that uses
triton at import time (decorators, constexpr annotations) to import; no kernel can run."""
from __future__ import annotations

import sys

__version__ = "0.0.0+stub"

# torch probes for triton when torch.compile first runs (torch._dynamo, its debugging backends,
# torch._inductor) and takes its triton code paths if it imports: let torch finish those
# imports seeing no triton.
if "torch._dynamo" not in sys.modules:
    _me = sys.modules[__name__]
    sys.modules[__name__] = None  # `import triton` raises ImportError meanwhile
    try:
        import torch._dynamo.repro.after_dynamo  # noqa: F401
        import torch._inductor.runtime.triton_compat  # noqa: F401
    finally:
        sys.modules[__name__] = _me


class _Anything:
    """Any attribute, call, decorator or subscript: itself (a decorator returns what it wraps)."""

    def __init__(self, name: str = "triton"):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return self  # @triton.autotune(...), triton.Config(...)

    def __getitem__(self, item):
        return self

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything(f"triton.{name}")
