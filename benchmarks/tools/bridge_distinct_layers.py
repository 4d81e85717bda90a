"""The vLLM bridge's fused decode layer (`torch_ops.forward`, a decode-only step that completes no
block) on one layer's cache called again and again - as `bridge_overhead.py` times it - against
calls that cycle through N layers' caches, as a vLLM step's layers do, each both ways: with the one
executable every layer shares (the bridge's code) and with an executable of its own per layer.

The question behind it: XLA runs the step's executable as a CUDA graph and, before each launch,
updates the graph's commands whose buffers moved since that executable's previous call. With one
executable for every layer, each call brings another layer's cache; with one per layer, a layer's
cache is where its executable last saw it. If updating those commands were what the layer's host
time pays for, the distinct caches would be slower with the shared executable and as fast as one
cache with one executable per layer.

    python benchmarks/tools/bridge_distinct_layers.py [--layers-cycled 8] [--json out.json]
    python benchmarks/tools/bridge_distinct_layers.py --tiny --impl reference    # CPU smoke run

One cache is filled through the bridge's writes (`bridge_overhead.filled_layer`), the others are
copies of its tensor, each bound as vLLM binds a layer's. Rows: ms per call pipelined (`--layers`
calls back to back, one wait; best of 3, over `--rounds` rounds alternating the variants) and host
only (the call alone), and the kernel alone as `bridge_overhead.py` times it. Every variant's output
is checked equal to the first's (the same bits: the same computation on copies of one cache).
Defaults: B = 32, L = 32K, Hq = 32, Hk = 8, D = 128, bf16, kvarn_k4v2_g128.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bridge_overhead as bo  # noqa: E402
from kvarn_vllm import torch_ops  # noqa: E402
from timing import run_info  # noqa: E402

SHARED = torch_ops._decode_library_step
STATIC = ("scale", "impl", "passthrough", "slots", "q_heads", "completes")


def per_layer_step():
    """A stand-in for `torch_ops._decode_library_step` that keeps one jitted copy of it per cache:
    distinct function objects, so JAX traces and compiles each on its own (its own executable)."""
    f, own = SHARED.__wrapped__, {}

    def step(qkv, cache, *rest, **kw):
        if id(cache) not in own:
            own[id(cache)] = jax.jit(functools.wraps(f)(lambda *x, **y: f(*x, **y)), static_argnames=STATIC)
        return own[id(cache)](qkv, cache, *rest, **kw)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", default="kvarn_k4v2_g128")
    p.add_argument("--layers-cycled", type=int, default=8, help="distinct layers' caches the cycling rows go through")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--impl", default="auto", choices=["auto", "pallas", "reference"])
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU run")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    ns = argparse.Namespace(batch=32, seq_len=32766, q_heads=32, kv_heads=8, head_dim=128, block_size=128,
                            dtype="bfloat16", chunk=8192, impl=a.impl, warmup=3, iters=20, layers=32)
    if a.tiny:
        ns.batch, ns.seq_len, ns.q_heads, ns.kv_heads, ns.head_dim, ns.iters, ns.chunk, ns.layers = 4, 510, 8, 2, 64, 5, 512, 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch_ops.decode_impl(a.impl) == "served":
        sys.exit(f"impl={a.impl!r} runs the CPU's served decode here, which has no library step to compare: "
                 "pass --impl reference")
    dtype = getattr(torch, ns.dtype)
    t0 = time.perf_counter()
    lay, kv, bound0, tables, g = bo.filled_layer(a.scheme, ns, device, dtype)
    bounds = [bound0] + [torch_ops.bind(kv.clone(), lay) for _ in range(a.layers_cycled - 1)]
    print(f"{a.layers_cycled} layers' caches filled and bound in {time.perf_counter() - t0:.1f} s", flush=True)

    b = ns.batch
    lens = np.full(b, ns.seq_len + 1)
    qkv = torch.randn((b, ns.q_heads + 2 * ns.kv_heads, ns.head_dim), generator=g, device=device, dtype=dtype)
    q, k1, v1 = qkv.split([ns.q_heads, ns.kv_heads, ns.kv_heads], dim=1)
    plan = bo._plan(lay, tables, lens, device)
    out = torch.empty_like(q)

    def cycling(caches):
        i = [0]

        def layer():
            bd = caches[i[0] % len(caches)]
            i[0] += 1
            return torch_ops.forward(bd, q, k1, v1, plan, impl=a.impl, out=out)
        return layer

    variants = {"one cache, shared executable": (bounds[:1], SHARED),
                f"{a.layers_cycled} caches, shared executable": (bounds, SHARED),
                "one cache, executable per layer": (bounds[:1], per_layer_step()),
                f"{a.layers_cycled} caches, executable per layer": (bounds, per_layer_step())}
    rows = {name: {"pipelined_ms": [], "host_ms": []} for name in variants}
    outputs = {}
    for _ in range(a.rounds):
        for name, (caches, step) in variants.items():
            torch_ops._decode_library_step = step
            try:
                fn = cycling(caches)
                warm = ns.warmup + len(caches)
                rows[name]["host_ms"].append(bo._time(fn, device, warm, ns.iters, host_only=True))
                rows[name]["pipelined_ms"].append(bo._pipelined(fn, device, warm, ns.layers))
                outputs[name] = fn().float().cpu().numpy()
            finally:
                torch_ops._decode_library_step = SHARED
            print(f"  {name:36s} pipelined {rows[name]['pipelined_ms'][-1]:.3f} ms, host only "
                  f"{rows[name]['host_ms'][-1]:.3f} ms", flush=True)

    qj = jnp.asarray(jax.dlpack.from_dlpack(q.contiguous()))
    cols = -(-(ns.seq_len + 1) // ns.block_size)
    tj, lj = jnp.asarray(tables.cpu().numpy()[:, :cols]), jnp.asarray(lens, jnp.int32)
    sid = None if lay.cfg.is_passthrough else jnp.arange(b, dtype=jnp.int32)

    kernel_ms = bo.kernel_ms(qj, bound0.cache, tj, lj, sid, a.impl, ns.layers, device)
    first = next(iter(outputs.values()))
    same = {name: bool(np.array_equal(o, first)) for name, o in outputs.items()}
    info = {**run_info(), "torch": torch.__version__,
            "torch_device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(f"\ndevice: {info['torch_device_name']}; {a.scheme}, B={b}, L={ns.seq_len + 1}; kernel alone {kernel_ms:.3f} ms")
    print("| variant | pipelined ms (best of rounds) | / kernel | host only ms (median of rounds) | output equal |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        best = min(r["pipelined_ms"])
        print(f"| {name} | {best:.3f} | {best / kernel_ms:.2f}x | {statistics.median(r['host_ms']):.3f} | {same[name]} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**info, "args": vars(a), "kernel_ms": kernel_ms, "rows": rows, "output_equal": same}, f, indent=1)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
