"""Check the protos as CI does: `buf lint`, `buf breaking` against the last release, and
`buf generate` of TypeScript stubs (type-checked with tsc).

    python protos/check.py                     # the repository's protos/ (make proto-check)
    python protos/check.py --protos DIR        # another copy of protos/ (with its buf.yaml)
    python protos/check.py --against REF       # a git ref to compare with instead

The baseline is the newest `v*` tag, or until there is one the commit that introduced
tandem.v1 (BASELINE). Its protos/ is read from git with `git archive`, so this works in a
worktree or a fresh clone; in a shallow clone the commit is fetched from origin first. buf and
protoc-gen-es come from `make buf` (.tools/node_modules/.bin), or $BUF and PATH. Exits non-zero
with buf's findings on stderr when any step fails; nothing here needs a network but the fetch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS_BIN = ROOT / ".tools" / "node_modules" / ".bin"
# The first commit of tandem.v1 ("Protos for the public API and internal worker services").
BASELINE = "2846582b01ab81aab265dfbd2100b69c193a753b"


class CheckFailed(Exception):
    pass


def find_buf() -> Path | None:
    found = os.environ.get("BUF") or shutil.which("buf", path=str(TOOLS_BIN)) or \
        shutil.which("buf")
    return Path(found) if found else None


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True)


def baseline_ref(repo: Path) -> str:
    tags = _git(repo, "tag", "--list", "v*", "--sort=-v:refname").stdout.decode().split()
    return tags[0] if tags else BASELINE


def _has_commit(repo: Path, ref: str) -> bool:
    return _git(repo, "cat-file", "-e", f"{ref}^{{commit}}").returncode == 0


def ensure_commit(repo: Path, ref: str) -> None:
    """A shallow clone lacks old commits: fetch just that one, or else the whole history."""
    if _has_commit(repo, ref):
        return
    print(f"proto check: {ref} is not in this clone; fetching it from origin", file=sys.stderr)
    for fetch in (["fetch", "--quiet", "--depth=1", "origin", ref],
                  ["fetch", "--quiet", "--unshallow", "--tags", "origin"]):
        _git(repo, *fetch)
        if _has_commit(repo, ref):
            return
    raise CheckFailed(f"the baseline {ref} is not in this clone and could not be fetched from "
                      "origin: run `git fetch --unshallow` (or pass --against REF)")


def extract(repo: Path, ref: str, dest: Path) -> Path:
    """`ref`'s protos/ under dest, via git archive (no checkout, any clone)."""
    ensure_commit(repo, ref)
    archive = _git(repo, "archive", ref, "protos")
    if archive.returncode != 0:
        raise CheckFailed(f"git archive {ref} protos: {archive.stderr.decode()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "protos"


def _run(step: str, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise CheckFailed(f"{step} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")
    print(f"proto check: {step}: ok", file=sys.stderr)


def generate_typescript(buf: Path, protos: Path, tmp: Path, env: dict[str, str]) -> None:
    out = tmp / "ts"
    _run("buf generate (TypeScript)", [str(buf), "generate", "-o", str(out)], protos, env)
    # Type-check against the @bufbuild/protobuf runtime that protoc-gen-es brought along.
    modules = TOOLS_BIN.parent
    tsc = shutil.which("tsc", path=str(TOOLS_BIN))
    if tsc is None or not (modules / "@bufbuild" / "protobuf").is_dir():
        print("proto check: tsc or @bufbuild/protobuf not in .tools: stubs not type-checked",
              file=sys.stderr)
        return
    (out / "node_modules").symlink_to(modules)
    (out / "tsconfig.json").write_text(json.dumps({
        "compilerOptions": {"strict": True, "noEmit": True, "target": "es2022",
                            "module": "nodenext", "moduleResolution": "nodenext",
                            "skipLibCheck": True},  # the runtime's own .d.ts: not ours
        "include": ["gen/**/*.ts"]}))
    _run("tsc (the generated stubs)", [tsc, "-p", str(out)], out, env)


def check(protos: Path, repo: Path, against: str, buf: Path, generate: bool = True) -> None:
    env = {**os.environ, "PATH": f"{TOOLS_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="proto-check-") as d:
        tmp = Path(d)
        _run("buf lint", [str(buf), "lint"], protos, env)
        base = extract(repo, against, tmp)
        _run(f"buf breaking against {against}",
             [str(buf), "breaking", ".", "--against", str(base)], protos, env)
        if generate:
            generate_typescript(buf, protos, tmp, env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protos", type=Path, default=ROOT / "protos",
                    help="the module to check (a folder with buf.yaml; default: protos/)")
    ap.add_argument("--repo", type=Path, default=ROOT,
                    help="the git repository the baseline comes from (default: this one)")
    ap.add_argument("--against", default=None,
                    help=f"git ref of the baseline (default: newest v* tag, else {BASELINE[:7]})")
    ap.add_argument("--no-generate", action="store_true", help="lint and breaking only")
    args = ap.parse_args()
    buf = find_buf()
    if buf is None:
        print("proto check: buf not found: run `make buf` (npm) or set $BUF", file=sys.stderr)
        return 2
    try:
        check(args.protos.resolve(), args.repo, args.against or baseline_ref(args.repo), buf,
              generate=not args.no_generate)
    except CheckFailed as e:
        print(f"proto check: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
