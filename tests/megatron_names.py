"""Megatron-LM's command-line names, read statically from its source (no import of Megatron)."""
import ast, sys
from pathlib import Path

def dataclass_fields(tree, cls_name):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return node
    return None

def names(root: Path) -> dict:
    out = {}
    args = root / "megatron/training/arguments.py"
    tree = ast.parse(args.read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument":
            for a in n.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                    out.setdefault(a.value, f"megatron/training/arguments.py:{n.lineno}")
    factories = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ArgumentGroupFactory" and n.args:
            factories.add(getattr(n.args[0], "id", None))
    files = list((root / "megatron").rglob("*.py"))
    classes = {}
    for f in files:
        try:
            t = ast.parse(f.read_text())
        except Exception:
            continue
        for node in ast.walk(t):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (f, node))
    def walk(cls, seen=()):
        if cls not in classes or cls in seen:
            return
        f, node = classes[cls]
        for b in node.bases:
            walk(getattr(b, "id", None), seen + (cls,))
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                name = st.target.id
                default_true = isinstance(st.value, ast.Constant) and st.value.value is True
                is_bool = isinstance(st.annotation, ast.Name) and st.annotation.id == "bool"
                flag = "--" + (("no_" if is_bool and default_true else "") + name).replace("_", "-")
                out.setdefault(flag, f"{f.relative_to(root)}:{st.lineno}")
                meta = ast.dump(st.value) if st.value is not None else ""
                if "arg_names" in meta:
                    for c in ast.walk(st.value):
                        if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("--"):
                            out.setdefault(c.value, f"{f.relative_to(root)}:{st.lineno}")
    for cls in factories:
        walk(cls)
    return out

if __name__ == "__main__":
    d = names(Path(sys.argv[1]))
    for k in sys.argv[2:]:
        print(k, d.get(k))
