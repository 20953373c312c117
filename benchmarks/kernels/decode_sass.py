"""What the compiler makes of the unsplit paged decode kernel for a GPU, on any machine: its
registers, spills, shared memory and the width of every global load, asynchronous copy and
shared-memory access, for a bf16 or FP8 cache and one tile configuration. No GPU is needed:
triton compiles for the named architecture and assembles with the ptxas it ships. The arguments
are specialised as the JIT does at run time for an 8B-shaped cache (32 query heads, 8 KV heads,
D 128, 16-token blocks): 16-byte aligned pointers and strides, except those the kernel opts out
of.

    python benchmarks/kernels/decode_sass.py --kv fp8 --config n128/w4/s3/f16/r160
    python benchmarks/kernels/decode_sass.py --kv bf16 --config n32/w2/s2 --sass bf16.sass

--config names a tile configuration as decode_kv_dtype.py does (paged_kernels_common.config_key:
n<block_n>/w<warps>/s<stages>, then /f16 and /r<registers>, each optional); the kernel's
constants and options are the launcher's for that configuration.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no compiler to ask
    sys.exit("decode_sass.py compiles for a GPU: run it without TRITON_INTERPRET=1")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.paged_kernels_common import parse_config
from tandem.kernels.paged_decode_launch import DecodeConfig

# The module, not the function tandem.kernels exports under the same name.
pda = importlib.import_module("tandem.kernels.paged_decode_attention")

GROUP, HEAD_DIM, BLOCK_SIZE = 4, 128, 16  # Llama-3.1-8B: 32 query heads over 8 KV heads
# Global loads (LDG), asynchronous global-to-shared copies (LDGSTS), spills (STL/LDL), shared
# memory loads (LDS; LDSM: ldmatrix) and stores (STS). Counted in the code, not as executed.
MEMORY_OPS = re.compile(r"\b(LDGSTS[.A-Z0-9]*|LDG[.A-Z0-9]*|STL[.A-Z0-9]*|LDL[.A-Z0-9]*"
                        r"|LDS[.A-Z0-9]*|STS[.A-Z0-9]*)\b")


def signature(fp8: bool) -> tuple[dict[str, str], list[str]]:
    """The kernel's argument types, and the arguments the JIT would know as 16-byte aligned."""
    kv = "*fp8e4nv" if fp8 else "*bf16"
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
             "o_ptr": "*bf16", "k_scale_ptr": "*fp32" if fp8 else "constexpr",
             "v_scale_ptr": "*fp32" if fp8 else "constexpr", "scale_log2": "fp32"}
    for p in pda._paged_decode_kernel.params:
        types.setdefault(p.name, "constexpr" if p.is_constexpr else "i32")
    # The kernel opts out of specialising the block table's stride and its metadata's alignment.
    aligned = [n for n, t in types.items() if t != "constexpr" and t != "fp32"
               and n not in ("bt_ptr", "seq_lens_ptr", "stride_bt")]
    return types, aligned


def compile_kernel(fp8: bool, cfg: DecodeConfig, arch: int) -> dict:
    """The unsplit kernel's cubin for bf16 queries, with the constants the launcher gives it."""
    types, aligned = signature(fp8)
    names = list(types)
    consts = pda.kernel_consts(GROUP, BLOCK_SIZE, HEAD_DIM, torch.bfloat16)
    options = pda.tile_args(cfg, torch.bfloat16, fp8, cuda=True)
    consts.update((k, options.pop(k)) for k in ("BLOCK_N", "DOT_F16"))
    if not fp8:
        consts.update(k_scale_ptr=None, v_scale_ptr=None)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(pda._paged_decode_kernel, types, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return {"cubin": kernel.asm["cubin"], "shared_bytes": kernel.metadata.shared}


def report(compiled: dict) -> dict:
    """Registers, spills and memory instructions of the cubin, by triton's own cuobjdump."""
    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled["cubin"])
        f.flush()
        usage, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-res-usage", "-sass"))
    fields = dict(re.findall(r"\b(REG|STACK):(\d+)", usage))
    ops = Counter(m.group(1) for m in MEMORY_OPS.finditer(sass))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
            "shared_bytes": compiled["shared_bytes"], "memory_ops": dict(sorted(ops.items())),
            "sass": sass}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", choices=["bf16", "fp8"], default="fp8", help="the cache's dtype")
    p.add_argument("--config", default="n128/w4/s3/f16/r160", help="tiles, as n128/w4/s3/f16/r160")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    p.add_argument("--sass", type=Path, help="write the disassembly here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    try:
        cfg, _ = parse_config(a.config)
    except ValueError as e:
        p.error(f"--config: {e}")
    r = report(compile_kernel(a.kv == "fp8", cfg, a.arch))
    if a.sass:
        a.sass.write_text(r["sass"])
    del r["sass"]
    r.update(kv=a.kv, config=a.config, arch=a.arch)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"paged decode (unsplit), {a.kv} cache, {a.config}, sm_{a.arch}: {r['registers']} "
          f"registers, {r['stack_bytes']} bytes of stack (spills), {r['shared_bytes']} bytes of "
          f"shared memory")
    for op, n in r["memory_ops"].items():
        print(f"  {n:5d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
