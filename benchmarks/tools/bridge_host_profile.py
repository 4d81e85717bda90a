"""Where the vLLM bridge's decode layer spends its host time, by part (the fused step's levers).

    python benchmarks/tools/bridge_host_profile.py [--schemes kvarn_k4v2_g128,fp16] [--seq-len 32766]

One layer's cache laid out as vLLM allocates it (as `benchmarks/bridge_overhead.py` does, filled
through the bridge's writes), then a decode step of --batch rows with q, k and v views of one
tensor. Per part of `torch_ops.forward`'s fused step (`_decode_step_library` on GPUs): the median
host time of one call (each waited for before the next) and the pipelined time per call (32 back
to back, one wait), then the whole layer's cProfile, largest own time first. On a CPU the parts
run with impl "reference" on small shapes (--tiny): a smoke run, not a profile of a GPU's host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bridge_overhead import _pipelined, _plan, _sync, _time, filled_layer  # noqa: E402
from kvarn_vllm import torch_ops as T  # noqa: E402


def bound_layer(scheme, a, device, dtype):
    """A filled layer cache (`bridge_overhead.filled_layer`) and a decode step's plan: one new token
    per row at position seq_len."""
    lay, _, bound, tables, g = filled_layer(scheme, a, device, dtype)
    return bound, _plan(lay, tables, np.full(a.batch, a.seq_len + 1), device), g


def profile_scheme(scheme, a, device, dtype):
    impl = "auto" if device.type == "cuda" else "reference"
    bound, plan, g = bound_layer(scheme, a, device, dtype)
    hq, hk, d = a.q_heads, a.kv_heads, a.head_dim
    qkv = torch.randn((a.batch, hq + 2 * hk, d), generator=g, device=device, dtype=dtype)
    q, k, v = qkv.split([hq, hk, hk], dim=1)
    out = torch.empty_like(q)
    forward = lambda: T.forward(bound, q, k, v, plan, impl=impl, out=out)  # noqa: E731
    forward()
    _sync(device)
    if not T.fuses_library_step(bound, plan, T.decode_impl(impl)):
        sys.exit(f"{scheme}: this step does not take the fused library step here")
    b = a.batch
    bb = T.bucket(b, 1)
    cols = T._used_columns(plan.max_decode_len, a.block_size, plan.block_table.shape[1])
    _, idx_j = plan.cache[("decode_step_idx", bb, cols)]
    _, qkv_j = T._qkv_fenced(q, k, v, b, bb)
    dev = bound.buffer.device
    pending = T._pending_altered(dev, b)
    step = lambda: T._decode_library_step(  # noqa: E731
        qkv_j, bound.cache, idx_j, pending, scale=1 / np.sqrt(d), impl=impl, passthrough=bound.cfg.is_passthrough,
        slots=b, q_heads=hq)
    res = step()
    jax.block_until_ready(res[0])
    packed = T._to_torch(res[0])
    rows, o = T._unpacked_step(packed, (2, bb, hk, d), bound.rows.dtype, (bb, hq, d), q.dtype)
    dst, src = T._row_destinations(plan, bound, bb)
    flat = rows.reshape(-1, d)
    parts = {
        "forward (the layer)": forward,
        "write then attend": lambda: (T.write(bound, k, v, plan), T.attend(bound, q, plan, impl=impl, out=out)),
        "import q, k, v (fence)": lambda: T._qkv_fenced(q, k, v, b, bb),
        "the jitted step's call": step,
        "export its result": lambda: T._to_torch(res[0]),
        "views of the result": lambda: T._unpacked_step(packed, (2, bb, hk, d), bound.rows.dtype, (bb, hq, d),
                                                        q.dtype),
        "rows' indexed copy": lambda: bound.rows.index_copy_(0, dst, flat if src is None else flat.index_select(0, src)),
        "output copy": lambda: out.copy_(o),
        "argument checks": lambda: (T._check_plan(bound, plan), T._check_tokens(bound, k, "key", b, hk),
                                    T._check_tokens(bound, q, "query", b, None)),
    }
    print(f"== {scheme} (B={b}, L={a.seq_len + 1}, impl {impl}): host ms per call (median), pipelined ms per call")
    for name, fn in parts.items():
        print(f"  {name:24s} {_time(fn, device, 3, 40, host_only=True):8.3f} {_pipelined(fn, device, 3, 32):8.3f}")
    print("  inside the layer, each part of the fused step (median host ms, each call waited for):")
    for name, ms in in_context(forward, device).items():
        print(f"    {name:30s} {ms:8.3f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        forward()
    _sync(device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())


# what `forward`'s fused step calls, in its order; each timed inside the layer by `in_context`
_STEP_PARTS = (("_check_plan", "checks"), ("_check_tokens", "checks"), ("_filled_block_size", "filled block size"),
               ("_qkv_fenced", "import q, k, v (fence)"), ("_pending_altered", "pending total"),
               ("_decode_library_step", "the jitted step's call"), ("_set_pending_altered", "set pending total"),
               ("_store_step", "export, views, copies"))


def in_context(forward, device, iters=40) -> dict:
    """The host time of each function `torch_ops.forward`'s fused step calls (`_STEP_PARTS`, each
    wrapped with a clock for the run; "the rest": forward's own lines - plan lookups, releasing the
    last call's arrays), median over calls each waited for: what the parts above cost inside the
    layer rather than alone."""
    spent, times = {}, {}

    def timed(fn, name):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return call
    saved = {attr: getattr(T, attr) for attr, _ in _STEP_PARTS}
    for attr, name in _STEP_PARTS:
        setattr(T, attr, timed(saved[attr], name))
    try:
        for it in range(iters + 3):
            spent.clear()
            t = time.perf_counter()
            forward()
            total = time.perf_counter() - t
            _sync(device)
            if it >= 3:
                for name, s in {**spent, "the rest": total - sum(spent.values()), "all of it": total}.items():
                    times.setdefault(name, []).append(s * 1e3)
    finally:
        for attr, fn in saved.items():
            setattr(T, attr, fn)
    return {name: float(np.median(v)) for name, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="kvarn_k4v2_g128,fp16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32766)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk", type=int, default=8192, help="tokens per write while filling the cache")
    p.add_argument("--top", type=int, default=25, help="cProfile rows shown")
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU run")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.seq_len, a.q_heads, a.kv_heads, a.head_dim, a.chunk = 4, 510, 8, 2, 64, 512
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and jax.default_backend() != "gpu":
        sys.exit("torch sees a GPU but JAX does not: install the CUDA build of jax")
    for scheme in [s.strip() for s in a.schemes.split(",") if s.strip()]:
        profile_scheme(scheme, a, device, torch.bfloat16)


if __name__ == "__main__":
    main()
