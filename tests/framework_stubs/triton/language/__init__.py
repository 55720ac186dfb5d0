"""Stand-in for triton.language (see ../../README.md): every name is a placeholder, so the
annotations of a kernel (`x: tl.constexpr`, `p: tl.pointer_type(tl.int64)`) evaluate; the
kernels themselves never run."""


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *_, **__):
        return _Placeholder(f"{self._name}(...)")

    def __getitem__(self, _):
        return self

    def __repr__(self):
        return f"<triton stand-in {self._name}>"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(f"triton.language.{name}")
