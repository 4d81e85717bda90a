"""The vLLM bridge's overhead: one layer's decode through the torch entry points vs the same kvarn_jax
call made from JAX directly, on a cache laid out in a torch tensor exactly as vLLM allocates it.

For each scheme: allocate one layer's KV cache the way vLLM does for the kvarn backend (a uint8
[num_blocks, 1, block_size, C] tensor whose page carries the format's bytes plus its share of the
high-precision sink/tail), bind it (`kvarn_vllm.torch_ops.bind`: DLPack views, pointer-checked),
fill it with `torch_ops.write` (in place: pointers checked again), then time

  bridge decode: torch q/block tables/lengths -> torch_ops.decode -> torch output, called as vLLM's
          impl calls it on a GPU (the longest row from the host, no host-side index checks);
  bridge, checked: the same with the default checks (which read the indices back, so wait);
  JAX direct / checked: kvarn_jax.paged_decode_attention on JAX arrays of the same cache, with
          check_values=False / True;
  write: one decode step's write of B new tokens through the bridge, completing no block (most
          steps) or one per sequence, the count given from the host as the metadata gives it;
  layer: a write and a decode, what one attention layer costs per decode step.

Each three ways: waited for (call, then synchronize: host + device, serialized), host only (what
the call costs the CPU) and pipelined (--layers calls back to back, one wait at the end: how a
model's layers run when nothing synchronizes - the larger of host and device time per call).
Needs no vLLM. On an NVIDIA GPU the decode is the Pallas kernel; elsewhere the reference (use
--tiny there).

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


def _time(fn, device, warmup, iters, host_only=False):
    """Median ms per call, waiting for the device after each; host_only: the call alone (what it
    costs the CPU while the GPU works on), the wait outside the timing."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        r = fn()
        if not host_only:
            _wait(r, device)
        out.append((time.perf_counter() - t) * 1e3)
        _wait(r, device)
    return statistics.median(out)


def _wait(result, device):
    if isinstance(result, jax.Array):
        jax.block_until_ready(result)
    _sync(device)


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
    on_host = device.type == "cpu"
    # as vLLM's impl calls it: the longest row from the host metadata, index checks only on the host
    bridge = lambda: torch_ops.decode(bound, q, tables, lens, sid, impl=a.impl, max_seq_len=seq_len,  # noqa: E731
                                      check_values=on_host)
    checked = lambda: torch_ops.decode(bound, q, tables, lens, sid, impl=a.impl)  # noqa: E731  (reads back)
    qj, tj, lj, sj = (jax.dlpack.from_dlpack(x) for x in (q, tables, lens, sid))
    qj, tj, lj, sj = (jnp.array(x) for x in (qj, tj, lj, sj))  # JAX-owned copies for the direct call
    sid_arg = None if lay.cfg.is_passthrough else sj
    direct = lambda: kvarn_jax.paged_decode_attention(qj, bound.cache, tj, lj, seq_ids=sid_arg, impl=a.impl,  # noqa: E731
                                                      check_values=False)
    direct_checked = lambda: kvarn_jax.paged_decode_attention(qj, bound.cache, tj, lj, seq_ids=sid_arg,  # noqa: E731
                                                              impl=a.impl)
    out_b = bridge().float().cpu().numpy()
    out_c = checked().float().cpu().numpy()
    out_d = np.asarray(direct().astype(jnp.float32))

    # one decode step's write: B new tokens, each completing a block (position seq_len - 1) or not
    # (seq_len - 2, what most steps are); the count comes from the host as the metadata gives it
    def step(p_last):
        pos = torch.full((b,), p_last, device=device, dtype=torch.int32)
        slots = tables[torch.arange(b, device=device), pos // bs] * bs + pos % bs
        n_done = b if p_last % bs == bs - 1 and p_last >= bs else 0
        return lambda: torch_ops.write(bound, k1, k1, slots, sid, pos, check_values=on_host,  # noqa: E731
                                       completing=n_done)
    k1 = torch.randn((b, a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
    write_full, write_plain = step(seq_len - 1), step(seq_len - 2)

    def layer():  # one layer of a decode step as vLLM runs it: the write, then the attention
        write_plain()
        return bridge()

    res = {}
    for name, fn in (("decode_bridge", bridge), ("decode_bridge_checked", checked), ("decode_direct", direct),
                     ("decode_direct_checked", direct_checked), ("write_step", write_plain),
                     ("write_step_completing", write_full), ("layer", layer)):
        res[name + "_ms"] = _time(fn, device, a.warmup, a.iters)            # call + wait for the GPU
        res[name + "_host_ms"] = _time(fn, device, a.warmup, a.iters, host_only=True)  # the call alone
        res[name + "_pipelined_ms"] = _pipelined(fn, device, a.warmup, a.layers)  # per call, back to back
    return {"scheme": scheme, "batch": b, "seq_len": seq_len, "q_heads": a.q_heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "block_size": bs, "dtype": str(dtype).split(".")[-1],
            "cache_bytes": kv.numel(), "zero_copy_bind": zero_copy, "in_place_write": in_place, **res,
            "max_abs_diff": float(max(np.max(np.abs(out_b - out_d)), np.max(np.abs(out_c - out_d))))}


def _pipelined(fn, device, warmup, n):
    """Time per call of n calls back to back with one wait at the end, as a model's layers run:
    the larger of the host's and the device's cost per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            r = fn()
        _wait(r, device)
        best = min(best, (time.perf_counter() - t) * 1e3 / n)
    return best


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
    p.add_argument("--layers", type=int, default=32, help="calls back to back in the pipelined timing")
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.seq_len, a.q_heads, a.kv_heads, a.head_dim, a.iters, a.chunk, a.layers = 4, 512, 8, 2, 64, 5, 512, 4
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and jax.default_backend() != "gpu":
        sys.exit("torch sees a GPU but JAX does not: install the CUDA build of jax")
    dtype = getattr(torch, a.dtype)
    rows = [run_scheme(s.strip(), a, device, dtype) for s in a.schemes.split(",") if s.strip()]
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}")
    cols = [("decode_bridge", "bridge decode"), ("decode_bridge_checked", "bridge, checked"),
            ("decode_direct", "JAX direct"), ("decode_direct_checked", "JAX, checked"),
            ("write_step", "write (no block done)"), ("write_step_completing", "write (B blocks done)"),
            ("layer", "layer: write + decode")]
    print("ms per call: waited for / host only / pipelined (per call of --layers back to back)")
    print(f"{'scheme':18} " + " ".join(f"{h:>24}" for _, h in cols) + f" {'max|diff|':>9}")
    for r in rows:
        cells = [f"{r[k + '_ms']:.3f}/{r[k + '_host_ms']:.3f}/{r[k + '_pipelined_ms']:.3f}" for k, _ in cols]
        print(f"{r['scheme']:18} " + " ".join(f"{c:>24}" for c in cells) + f" {r['max_abs_diff']:>9.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "jax": jax.__version__, "torch": torch.__version__, "rows": rows},
                      f, indent=1)
    if not all(r["zero_copy_bind"] and r["in_place_write"] for r in rows):
        sys.exit("a cache was copied or not written in place")


if __name__ == "__main__":
    main()
