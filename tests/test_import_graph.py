"""The package's import graph: no cycles, and arrows only point down the layers
(README, "Layout"). Function-local imports count too, and each must say why it
is lazy (a `lazy:` comment), so a cycle cannot hide inside a function."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "qoqserve"

# lowest first; a module may import its own package and anything in a lower layer
LAYERS = [
    {"version", "paths", "errors"},
    {"sampling_params", "config"},
    {"kernels"},
    {"layers"},
    {"models"},
    {"model_loader"},
    {"engine", "quant"},
    {"llm"},
    {"server", "eval", "bench"},
    {"cli"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("qoqserve",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every qoqserve import."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            # `from pkg import submodule` depends on the submodule; other names on pkg
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        else:
            continue
        for t in targets:
            if t in mods and t != name:
                out.append((t, node.lineno, id(node) in local))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qoqserve"


MODS = _modules()
GRAPH = {m: _imports(m, p, MODS) for m, p in MODS.items()}


def test_every_package_has_a_layer():
    assert {_layer(m) for m in MODS} - {"qoqserve"} <= set(RANK), \
        f"add to LAYERS: {sorted({_layer(m) for m in MODS} - set(RANK) - {'qoqserve'})}"


def backward_arrows(graph) -> list[str]:
    bad = []
    for mod, imports in graph.items():
        if mod == "qoqserve":  # the package's lazy LLM export: the one arrow up, on demand
            continue
        src = _layer(mod)
        for target, line, _ in imports:
            dst = _layer(target)
            if dst == src:
                continue
            if dst == "qoqserve" or RANK[dst] >= RANK[src]:
                bad.append(f"{MODS[mod].relative_to(ROOT.parent)}:{line}: {src} -> {dst} ({target})")
    return bad


def test_imports_point_down_the_layers():
    bad = backward_arrows(GRAPH)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in GRAPH:
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_local_imports_say_why_they_are_lazy():
    undocumented = []
    for mod, path in MODS.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                i = node.lineno - 1
                ok = "lazy:" in lines[i]
                while not ok and i > 0:  # up through this block of imports, comments, blanks
                    i -= 1
                    text = lines[i].strip()
                    in_block = (not text or text.startswith(("#", "from ", "import "))
                                or text.endswith((",", "(", ")")))
                    if not in_block:
                        break
                    ok = "lazy:" in text
                if not ok:
                    undocumented.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not undocumented, "function-local imports without a `# lazy: why` comment:\n" + \
        "\n".join(undocumented)


def test_the_layer_check_can_fail():
    """A planted backward arrow is reported (guards the checker itself)."""
    planted = dict(GRAPH)
    planted["qoqserve.kernels.qoq_ref"] = GRAPH["qoqserve.kernels.qoq_ref"] + [
        ("qoqserve.quant.pipeline", 1, True)]
    assert any("kernels -> quant" in b for b in backward_arrows(planted))
