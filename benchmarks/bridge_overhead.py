"""What the vLLM bridge costs on top of kvarn_jax's decode, for one attention layer of a decode step:
the kernel alone, the same call from JAX directly, the bridge's torch entry points (decode, write
with and without a completed block, the layer's write + decode), and torch's SDPA on a dense fp16
cache of the same shape - all in one run, on a cache laid out in a torch tensor exactly as vLLM
allocates it. Needs no vLLM: it drives `kvarn_vllm.plan.StepPlan` and `kvarn_vllm.torch_ops` as the
vLLM impl does.

For each scheme: allocate one layer's KV cache as vLLM does for the kvarn backend (a uint8
[num_blocks, 1, block_size, C] tensor whose page carries the format's bytes and its share of the
high-precision sink/tail), bind it (DLPack views, pointer-checked), fill it through the bridge's
write (in place: pointers checked again), then time

  kernel: `kvarn_jax.paged_decode_attention` called --layers times inside one jitted loop (the
          device time per call; host dispatch amortized);
  JAX direct: the same call from JAX on JAX arrays of the same cache (check_values=False);
  bridge decode: `torch_ops.attend` on a decode step's plan (torch q in, torch output);
  write: the step's write of B new tokens, completing no block (most steps) or one per sequence;
  layer: `torch_ops.forward`, what vLLM's impl calls for one attention layer of a decode step (a
          step completing no block: one JAX call that writes and attends, q, k and v views of one
          tensor as vLLM's qkv projection leaves them), and one completing a block per sequence (the
          same call returns the filled blocks, then quantized); layer split: write, then decode;
  torch SDPA fp16: `scaled_dot_product_attention` of the same queries over dense fp16 K/V [B, Hk, L, D];
  chunked prefill (`prefill_profile`): one sequence prefilled chunk by chunk, per chunk the bridge's
          write and attention against torch's causal SDPA over the same keys.

Each three ways: waited for (call, then synchronize: host + device, serialized), host only (the call
alone) and pipelined (--layers calls back to back, one wait at the end: how a model's layers run -
the larger of host and device time per call). The step's plan is built once and shared by the
--layers calls, as a step's layers share it; building it (host, once per step) is timed apart.
Checks: bridge decode equals JAX direct (the same kernel), the layer's decode after its write equals
the library's decode of the same cache, the fused layer's output (its new token merged in fp32, not
read by the kernel) near JAX direct's (reported relative to the output's largest magnitude),
zero-copy bind and in-place writes.

    python benchmarks/bridge_overhead.py --json out.json          # H200: B=32, L=32K, Hq=32, Hk=8, D=128
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
import torch.nn.functional as F  # noqa: E402

import kvarn_jax  # noqa: E402
from kvarn_vllm import torch_ops  # noqa: E402
from kvarn_vllm.layout import PageLayout  # noqa: E402
from kvarn_vllm.plan import StepPlan  # noqa: E402
from timing import markdown_table, run_info  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(result, device):
    if isinstance(result, jax.Array):
        jax.block_until_ready(result)
    _sync(device)


def _time(fn, device, warmup, iters, host_only=False):
    """Median ms per call, waiting for the device after each; host_only: the call alone."""
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


def _pipelined(fn, device, warmup, n):
    """ms per call of n calls back to back with one wait at the end (best of 3)."""
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


def _plan(lay, tables, lens, device):
    """A decode step's plan: one new token per sequence at position lens - 1."""
    b, bs = lens.shape[0], lay.block_size
    pos = lens - 1
    slots = tables[torch.arange(b, device=device), torch.as_tensor(pos // bs, device=device)] * bs + \
        torch.as_tensor(pos % bs, device=device, dtype=torch.int32)
    return StepPlan.build(block_size=bs, max_seqs=lay.max_seqs, query_start_loc=np.arange(b + 1), seq_lens=lens,
                          seq_ids=np.arange(b), block_table=tables, slot_mapping=slots.to(torch.int32), num_decodes=b)


def kernel_ms(q, cache, tables, lens, seq_ids, impl, calls, device) -> float:
    """The decode kernel's device ms per call: `paged_decode_attention` called `calls` times inside
    one jitted loop, each call depending on the last (no overlap, no elimination), so host dispatch
    is paid once."""
    @jax.jit
    def loop(q0, cache, tj, lj, sid):  # the cache an argument: closed over, it would be a constant
        def body(i, acc):
            o = kvarn_jax.paged_decode_attention(q0 + (acc[0, 0, 0] * 0).astype(q0.dtype), cache, tj, lj,
                                                 seq_ids=sid, impl=impl, check_values=False)
            return o.astype(jnp.float32)
        return jax.lax.fori_loop(0, calls, body, jnp.zeros(q0.shape, jnp.float32))

    run = lambda: loop(q, cache, tables, lens, seq_ids)  # noqa: E731
    run()
    _sync(device)
    return _pipelined(run, device, 1, 1) / calls


def filled_layer(scheme, a, device, dtype):
    """One layer's cache as vLLM allocates it for the kvarn backend, bound, and filled through the
    bridge's writes: every sequence, a.chunk tokens per write, up to a.seq_len. Returns (layout,
    vLLM tensor, bound cache, block tables, the generator)."""
    bs, b, seq_len = a.block_size, a.batch, a.seq_len
    blocks_per_seq = -(-(seq_len + 1) // bs)
    num_blocks = b * blocks_per_seq + 1
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                     dtype=str(dtype).split(".")[-1], max_seqs=b)
    page = lay.vllm_page_bytes(-(-lay.hp_bytes // num_blocks))   # sink/tail inside the buffer
    kv = torch.zeros((num_blocks, 1, bs, page // bs), dtype=torch.uint8, device=device)
    bound = torch_ops.bind(kv, lay)

    g = torch.Generator(device=device).manual_seed(0)
    perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1
    tables = perm[: b * blocks_per_seq].view(b, blocks_per_seq).to(torch.int32)
    chunk = min(a.chunk, seq_len)
    for p0 in range(0, seq_len, chunk):  # prefill: every sequence, `chunk` tokens per write
        n = min(chunk, seq_len - p0)
        for s in range(b):
            pos = torch.arange(p0, p0 + n, device=device, dtype=torch.int32)
            plan = StepPlan.build(block_size=bs, max_seqs=b, query_start_loc=[0, n], seq_lens=[p0 + n], seq_ids=[s],
                                  block_table=tables[s:s + 1], slot_mapping=(tables[s, pos // bs] * bs + pos % bs),
                                  num_decodes=0)
            k = torch.randn((n, a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
            v = torch.randn((n, a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
            torch_ops.write(bound, k, v, plan)
    _sync(device)
    return lay, kv, bound, tables, g


def run_scheme(scheme, a, device, dtype):
    bs, b, seq_len = a.block_size, a.batch, a.seq_len
    lay, kv, bound, tables, g = filled_layer(scheme, a, device, dtype)
    zero_copy = all(t == j for t, j in bound.pointers().values())
    in_place = kv.data_ptr() == bound.buffer.data_ptr() and all(
        t == j for t, j in bound.pointers().values()) and bool(kv.any())

    # the decode step: one token per sequence at position seq_len (the cache then holds seq_len + 1);
    # q, k and v side by side in one tensor, as vLLM's qkv projection leaves them
    lens = np.full(b, seq_len + 1)
    qkv = torch.randn((b, a.q_heads + 2 * a.kv_heads, a.head_dim), generator=g, device=device, dtype=dtype)
    q, k1, v1 = qkv.split([a.q_heads, a.kv_heads, a.kv_heads], dim=1)
    t0 = time.perf_counter()
    plan = _plan(lay, tables, lens, device)
    plan_ms = (time.perf_counter() - t0) * 1e3
    out = torch.empty_like(q)
    write_plain = lambda: torch_ops.write(bound, k1, v1, plan)  # noqa: E731
    bridge = lambda: torch_ops.attend(bound, q, plan, impl=a.impl, out=out)  # noqa: E731
    layer = lambda: torch_ops.forward(bound, q, k1, v1, plan, impl=a.impl, out=out)  # noqa: E731

    def layer_split():
        torch_ops.write(bound, k1, v1, plan)
        return torch_ops.attend(bound, q, plan, impl=a.impl, out=out)

    # a step whose write completes one block per sequence: positions at a block's last slot
    full_len = (seq_len // bs) * bs
    plan_full = _plan(lay, tables, np.full(b, full_len), device) if full_len >= 2 * bs else None
    write_full = (lambda: torch_ops.write(bound, k1, v1, plan_full)) if plan_full is not None else None
    layer_full = (lambda: torch_ops.forward(bound, q, k1, v1, plan_full, impl=a.impl, out=out)) if plan_full else None

    t0 = time.perf_counter()
    layer()  # first layer of a step: the plan's per-step tensors are made and imported here
    _sync(device)
    first_layer_ms = (time.perf_counter() - t0) * 1e3

    qj = jnp.asarray(jax.dlpack.from_dlpack(q.contiguous()))
    cols = -(-(seq_len + 1) // bs)
    tj, lj, sj = jnp.asarray(tables.cpu().numpy()[:, :cols]), jnp.asarray(lens, jnp.int32), jnp.arange(b, dtype=jnp.int32)
    sid = None if lay.cfg.is_passthrough else sj
    direct = lambda: kvarn_jax.paged_decode_attention(qj, bound.cache, tj, lj, seq_ids=sid, impl=a.impl,  # noqa: E731
                                                      check_values=False)

    # torch SDPA on a dense fp16 cache of the same shape
    kd = torch.randn((b, a.kv_heads, seq_len + 1, a.head_dim), generator=g, device=device, dtype=torch.float16)
    vd = torch.randn_like(kd)
    qd = q.to(torch.float16).view(b, a.q_heads, 1, a.head_dim)
    sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)  # noqa: E731

    out_l = layer().float().cpu().numpy()   # the fused step: its new token merged, not read from the cache
    out_b = bridge().float().cpu().numpy()
    out_d = np.asarray(direct().astype(jnp.float32))
    ref = kvarn_jax.paged_decode_attention(qj, bound.cache, tj, lj, seq_ids=sid, impl="reference")
    out_r = np.asarray(ref.astype(jnp.float32))

    res = {"plan_build_ms": plan_ms, "first_layer_of_step_ms": first_layer_ms}
    timed = (("decode_bridge", bridge), ("decode_direct", direct), ("write_step", write_plain),
             ("write_step_completing", write_full), ("layer", layer), ("layer_completing", layer_full),
             ("layer_split", layer_split),
             ("sdpa_fp16", sdpa))
    for name, fn in timed:
        if fn is None:
            continue
        res[name + "_ms"] = _time(fn, device, a.warmup, a.iters)
        res[name + "_host_ms"] = _time(fn, device, a.warmup, a.iters, host_only=True)
        res[name + "_pipelined_ms"] = _pipelined(fn, device, a.warmup, a.layers)
    res["kernel_ms"] = kernel_ms(qj, bound.cache, tj, lj, sid, a.impl, a.layers, device)
    return {"scheme": scheme, "batch": b, "seq_len": seq_len + 1, "q_heads": a.q_heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "block_size": bs, "dtype": str(dtype).split(".")[-1],
            "decode_impl": torch_ops.decode_impl(a.impl), "cache_bytes": kv.numel(), "zero_copy_bind": zero_copy,
            "in_place_write": in_place, **res,
            "bridge_vs_direct_max_abs_diff": float(np.max(np.abs(out_b - out_d))),
            "layer_vs_direct_max_abs_diff": float(np.max(np.abs(out_l - out_d))),
            "direct_max_abs": float(np.max(np.abs(out_d))),
            "bridge_vs_reference_max_abs_diff": float(np.max(np.abs(out_b - out_r)))}


def prefill_profile(scheme, a, device, dtype):
    """One sequence of --prefill-len tokens prefilled through the bridge in chunks of --prefill-chunk,
    as vLLM's chunked prefill runs it: per chunk, the ms of the write and of the attention (every
    query over the sink, the quantized blocks before its own, its own block in high precision), each
    waited for, and torch's causal SDPA over the same keys held dense in the model dtype (what an
    attention that reads an unquantized cache does at least). What grows with the context shows here."""
    bs, n, chunk = a.block_size, a.prefill_len, a.prefill_chunk
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                     dtype=str(dtype).split(".")[-1], max_seqs=1)
    num_blocks = -(-n // bs) + 1
    kv = torch.zeros((num_blocks, 1, bs, lay.vllm_page_bytes(-(-lay.hp_bytes // num_blocks)) // bs),
                     dtype=torch.uint8, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    table = (torch.randperm(num_blocks, generator=g, device=device)[: num_blocks - 1]).to(torch.int32)[None]
    q, k, v = (torch.randn((n, h, a.head_dim), generator=g, device=device, dtype=dtype)
               for h in (a.q_heads, a.kv_heads, a.kv_heads))
    for _ in range(2):  # the first pass compiles every chunk's shapes; the second is timed
        kv.zero_()
        bound = torch_ops.bind(kv, lay)
        rows = _prefill_pass(bound, a, device, table, q, k, v)
    return {"scheme": scheme, "prefill_len": n, "chunk": chunk, "chunks": rows,
            "total_ms": sum(r["write_ms"] + r["attend_ms"] for r in rows), "sdpa_total_ms": sum(r["sdpa_ms"] for r in rows)}


def _prefill_pass(bound, a, device, table, q, k, v):
    bs, n, chunk = a.block_size, a.prefill_len, a.prefill_chunk
    rows = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pos = torch.arange(start, end, device=device, dtype=torch.int64)
        plan = StepPlan.build(block_size=bs, max_seqs=1, query_start_loc=[0, end - start], seq_lens=[end], seq_ids=[0],
                              block_table=table, slot_mapping=table[0, pos // bs].to(torch.int64) * bs + pos % bs,
                              num_decodes=0)
        _sync(device)
        t0 = time.perf_counter()
        written = torch_ops.write(bound, k[start:end], v[start:end], plan)
        _sync(device)
        t1 = time.perf_counter()
        torch_ops.attend(bound, q[start:end], plan, written=written)
        _sync(device)
        t2 = time.perf_counter()
        qd = q[start:end].transpose(0, 1)[None]
        kd, vd = (x[:end].transpose(0, 1)[None] for x in (k, v))
        mask = torch.ones((end - start, end), dtype=torch.bool, device=device).tril(start)
        sdpa = _time(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True),  # noqa: B023
                     device, 1, 3)
        rows.append({"context": start, "chunk": end - start, "write_ms": (t1 - t0) * 1e3,
                     "attend_ms": (t2 - t1) * 1e3, "sdpa_ms": sdpa})
    return rows


COLUMNS = (("kernel", "kernel"), ("decode_direct", "JAX direct"), ("decode_bridge", "bridge decode"),
           ("write_step", "write, no block done"), ("write_step_completing", "write, B blocks done"),
           ("layer", "layer (forward)"), ("layer_completing", "layer, B blocks done"),
           ("layer_split", "layer: write, then decode"),
           ("sdpa_fp16", "torch SDPA fp16"))


def table(rows) -> str:
    """The closing table: pipelined ms per call (the kernel: device time per call), then the issue's
    ratios and the checks."""
    def cell(r, k):
        key = "kernel_ms" if k == "kernel" else k + "_pipelined_ms"
        return f"{r[key]:.3f}" if key in r else "-"

    def ratio(r, a, b):
        return f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"

    body = [[r["scheme"]] + [cell(r, k) for k, _ in COLUMNS]
            + [ratio(r, "decode_bridge_pipelined_ms", "decode_direct_pipelined_ms"),
               ratio(r, "layer_pipelined_ms", "kernel_ms"), ratio(r, "layer_pipelined_ms", "sdpa_fp16_pipelined_ms"),
               f"{r['plan_build_ms']:.2f}", f"{r['bridge_vs_direct_max_abs_diff']:.1e}",
               f"{r['bridge_vs_reference_max_abs_diff']:.1e}",
               f"{r['layer_vs_direct_max_abs_diff'] / max(r['direct_max_abs'], 1e-30):.1e}"] for r in rows]
    header = (["scheme"] + [h for _, h in COLUMNS]
              + ["bridge / direct", "layer / kernel", "layer / SDPA", "plan build (once a step)",
                 "max abs bridge - direct", "max abs bridge - reference", "layer - direct, of max abs"])
    return ("ms per call, pipelined (calls back to back, one wait); targets: bridge / direct <= 1.1, "
            "layer / kernel <= 1.25 and layer < SDPA, write without a completed block <= 0.05 ms\n"
            + markdown_table(header, body))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="kvarn_k4v2_g128,int8,fp8,fp16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32766, help="tokens in the cache before the decode step (its new "
                   "token then completes no block)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--chunk", type=int, default=8192, help="tokens per write while filling the cache")
    p.add_argument("--impl", default="auto", choices=["auto", "pallas", "reference"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=32, help="calls back to back in the pipelined timing")
    p.add_argument("--prefill-len", type=int, default=8192, help="the chunked-prefill profile's sequence length "
                   "(0: no profile)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per chunk in the prefill profile")
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.seq_len, a.q_heads, a.kv_heads, a.head_dim, a.iters, a.chunk, a.layers = 4, 510, 8, 2, 64, 5, 512, 4
        a.prefill_len, a.prefill_chunk = min(a.prefill_len, 1024), min(a.prefill_chunk, 256)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and jax.default_backend() != "gpu":
        sys.exit("torch sees a GPU but JAX does not: install the CUDA build of jax")
    dtype = getattr(torch, a.dtype)
    schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
    rows = [run_scheme(s, a, device, dtype) for s in schemes]
    prefill = [prefill_profile(s, a, device, dtype) for s in schemes] if a.prefill_len else []
    info = {**run_info(), "torch": torch.__version__, "torch_device": str(device),
            "torch_device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(f"device: {info['torch_device_name']}, jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**info, "args": vars(a), "rows": rows, "prefill": prefill}, f, indent=1)
    print(table(rows))
    if prefill:
        print(f"\nchunked prefill, one sequence of {a.prefill_len} tokens in chunks of {a.prefill_chunk}: ms per chunk "
              "(write + attention, each waited for) vs torch SDPA over the same keys (dense, model dtype)")
        print(markdown_table(["scheme"] + [f"context {c['context']}" for c in prefill[0]["chunks"]] + ["total", "SDPA total"],
                             [[p["scheme"]] + [f"{c['write_ms']:.1f} + {c['attend_ms']:.1f} vs {c['sdpa_ms']:.1f}"
                                               for c in p["chunks"]] + [f"{p['total_ms']:.1f}", f"{p['sdpa_total_ms']:.1f}"]
                              for p in prefill]))
    if not all(r["zero_copy_bind"] and r["in_place_write"] for r in rows):
        sys.exit("a cache was copied or not written in place")


if __name__ == "__main__":
    main()
