"""The shape of the code: import cycles, imports against the layers, long files and functions,
and how many files adding a trainer, a launcher or a schedule touches.

Layers run one way: config/rundir -> plan -> report/published -> launch/train, and the CLI
sits on top. Lazy
imports inside functions count too (they are how cycles hide).

Run: .venv/bin/python benchmarks/code_shape.py [--root orchestrator]
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lower number = lower layer. `rundir` (the run directory's files) and `config` sit under the
# planner; `report` (plan.md, the figures) and `published` (the published-runs harness) read
# plans; `launch` and `train` share a level: launch starts train as a separate program (or
# inside a SLURM task), train never imports launch. `frameworks` (a plan rendered as another
# program's command line: torchtitan, Megatron-LM) sits beside the planner, whose validation asks it.
LAYER = {"rundir": 0, "config": 0, "plan": 1, "frameworks": 1, "report": 2, "published": 2, "launch": 3, "train": 3,
         "runtime": 4, "measure": 4, "probe": 4, "cli": 4, "__main__": 4, "__init__": 4}


def modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = f
    return out


def imports(f: Path, name: str) -> list[str]:
    """Every orchestrator module this file imports (module level or inside functions)."""
    out = []
    pkg_parts = name.split(".")
    for n in ast.walk(ast.parse(f.read_text())):
        if isinstance(n, ast.Import):
            out += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level:  # relative
                base = pkg_parts[: len(pkg_parts) - n.level + (1 if f.name == "__init__.py" else 0)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in n.names]
    return [m for m in out if m.startswith("orchestrator")]


def layer_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph(pkg: Path) -> dict[str, set[str]]:
    mods = modules(pkg)
    g = {}
    for name, f in mods.items():
        g[name] = {m for m in imports(f, name) if m in mods and m != name}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, i = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def upward(g: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer to a higher one (and train -> launch)."""
    bad = []
    for a, deps in g.items():
        la = layer_of(a)
        for b in deps:
            lb = layer_of(b)
            if la == lb or lb == "__init__":
                continue
            if LAYER.get(lb, 0) > LAYER.get(la, 0) or (la, lb) == ("train", "launch"):
                bad.append(f"{a} -> {b}")
    return sorted(bad)


def long_functions(pkg: Path, limit: int) -> list[tuple[str, int]]:
    out = []
    for f in sorted(pkg.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = n.end_lineno - n.lineno + 1
                if length > limit:
                    out.append((f"{f.relative_to(pkg.parent)}:{n.name}", length))
    return sorted(out, key=lambda x: -x[1])


# What adding one more of a kind touches, found from an existing one of that kind: the files
# that spell it where the code enumerates its kind (an enum member `Enum.name`; the name as a
# string compared, used as a dict key, registered as a call's first argument or an enum
# value), plus its own preset or module (conf/<group>/<name>.yaml, <dir>/<name>.py).
KINDS = {  # kind: (an existing one, its enum, the folders its own files live in)
    "trainer": ("torchtitan", "TrainerName", ("conf/trainer", "orchestrator/plan")),
    "launcher": ("local", "LauncherName", ("orchestrator/launch",)),
    "schedule": ("interleaved_1f1b", "Schedule", ()),
}


def _spells(tree: ast.AST, name: str, enum: str) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Name) and n.value.id == enum:
            return True
        if isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == name
                                              for c in [n.left, *n.comparators]):
            return True
        if isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == name for k in n.keys):
            return True
        if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == name:
            return True
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value == name and \
                any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return True
    return False


def touched_by(kind: str, root: Path = ROOT) -> list[str]:
    """The files that adding one more `kind` touches (tests not counted)."""
    name, enum, own = KINDS[kind]
    out = set()
    for f in sorted((root / "orchestrator").rglob("*.py")):
        if _spells(ast.parse(f.read_text()), name, enum):
            out.add(str(f.relative_to(root)))
    for d in own:
        for f in (root / d).glob(f"{name}.*"):
            out.add(str(f.relative_to(root)))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(ROOT / "orchestrator"))
    args = ap.parse_args()
    pkg = Path(args.root)
    g = graph(pkg)
    cyc, up = cycles(g), upward(g)
    print(f"modules: {len(g)}; import cycles: {len(cyc)}; imports against the layers: {len(up)}")
    for c in cyc:
        print("  cycle:", " <-> ".join(c))
    for u in up:
        print("  upward:", u)
    files = [(str(f.relative_to(pkg.parent)), len(f.read_text().splitlines())) for f in sorted(pkg.rglob("*.py"))]
    big = [(f, n) for f, n in files if n > 300]
    print(f"files over 300 lines: {len(big)}")
    for f, n in big:
        print(f"  {f}: {n}")
    fns = long_functions(pkg, 60)
    print(f"functions over 60 lines: {len(fns)}")
    for f, n in fns:
        print(f"  {f}: {n}")
    for kind in KINDS:
        files = touched_by(kind, pkg.parent)
        print(f"adding a {kind} touches {len(files)} files (as {KINDS[kind][0]!r} does): {', '.join(files)}")


if __name__ == "__main__":
    main()
