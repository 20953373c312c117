"""The proto contract check CI runs (`make proto-check` = protos/check.py: buf lint, buf
breaking against the last release, buf generate): it passes on the protos as they are and
catches a deliberate breaking change made to a copy of them."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "protos" / "check.py"

_spec = importlib.util.spec_from_file_location("proto_check", CHECK)
proto_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proto_check)

pytestmark = pytest.mark.skipif(
    proto_check.find_buf() is None,
    reason="buf is not installed: `make install` (or `make buf`) installs it from npm")


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True)


@pytest.fixture
def protos(tmp_path) -> Path:
    """A copy of protos/: the .proto files and buf's configuration."""
    dest = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", dest,
                    ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__", "gen"))
    return dest


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert re.search(old, text, flags=re.M), old
    path.write_text(re.sub(old, new, text, count=1, flags=re.M))


def test_the_protos_pass_lint_breaking_and_generate(protos):
    r = run_check("--protos", str(protos))
    assert r.returncode == 0, r.stderr
    for step in ("buf lint: ok", "buf breaking against", "buf generate (TypeScript): ok"):
        assert step in r.stderr


# Each a change that breaks a deployed caller, and what buf says about it.
BREAKING = {
    "field type": ("api.proto", r"string text = 2;", "bytes text = 2;", "changed type"),
    "field number": ("api.proto", r"string model = 5;", "string model = 9;", "deleted"),
    "field renamed": ("common.proto", r"uint32 max_tokens = 2;", "uint32 max_new_tokens = 2;",
                      "changed name"),
    "field deleted, not reserved": ("api.proto", r"^\s*string stop_reason = 7;.*$", "",
                                    "without reserving the number"),
    "service renamed": ("api.proto", r"^service Tandem \{", "service TandemService {",
                        "deleted"),
    "stream made unary": ("api.proto", r"returns \(stream GenerateResponse\)",
                          "returns (GenerateResponse)", "streaming"),
}


@pytest.mark.parametrize("change", list(BREAKING))
def test_a_breaking_change_to_a_copy_fails_the_check(protos, change):
    file, old, new, finding = BREAKING[change]
    edit(protos / "tandem" / "v1" / file, old, new)
    r = run_check("--protos", str(protos), "--no-generate")
    assert r.returncode != 0
    assert "buf breaking" in r.stderr and finding in r.stderr, r.stderr


def test_a_field_deleted_with_its_number_and_name_reserved_passes(protos):
    edit(protos / "tandem" / "v1" / "api.proto", r"^\s*string stop_reason = 7;.*$",
         '  reserved 7;\n  reserved "stop_reason";')
    r = run_check("--protos", str(protos), "--no-generate")
    assert r.returncode == 0, r.stderr


def test_a_lint_finding_fails_the_check(protos):
    edit(protos / "tandem" / "v1" / "api.proto", r"^message TokenIds \{",
         "message TokenIds {\n  string camelCase = 2;")
    r = run_check("--protos", str(protos), "--no-generate")
    assert r.returncode != 0 and "buf lint failed" in r.stderr and "camelCase" in r.stderr


def test_a_shallow_clone_fetches_the_baseline(tmp_path):
    """CI may clone with --depth 1: the baseline commit is fetched from origin, not skipped."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(clone)],
                   check=True)
    assert not proto_check._has_commit(clone, proto_check.BASELINE)
    r = run_check("--repo", str(clone), "--against", proto_check.BASELINE, "--no-generate")
    assert r.returncode == 0, r.stderr
    assert proto_check._has_commit(clone, proto_check.BASELINE)
