"""triton.language stand-in (see triton/__init__.py)."""
from triton import _Anything


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything(f"triton.language.{name}")
