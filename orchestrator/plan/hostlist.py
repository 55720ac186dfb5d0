"""SLURM hostlist expressions: `node[1-4,7],gpu[01-02]-ib,login` -> host names. Torch-free.

As SLURM writes them (scontrol show hostnames): comma-separated items; an item may hold
several bracket groups (`r[1-2]n[1-2]`: every combination, the last group fastest); a
range keeps the zero padding of its lower bound (`[08-10]` -> 08 09 10).
"""
from __future__ import annotations

import re

MAX_HOSTS = 1 << 20  # a typo such as node[1-100000000] fails here, not in memory
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    pass


def _split_top(expr: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            if depth:
                raise HostlistError(f"nested '[' in {expr!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(f"unmatched ']' in {expr!r}")
            depth = 0
        if ch == "," and not depth:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"unclosed '[' in {expr!r}")
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _expand_range(body: str, expr: str) -> list[str]:
    out = []
    for part in body.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise HostlistError(f"{part!r} in {expr!r} is not a number or a range lo-hi")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"range {part!r} in {expr!r} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise HostlistError(f"range {part!r} in {expr!r} names more than {MAX_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def _expand_item(item: str, expr: str) -> list[str]:
    names = [""]
    for text, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        names = [n + text for n in names]
        if body:
            names = [n + v for n in names for v in _expand_range(body, expr)]
        if len(names) > MAX_HOSTS:
            raise HostlistError(f"{expr!r} names more than {MAX_HOSTS} hosts")
    return names


def expand(expr: str | list | tuple | None) -> list[str]:
    """Every host an expression names, in its order (duplicates kept out, first one wins)."""
    if expr is None:
        return []
    if isinstance(expr, (list, tuple)):
        parts = [str(x) for x in expr]
    else:
        parts = [str(expr)]
    seen: dict[str, None] = {}
    for p in parts:
        for item in _split_top(p.replace(" ", ",").replace("\n", ",")):
            for name in _expand_item(item, p):
                seen.setdefault(name, None)
    return list(seen)


_NUMBERED = re.compile(r"^(.*?)(\d+)([^\d]*)$")


def compress(names: list[str]) -> str:
    """The shortest-form hostlist expression of `names`, in their order: consecutive names that
    differ only in their last number share one bracket (node0001..node1024 -> node[0001-1024]);
    `expand` gives the names back."""
    items: list[list] = []  # [prefix, suffix, [[lo_text, hi_int, width]]] or [name]
    for name in names:
        m = _NUMBERED.match(name)
        if not m or any(c in name for c in "[],"):
            items.append([name])
            continue
        pre, digits, suf = m.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        n = int(digits)
        last = items[-1] if items else None
        if last is not None and len(last) == 3 and last[:2] == [pre, suf]:
            run = last[2][-1]
            if n == run[1] + 1 and str(n).zfill(run[2]) == digits:
                run[1] = n
            else:
                last[2].append([digits, n, width])
            continue
        items.append([pre, suf, [[digits, n, width]]])
    out = []
    for it in items:
        if len(it) == 1:
            out.append(it[0])
            continue
        pre, suf, runs = it
        parts = [lo if int(lo) == hi else f"{lo}-{str(hi).zfill(w)}" for lo, hi, w in runs]
        out.append(f"{pre}{parts[0]}{suf}" if len(parts) == 1 and "-" not in parts[0]
                   else f"{pre}[{','.join(parts)}]{suf}")
    return ",".join(out)


def natural_key(name: str) -> tuple:
    """node2 before node10."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))
