"""The test suite stands apart from benchmarks/: no test imports a benchmark module (a test runs
a benchmark only as a program, by its path). What tests and benchmarks share lives in the
package or in a tests/ helper; the benchmarks' own helpers are tested in benchmarks/tests/."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def benchmark_imports(root: Path) -> list[str]:
    """`path:line module` of every import of benchmarks (or a module under it) in root's .py
    files, at any depth of the file (imports inside functions included)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", None)) in ("import_module", "__import__") and node.args
                  and isinstance(node.args[0], ast.Constant)):
                names = [str(node.args[0].value)]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                      if n == "benchmarks" or n.startswith("benchmarks.")]
    return found


def test_no_test_imports_a_benchmark_module() -> None:
    assert benchmark_imports(TESTS) == []


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "import benchmarks.lib.floors\n"
        "from benchmarks.serving import ratio\n"
        "from benchmarks import cuda_batch\n"
        "import benchmarks_other\n"
        "def f():\n"
        "    import importlib\n"
        "    from benchmarks.transfer.kv_transfer_nixl import measure_nixl\n"
        "    importlib.import_module('benchmarks.engine.fp8_accuracy')\n")
    assert benchmark_imports(tmp_path) == [
        "a.py:1 benchmarks.lib.floors", "a.py:2 benchmarks.serving", "a.py:3 benchmarks",
        "a.py:7 benchmarks.transfer.kv_transfer_nixl", "a.py:8 benchmarks.engine.fp8_accuracy"]
