"""Regenerate the Python stubs of protos/tandem/v1/*.proto into the `tandem.v1` package.

    python protos/generate.py            # writes tandem/v1/*_pb2*.py(i) at the repository root
    python protos/generate.py --out DIR  # writes into DIR (the freshness test compares)

Pinned to grpcio-tools 1.84.0 (protoc for protobuf 7.35): the stubs then import with every
protobuf 7.x runtime >= 7.35 and grpcio >= 1.84, which both CI and the GPU image satisfy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE_ROOT = ROOT.parent  # tandem/v1/ sits at the repository root, beside protos/
TOOLS_VERSION = "1.84.0"


def generate(out: Path) -> list[Path]:
    from importlib.metadata import version  # noqa: PLC0415

    import grpc_tools  # noqa: PLC0415
    from grpc_tools import protoc  # noqa: PLC0415

    if version("grpcio-tools") != TOOLS_VERSION:
        sys.exit(f"grpcio-tools=={TOOLS_VERSION} is required, found {version('grpcio-tools')}")
    protos = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tandem").rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", *protos])
    if rc != 0:
        sys.exit(f"protoc failed ({rc})")
    return sorted((out / "tandem").rglob("*_pb2*.py*"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PACKAGE_ROOT)
    args = ap.parse_args()
    for p in generate(args.out):
        print(p)


if __name__ == "__main__":
    main()
