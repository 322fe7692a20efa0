"""The package's imports go one way.  Statically: every `import` of every module under
src/streamsched (at module level, or inside a function: a lazy import is still a dependency),
resolved to the module it names, forms a graph with no cycle at import time, none at all inside
stdlib/, and no cycle beyond the known ones listed below.  Dynamically: every module imports
cleanly as the first module of a fresh interpreter (a cycle shows as an ImportError or a
half-initialised module only for some entry points)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

KNOWN: list[set[str]] = []
"""Cycles through lazy (function-level) imports outside stdlib/ that are tolerated: none.  A new
cycle fails test_no_cycle_but_the_known_lazy_ones (interp.train <-> interp.cuda.runner went with
the training loop's split into interp/training/, dsl.resolve <-> dsl.kernels with the resolver's
split into passes, and diagnostics -> dsl.load -> dsl.parse -> diagnostics before them)."""


def modules(src: str = SRC) -> dict[str, str]:
    """Module name -> file, for every .py under src/streamsched (a package is its __init__.py)."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(src, "streamsched")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def imports(name: str, path: str, known: set[str]) -> list[tuple[str, bool]]:
    """(module imported, lazy) for every import statement of module `name` that names a module of
    `known`: `from a.b import c` is a.b.c when that is a module, else a.b; lazy when the
    statement is inside a function (it runs when called, not at import)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    out: list[tuple[str, bool]] = []

    def visit(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".")
                    parts = parts if is_pkg else parts[:-1]
                    parts = parts[:len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub if sub in known else base, lazy))
            visit(child, inner)

    visit(tree, False)
    return [(m, lazy) for m, lazy in out if m in known and m != name]


def graph(lazy: bool, src: str = SRC) -> dict[str, set[str]]:
    """Module -> the modules it imports (module-level imports only, or every import if lazy)."""
    mods = modules(src)
    known = set(mods)
    return {m: {t for t, is_lazy in imports(m, p, known) if lazy or not is_lazy} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of g with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_no_cycle_at_import_time():
    assert cycles(graph(lazy=False)) == []


def test_stdlib_has_no_cycle_even_through_lazy_imports():
    g = graph(lazy=True)
    stdlib = {m: {t for t in ts if t.startswith("streamsched.stdlib")}
              for m, ts in g.items() if m.startswith("streamsched.stdlib")}
    assert cycles(stdlib) == []


def test_no_cycle_but_the_known_lazy_ones():
    found = cycles(graph(lazy=True))
    assert [c for c in found if c not in KNOWN] == []


def test_kernel_families_import_only_base_and_cuda():
    """A family module may import _base, _cuda, kernel_record and (lazily) kernel_lang, never
    another family or the package that joins them."""
    g = graph(lazy=True)
    fam = "streamsched.stdlib.kernels."
    allowed = {fam + "_base", fam + "_cuda", "streamsched.stdlib.kernel_record", "streamsched.stdlib.kernel_lang",
               "streamsched.interp.ir"}
    for m, ts in g.items():
        if m.startswith(fam) and m.rsplit(".", 1)[1] not in ("__main__", "_doc", "_base", "_cuda"):
            assert ts <= allowed, (m, sorted(ts - allowed))


def test_the_checks_find_a_planted_cycle(tmp_path):
    pkg = tmp_path / "streamsched"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from streamsched.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import streamsched.a\n")
    assert cycles(graph(lazy=False, src=str(tmp_path))) == []
    assert cycles(graph(lazy=True, src=str(tmp_path))) == [{"streamsched.a", "streamsched.sub.b"}]
    (pkg / "sub" / "b.py").write_text("from streamsched import c\n")
    assert cycles(graph(lazy=False, src=str(tmp_path))) == [{"streamsched.a", "streamsched.sub.b", "streamsched.c"}]


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module as the entry point: streamsched's modules are dropped from sys.modules before
    each import, so every module is once the first one loaded (third-party modules stay)."""
    names = sorted(m for m in modules() if not m.endswith("__main__"))
    code = textwrap.dedent(f"""
        import importlib, sys, traceback
        bad = []
        for name in {names!r}:
            for m in [m for m in sys.modules if m == "streamsched" or m.startswith("streamsched.")]:
                del sys.modules[m]
            try:
                importlib.import_module(name)
            except Exception:
                bad.append(name + ": " + traceback.format_exc().splitlines()[-1])
        print("\\n".join(bad))
        sys.exit(1 if bad else 0)
    """)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
