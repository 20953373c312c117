"""The packages form layers and import only downward, module-level and function-level imports
alike:

    cli ─▶ services (router_svc, prefill_svc, decode_svc) ─▶ runtime ─▶ engine ─▶ kvtransfer ─▶ kernels
                                                                 everything ─▶ tandem (errors, v1, client)

Each folder is imported as a subpackage of `tandem` (tandem.engine, tandem.router_svc, ...), the
one name the wheel installs at top level. A service never imports another service; `tandem`'s
own modules (the public package: errors, stubs, client) import none of the others. A function-level import of our own code says why (noqa reason).

Inside a package no module imports itself back through others: no circles. Every import counts
there: at module level, under `if TYPE_CHECKING:` (a module that names another's types depends
on it; the guard only hides the circle from the interpreter, and a circle of types is one
object spread over files), and inside a function (deferred for cost, a Triton or torch import,
but still a dependency both ways). What a package's `__init__` runs when a submodule is imported
is not an edge (the submodule does not use it), nor is importlib's import of a module by name."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"router_svc", "prefill_svc", "decode_svc"}
FOLDERS = {*SERVICES, "kvtransfer", "kernels", "engine", "runtime", "cli"}
# package -> the packages it may import (besides itself)
ALLOWED = {
    "tandem": set(),
    "kernels": {"tandem"},
    "kvtransfer": {"kernels", "tandem"},
    "engine": {"kvtransfer", "kernels", "tandem"},
    "runtime": {"engine", "kvtransfer", "kernels", "tandem"},
    **{s: {"runtime", "engine", "kvtransfer", "kernels", "tandem"} for s in SERVICES},
    "cli": {*SERVICES, "runtime", "engine", "kvtransfer", "kernels", "tandem"},
}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    lines = path.read_text().splitlines()
    nested = {id(n) for f in ast.walk(tree)
              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield _package(name), node.lineno, id(node) in nested, lines[node.lineno - 1]


def _package(module: str) -> str:
    """The layer a module belongs to: a folder's name for tandem.<folder>..., "tandem" for the
    public package's own modules, else the top-level name (another distribution's)."""
    parts = module.split(".")
    if parts[0] == "tandem":
        return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "tandem"
    return parts[0]


def _modules(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_packages_import_only_downward():
    bad = []
    for package, allowed in ALLOWED.items():
        for path in _modules(package):
            for top, line, _, _ in _imports(path):
                if top in ALLOWED and top != package and top not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    assert not bad, "\n".join(bad)


def test_function_level_imports_of_our_code_say_why():
    bad = []
    for package in ALLOWED:
        for path in _modules(package):
            for top, line, nested, text in _imports(path):
                if nested and top in ALLOWED and "noqa: PLC0415 -" not in text:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_folder_by_its_bare_name():
    """`import engine` would load a second copy of tandem.engine (two module objects, two sets
    of classes); nothing in the tree, tests and benchmarks included, imports it that way."""
    bad = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "__pycache__" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     and node.module else [])
            bad += [f"{rel}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bad, "\n".join(bad)


def test_the_wheel_installs_one_top_level_name(tmp_path):
    """Built as a user's pip builds it: one top-level package, `tandem` (no generic name such as
    engine or cli, nothing another distribution imports, as `kernels`), holding every module of
    the design card's folders."""
    src = tmp_path / "src"  # a copy: building leaves build/ and *.egg-info where it runs
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "tandem", *FOLDERS):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if copy is shutil.copytree else {}))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "--no-index", "-q", "-w", str(tmp_path),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("tandem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"tandem"}, sorted(top)
    sources = {f"tandem/{p.relative_to(ROOT).as_posix()}" for folder in FOLDERS
               for p in _modules(folder) if "__pycache__" not in p.parts}
    assert sources - set(names) == set(), "modules left out of the wheel"
    assert any(n.startswith("tandem/v1/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tandem = tandem.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_protos_holds_only_the_contract_and_its_tools():
    files = {p.relative_to(ROOT / "protos").as_posix() for p in (ROOT / "protos").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert all(f.endswith((".proto", ".yaml", ".md")) or f in {"generate.py", "check.py"}
               for f in files), sorted(files)


# Loaded, these mean torch came in: torch itself, what runs only on it, transformers' model code.
TORCH_MODULES = ("torch", "triton", "xgrammar", "transformers.modeling_utils",
                 "transformers.pytorch_utils")


def test_the_router_imports_no_torch():
    """Every module of router_svc, and what `tandem router` imports to parse its flags and
    answer --help, imported in a fresh interpreter: none loads torch (the router's process
    refuses it from its start: router_svc/no_torch.py; a serving router is checked in
    tests/integration/test_router_no_torch.py)."""
    script = f"""
import importlib, json, pkgutil, sys
import router_svc
names = [m.name for m in pkgutil.walk_packages(router_svc.__path__, "tandem.router_svc.")]
for name in names:
    importlib.import_module(name)
from tandem.cli.main import main
try:
    main(["router", "--help"])
except SystemExit:
    pass
heavy = {TORCH_MODULES!r}
loaded = sorted(n for n, m in list(sys.modules.items()) if m is not None
                and any(n == h or n.startswith(h + ".") for h in heavy))
print(json.dumps({{"imported": names, "loaded": loaded}}))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.splitlines()[-1])
    modules = {_module_name(p) for p in _modules("router_svc")} - {"tandem.router_svc"}
    assert modules == set(report["imported"])
    assert report["loaded"] == []


# -- no circles inside a package --------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in FOLDERS:
        parts.insert(0, "tandem")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> Iterator[tuple[str, str]]:
    """(module of `modules` imported, how: module / TYPE_CHECKING / function) for every import
    in `path`, relative imports resolved; `from a import b` is module a.b when there is one."""
    tree = ast.parse(path.read_text(), str(path))
    kinds: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kinds.update((id(n), "function") for n in ast.walk(node))
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            kinds.update((id(n), "TYPE_CHECKING") for stmt in node.body for n in ast.walk(stmt))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        for name in names:
            if name in modules:
                yield name, kinds.get(id(node), "module")


def _import_graph(package: str) -> dict[str, dict[str, str]]:
    """module -> {module of the same package it imports: how}"""
    paths = {_module_name(p): p for p in _modules(package)}
    return {m: {n: how for n, how in _imported(p, set(paths)) if n != m}
            for m, p in paths.items()}


def _circles(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _all_circles() -> list[tuple[set[str], list[str]]]:
    """Each circle, with its edges ("a -> b (how)")."""
    out = []
    for package in ALLOWED:
        graph = _import_graph(package)
        for circle in _circles(graph):
            edges = sorted(f"{a} -> {b} ({how})" for a in circle
                           for b, how in graph[a].items() if b in circle)
            out.append((circle, edges))
    return out


def test_no_import_circles_inside_a_package():
    bad = [f"{sorted(c)}:\n  " + "\n  ".join(edges) for c, edges in _all_circles()]
    assert not bad, "\n".join(bad)


def test_the_circle_check_sees_each_kind_of_import(tmp_path, monkeypatch):
    """A circle closed at module level, under TYPE_CHECKING or inside a function is found; an
    import of the package itself (what its __init__ runs) is no edge."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("import pkg.b\nA = 1\n")
    (pkg / "c.py").write_text("from pkg import d\n")
    (pkg / "d.py").write_text("def f():\n    from . import c\n")
    (pkg / "e.py").write_text("from pkg import a\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.f import F\n")
    (pkg / "f.py").write_text("from pkg.e import x\n")
    for how in ("module", "TYPE_CHECKING"):
        (pkg / "b.py").write_text("import pkg.a\n" if how == "module" else
                                  "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from pkg.a import A\n")
        monkeypatch.setitem(globals(), "ROOT", tmp_path)
        graph = _import_graph("pkg")
        assert sorted(map(sorted, _circles(graph))) == [
            ["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.e", "pkg.f"]]
        assert graph["pkg.d"] == {"pkg.c": "function"}
        assert graph["pkg.e"] == {"pkg.a": "module", "pkg.f": "TYPE_CHECKING"}
