"""The vLLM bridge's overhead: one layer's decode through the torch entry points vs the same kvarn_jax
call made from JAX directly, on a cache laid out in a torch tensor exactly as vLLM allocates it.

For each scheme: allocate one layer's KV cache the way vLLM does for the kvarn backend (a uint8
[num_blocks, 1, block_size, C] tensor whose page carries the format's bytes plus its share of the
high-precision sink/tail), bind it (`kvarn_vllm.torch_ops.bind`: DLPack views, pointer-checked),
fill it with `torch_ops.write` (in place: pointers checked again), then time

  bridge: torch q/block tables/lengths -> torch_ops.decode -> torch output (DLPack both ways, stream
          syncs, batch/column padding: everything the vLLM impl pays per layer and step)
  direct: kvarn_jax.paged_decode_attention on JAX arrays of the same cache (the kernel alone)

and one decode step's write (B new tokens) through the bridge. Needs no vLLM. On an NVIDIA GPU the
decode is the Pallas kernel; elsewhere the reference (use --tiny there).

    python benchmarks/bridge_overhead.py                 # H200 shape: B=32, L=32K, Hq=32, Hk=8, D=128
    python benchmarks/bridge_overhead.py --tiny --json out.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvarn_jax  # noqa: E402
from kvarn_vllm import torch_ops  # noqa: E402
from kvarn_vllm.layout import PageLayout  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def run_scheme(scheme, a, device, dtype):
    bs, b, seq_len = a.block_size, a.batch, a.seq_len
    blocks_per_seq = -(-seq_len // bs)
    num_blocks = b * blocks_per_seq + 1
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                     dtype=str(dtype).split(".")[-1], max_seqs=b)
    page = lay.vllm_page_bytes(-(-lay.hp_bytes // num_blocks))   # sink/tail inside the buffer
    kv = torch.zeros((num_blocks, 1, bs, page // bs), dtype=torch.uint8, device=device)
    bound = torch_ops.bind(kv, lay)
    ptrs = bound.pointers()
    zero_copy = all(t == j for t, j in ptrs.values())

    g = torch.Generator(device=device).manual_seed(0)
    perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1
    tables = perm[: b * blocks_per_seq].view(b, blocks_per_seq).to(torch.int32)
    chunk = min(a.chunk, seq_len)
    for s in range(b):  # prefill every sequence, `chunk` tokens per write
        for p0 in range(0, seq_len, chunk):
            n = min(chunk, seq_len - p0)
            pos = torch.arange(p0, p0 + n, device=device, dtype=torch.int32)
            slots = tables[s, pos // bs] * bs + pos % bs
            k = torch.randn((n, a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
            v = torch.randn((n, a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
            torch_ops.write(bound, k, v, slots, torch.full((n,), s, device=device, dtype=torch.int32), pos,
                            check_values=device.type == "cpu")
    _sync(device)
    in_place = kv.data_ptr() == bound.buffer.data_ptr() and all(
        t == j for t, j in bound.pointers().values()) and bool(kv.any())

    q = torch.randn((b, a.q_heads, a.head_dim), generator=g, device=device, dtype=dtype)
    lens = torch.full((b,), seq_len, device=device, dtype=torch.int32)
    sid = torch.arange(b, device=device, dtype=torch.int32)
    bridge = lambda: torch_ops.decode(bound, q, tables, lens, sid, impl=a.impl)  # noqa: E731
    qj, tj, lj, sj = (jax.dlpack.from_dlpack(x) for x in (q, tables, lens, sid))
    qj, tj, lj, sj = (jnp.array(x) for x in (qj, tj, lj, sj))  # JAX-owned copies for the direct call
    sid_arg = None if lay.cfg.is_passthrough else sj
    direct = lambda: jax.block_until_ready(kvarn_jax.paged_decode_attention(  # noqa: E731
        qj, bound.cache, tj, lj, seq_ids=sid_arg, impl=a.impl))
    out_b = bridge().float().cpu().numpy()
    out_d = np.asarray(direct().astype(jnp.float32))
    t_bridge = _time(bridge, device, a.warmup, a.iters)
    t_direct = _time(direct, device, a.warmup, a.iters)

    # one decode step's write: B new tokens at position seq_len (tables have room only if seq_len % bs)
    pos = torch.full((b,), seq_len - 1, device=device, dtype=torch.int32)
    slots = tables[torch.arange(b, device=device), pos // bs] * bs + pos % bs
    k1 = torch.randn((b, a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
    step_write = lambda: torch_ops.write(bound, k1, k1, slots, sid, pos,  # noqa: E731
                                         check_values=device.type == "cpu")
    t_write = _time(step_write, device, a.warmup, a.iters)
    return {"scheme": scheme, "batch": b, "seq_len": seq_len, "q_heads": a.q_heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "block_size": bs, "dtype": str(dtype).split(".")[-1],
            "cache_bytes": kv.numel(), "zero_copy_bind": zero_copy, "in_place_write": in_place,
            "decode_bridge_ms": t_bridge, "decode_direct_ms": t_direct,
            "overhead_ms": t_bridge - t_direct, "overhead_pct": 100 * (t_bridge - t_direct) / t_direct,
            "max_abs_diff": float(np.max(np.abs(out_b - out_d))), "write_step_ms": t_write}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="kvarn_k4v2_g128,int8,fp8,fp16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--chunk", type=int, default=4096, help="tokens per write while filling the cache")
    p.add_argument("--impl", default="auto", choices=["auto", "pallas", "reference"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.seq_len, a.q_heads, a.kv_heads, a.head_dim, a.iters, a.chunk = 4, 512, 8, 2, 64, 5, 512
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and jax.default_backend() != "gpu":
        sys.exit("torch sees a GPU but JAX does not: install the CUDA build of jax")
    dtype = getattr(torch, a.dtype)
    rows = [run_scheme(s.strip(), a, device, dtype) for s in a.schemes.split(",") if s.strip()]
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}")
    hdr = f"{'scheme':18} {'B':>3} {'L':>6} {'bridge ms':>10} {'direct ms':>10} {'overhead':>12} " \
          f"{'write ms':>9} {'zero-copy':>9} {'in-place':>8} {'max|diff|':>9}"
    print(hdr)
    for r in rows:
        print(f"{r['scheme']:18} {r['batch']:>3} {r['seq_len']:>6} {r['decode_bridge_ms']:>10.3f} "
              f"{r['decode_direct_ms']:>10.3f} {r['overhead_ms']:>+7.3f} ({r['overhead_pct']:>+3.0f}%) "
              f"{r['write_step_ms']:>9.3f} {str(r['zero_copy_bind']):>9} {str(r['in_place_write']):>8} "
              f"{r['max_abs_diff']:>9.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "jax": jax.__version__, "torch": torch.__version__, "rows": rows},
                      f, indent=1)
    if not all(r["zero_copy_bind"] and r["in_place_write"] for r in rows):
        sys.exit("a cache was copied or not written in place")


if __name__ == "__main__":
    main()
