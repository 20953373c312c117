"""The packages form layers and import only downward, module-level and function-level imports
alike:

    cli ─▶ services (router_svc, prefill_svc, decode_svc) ─▶ runtime ─▶ engine ─▶ kvtransfer ─▶ kernels
                                                                 everything ─▶ tandem (errors, v1, client)

A service never imports another service; `tandem` (the public package: errors, stubs, client)
imports none of the others. A function-level import of our own code says why (noqa reason)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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
names = [m.name for m in pkgutil.walk_packages(router_svc.__path__, "router_svc.")]
for name in names:
    importlib.import_module(name)
from cli.main import main
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
    modules = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
               for p in _modules("router_svc")}
    assert {m.removesuffix(".__init__") for m in modules} - {"router_svc"} \
        == set(report["imported"])
    assert report["loaded"] == []
