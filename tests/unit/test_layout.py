"""The packages form layers and import only downward, module-level and function-level imports
alike:

    cli ─▶ services (router_svc, prefill_svc, decode_svc) ─▶ runtime ─▶ engine ─▶ kvtransfer ─▶ kernels
                                                                 everything ─▶ tandem (errors, v1, client)

A service never imports another service; `tandem` (the public package: errors, stubs, client)
imports none of the others. A function-level import of our own code says why (noqa reason)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"router_svc", "prefill_svc", "decode_svc"}
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
            yield name.split(".")[0], node.lineno, id(node) in nested, lines[node.lineno - 1]


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


def test_protos_holds_only_the_contract_and_its_tools():
    files = {p.relative_to(ROOT / "protos").as_posix() for p in (ROOT / "protos").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert all(f.endswith((".proto", ".yaml", ".md")) or f in {"generate.py", "check.py"}
               for f in files), sorted(files)
