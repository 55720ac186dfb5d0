"""Stand-in for triton on a CPU-only machine (see ../README.md): importable by a framework's
modules that import it at their top level, never run. torch itself is told there is no triton
(ImportError when torch imports it), as on any CPU machine: torch turns on triton code paths of
its own when `import triton` succeeds."""
import sys


def _importer() -> str:
    f = sys._getframe(1)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib", "triton")):
            return name
        f = f.f_back
    return ""


if _importer().split(".")[0] == "torch":
    raise ImportError("triton stand-in (tests/framework_stubs): not for torch, which runs without triton on a CPU")

__version__ = "0.0.0"

# A framework imported first (Megatron-Core's fusions): torch has not yet probed for triton, and
# would find this stand-in when torch.compile first imports torch._dynamo and torch._inductor.
# Let torch finish those imports seeing no triton, as on any CPU machine.
if "torch._dynamo" not in sys.modules:
    _me = sys.modules[__name__]
    sys.modules[__name__] = None  # `import triton` raises ImportError meanwhile
    try:
        import torch._dynamo.repro.after_dynamo  # noqa: F401
        import torch._inductor.runtime.triton_compat  # noqa: F401
    finally:
        sys.modules[__name__] = _me

from . import language  # noqa: E402,F401


def jit(fn=None, **_):
    """@triton.jit and @triton.jit(...): the function, undecorated."""
    return fn if fn is not None else (lambda f: f)


def autotune(*_, **__):
    return lambda f: f


heuristics = autotune


class Config:
    def __init__(self, *_, **__):
        pass


def cdiv(a, b):
    return -(-a // b)


def __getattr__(name):
    """Any other name (triton.Config, triton.testing, ...): a placeholder, as in triton.language."""
    if name.startswith("__"):
        raise AttributeError(name)
    return language._Placeholder(f"triton.{name}")
