"""Decode attention benchmark: our Pallas kernel per scheme vs FP16 baselines and the byte roofline.

    python benchmarks/decode.py [--shapes 32x32768,128x4096,...] [--schemes kvarn_k4v2_g128,...]
                                [--json out.json] [--check]

For each shape (batch x context) it builds a paged cache with random contents (codes, positive
scales) and random block tables, then times:
  - ours: kvarn_jax.paged_decode_attention(impl="pallas") per scheme (device time per call, from a
    lax.scan of dependent calls, and the plain dispatch loop time) and, per variant, the span of
    one call's kernels on the device from torch's profiler (no scan overhead; `span`), by which the
    variants are ranked and the roofline share is computed when it is available;
  - fp16 SDPA: torch scaled_dot_product_attention on contiguous K/V (if torch with CUDA is present);
  - jax paged: JAX's own Pallas GPU paged attention on fp16 pages (if it runs);
  - roofline: bytes the kernel must read / measured copy bandwidth.
`--check` also compares the kernel with the reference on the first shape (relative error).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402

DEFAULT_SHAPES = "32x32768,128x4096,256x8192,8x16384,1x131072"
DEFAULT_SCHEMES = "kvarn_k4v2_g128,kvarn_k4v4_g128,int8,int4,fp8,fp16"


def random_cache(cfg, batch, ctx, hk, d, bs, dtype, seed=0):
    """A cache whose pages hold random codes and plausible scales, and random block tables."""
    blocks_per_seq = -(-ctx // bs)
    nb = batch * blocks_per_seq
    cache = kj.PagedKVCache.create(cfg, num_blocks=nb, block_size=bs, num_kv_heads=hk, head_dim=d,
                                   max_seqs=batch, dtype=dtype)
    key = jax.random.PRNGKey(seed)

    def fill(path, a):
        nonlocal key
        key, sub = jax.random.split(key)
        name = str(path[-1])
        if a.dtype == jnp.uint8:
            r = jax.random.randint(sub, a.shape, 0, 256, jnp.int32).astype(jnp.uint8)
            if kj.parse(cfg).method == "fp8":  # avoid e4m3 NaN patterns (x1111111)
                r = jnp.where((r & 0x7F) == 0x7F, r & 0xFE, r)
            return r
        if a.dtype == jnp.int32:
            return a
        if "scale" in name:
            return jax.random.uniform(sub, a.shape, jnp.float32, 0.02, 0.2).astype(a.dtype)
        return (jax.random.normal(sub, a.shape, jnp.float32) * (0.1 if "zero" in name else 1.0)).astype(a.dtype)

    cache = jax.tree_util.tree_map_with_path(fill, cache)
    perm = np.random.default_rng(seed).permutation(nb).astype(np.int32)
    tables = jnp.asarray(perm.reshape(batch, blocks_per_seq))
    lens = jnp.full((batch,), ctx, jnp.int32)
    return cache, tables, lens


def kernel_bytes(cache, batch, ctx):
    """Bytes one decode call must read for `batch` sequences of `ctx` tokens: the quantized pages of
    the full blocks between the sink and the query's own block, and the high-precision sink and
    query's block (`paged.gather_dense`: the block holding position ctx - 1 is read from the tail
    ring even when it is full, so at ctx a multiple of the block size that is a whole block in
    fp16, not none). q and the output are left out (16 KB a sequence at Hq=32, D=128: 0.4% of 4K tokens)."""
    cfg, bs = cache.cfg, cache.block_size
    per_token = kj.bytes_per_token(cfg, cache.head_dim) * cache.num_kv_heads
    hp_tokens = 0 if cfg.is_passthrough else ctx if ctx <= bs else bs + (ctx - 1) % bs + 1
    quant_tokens = ctx - hp_tokens
    hp_bytes = hp_tokens * cache.num_kv_heads * cache.head_dim * 2 * jnp.dtype(cache.dtype).itemsize
    return batch * (quant_tokens * per_token + hp_bytes)


def device_time(fn, args, reps=20):
    """Seconds per call on the device: `reps` dependent calls inside one jitted scan."""

    @jax.jit
    def many(q, *rest):
        def body(c, _):
            o = fn(q + c, *rest)
            return c + (o[0, 0, 0] * 0).astype(c.dtype), None
        c, _ = jax.lax.scan(body, jnp.zeros((), q.dtype), None, length=reps)
        return c

    many(*args).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        many(*args).block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times))


def loop_time(fn, args, reps=50):
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        o = f(*args)
    jax.block_until_ready(o)
    return (time.perf_counter() - t) / reps


def kernel_events(fn, args, calls):
    """[(name, start_us, duration_us)] of every CUDA kernel run during `calls` calls of fn."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    f = jax.jit(fn)
    for _ in range(3):
        jax.block_until_ready(f(*args))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            jax.block_until_ready(f(*args))  # one call at a time: its kernels form one span
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            out.append((e.name, e.time_range.start, e.device_time))
    return sorted(out, key=lambda x: x[1])


def spans(events, calls):
    """Split the sorted events into `calls` groups at the largest gaps; (first start, last end) each."""
    if not events:
        return []
    ends = [s + d for _, s, d in events]
    gaps = sorted(range(1, len(events)), key=lambda i: events[i][1] - ends[i - 1], reverse=True)[:calls - 1]
    cuts = [0] + sorted(gaps) + [len(events)]
    return [(events[a][1], max(ends[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]


def profile_span(fn, args, calls=20):
    """(median span of one call from its first kernel's start to its last kernel's end, the sum of
    its kernels' durations), in seconds, from torch's profiler; None without torch and CUDA."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    ev = kernel_events(fn, args, calls)
    sp = spans(ev, calls)
    if not sp:
        return None
    return float(np.median([b - a for a, b in sp])) * 1e-6, sum(d for _, _, d in ev) / calls * 1e-6


def copy_bandwidth():
    """Device-to-device copy bandwidth (bytes read + written per second): torch's copy_ when available
    (the measurement that gave 4.3 TB/s on the H200), else a jax elementwise pass."""
    try:
        import torch
        if torch.cuda.is_available():
            x = torch.empty(2 ** 32, dtype=torch.uint8, device="cuda").random_(0, 255)
            y = torch.empty_like(x)
            y.copy_(x)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(10):
                start.record()
                y.copy_(x)
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end) / 1e3)
            bw = 2 * x.numel() / float(np.median(ts))
            del x, y
            torch.cuda.empty_cache()
            return bw
    except ImportError:
        pass
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 1024, 1024), jnp.float32)  # 2 GiB
    f = jax.jit(lambda x: x * 1.0001)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / float(np.median(ts))


def torch_sdpa_time(batch, ctx, hq, hk, d):
    try:
        import torch
        import torch.nn.functional as F
        if not torch.cuda.is_available():
            return None
        q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.float16)
        v = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.float16)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(5):
            start.record()
            for _ in range(20):
                fn()
            end.record()
            torch.cuda.synchronize()
            ts.append(start.elapsed_time(end) / 20 / 1e3)
        return float(np.median(ts))
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        print(f"  torch SDPA baseline failed: {type(e).__name__}: {e}")
        return None


def jax_paged_time(batch, ctx, hq, hk, d, bs):
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa
        pages = batch * (ctx // bs)
        kp = jax.random.normal(jax.random.PRNGKey(2), (hk, pages, bs, d), jnp.float16)
        vp = jax.random.normal(jax.random.PRNGKey(3), (hk, pages, bs, d), jnp.float16)
        q = jax.random.normal(jax.random.PRNGKey(4), (batch, hq, d), jnp.float16)
        bt = jnp.asarray(np.random.default_rng(0).permutation(pages).astype(np.int32).reshape(batch, -1))
        lens = jnp.full((batch,), ctx, jnp.int32)
        best = None
        for ppcb, stages in ((2, 2), (1, 1), (4, 1)):  # the default (8 pages, 2 stages) overflows shared memory
            try:
                fn = lambda q, kp, vp, bt, lens, ppcb=ppcb, stages=stages: jpa.paged_attention(
                    q, kp, vp, bt, lens, pages_per_compute_block=min(ppcb, ctx // bs), num_stages=stages)
                t = device_time(fn, (q, kp, vp, bt, lens))
                best = t if best is None else min(best, t)
            except Exception as e:  # noqa: BLE001
                print(f"  jax paged attention ({ppcb} pages/step, {stages} stages) failed: {type(e).__name__}: {str(e)[:120]}")
        return best
    except Exception as e:  # noqa: BLE001
        print(f"  jax paged attention baseline failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def add_model_args(p):
    """The model-shape flags the decode benchmarks share (default: the issue's Hq=32, Hk=8, D=128,
    block 128)."""
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hk", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)


def variant_kwargs(var: str, scheme: str) -> dict | None:
    """Kernel keyword arguments of a variant name wWsS[a][t][f][m][pP][iI][kK][rR] ("default": none; "rR"
    alone: the defaults with a register cap of R), any of them with the suffix "-pm": the splits
    merged by the Pallas kernel (merge="pallas"); None if the variant does not apply to the scheme
    (tokens-major: KVarN/KIVI and per-token schemes with one scale per token; fold: integer codes)."""
    if var.endswith("-pm"):
        kw = variant_kwargs(var[:-3], scheme)
        return None if kw is None else {**kw, "merge": "pallas"}
    if var == "default":
        return {}
    m = re.fullmatch(r"r(\d+)", var)
    if m:
        return {"maxnreg": int(m.group(1))}
    m = re.fullmatch(r"w(\d+)s(\d+)([atfm]*)(?:p(\d+))?(?:i(\d+))?(?:k(\d+))?(?:r(\d+))?", var)
    if not m:
        raise SystemExit(f"bad variant {var!r} (expected wWsS[a][t][f][m][pP][iI][kK][rR] or rR)")
    fl = m.group(3)
    c = kj.parse(scheme)
    if "t" in fl and pdp.tokens_major_unsupported(c, 128):
        return None
    if "f" in fl and c.method == "fp8":  # no integer codes to bias
        return None
    return dict(num_warps=int(m.group(1)), num_stages=int(m.group(2)), unpack="asm" if "a" in fl else "magic",
                orient="tokens" if "t" in fl else "heads", fold="f" in fl, parts=int(m.group(4) or 1),
                sums="mma" if "m" in fl else "reduce", steps=int(m.group(5) or 1),
                maxnreg=int(m.group(7)) if m.group(7) else None, **({"chunk": int(m.group(6))} if m.group(6) else {}))


def check(cfg, hq, hk, d, bs, kw=None, window=None):
    """Kernel (with launch/variant keywords `kw`) vs reference on a moderately sized random cache:
    max |kernel - reference| / max |reference|."""
    from kvarn_jax.hadamard import rotate, unrotate
    cache, tables, lens = random_cache(cfg, 4, 4 * bs + 37, hk, d, bs, jnp.float16, seed=7)
    lens = jnp.array([4 * bs + 37, 3 * bs, bs - 5, 2 * bs + 1], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(5), (4, hq, d), jnp.float32)
    ref = kj.paged_decode_attention(q, cache, tables, lens, impl="reference", window=window)
    if kw is None:
        out = kj.paged_decode_attention(q, cache, tables, lens, impl="pallas", window=window)
    else:  # the kernel itself, in the stored frame, as paged_decode_attention calls it
        rot = kj.parse(cfg).rotated
        o = pdp.paged_decode_pallas(rotate(q) if rot else q, cache, tables, lens, jnp.arange(4, dtype=jnp.int32),
                                    scale=1.0 / np.sqrt(d), window=window,
                                    interpret=jax.default_backend() == "cpu", **kw)
        out = unrotate(o) if rot else o
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--schemes", default=DEFAULT_SCHEMES)
    add_model_args(p)
    p.add_argument("--splits", default="", help="comma list of num_splits to try (default: heuristic only)")
    p.add_argument("--variants", default="", help="comma list of kernel variants wWsS[a][t][f][m][pP][iI][kK][rR] (num_warps W, num_stages S; "
                   "flags: a the PTX unpack `_planes_asm`, t tokens-major products (orient='tokens'), f the "
                   "magic bias folded into the sums (fold=True), m those sums as products with a ones matrix (sums='mma'); pP: tokens-major tiles in P parts; "
                   "iI: I tile-loop iterations per tile (steps); kK: per-token schemes' tokens per step (chunk); rR: at most R registers per thread (maxnreg); rR alone: the defaults with that cap; "
                   "suffix -pm: splits merged by the Pallas kernel, e.g. default-pm); default: the kernel's own defaults")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    hq, hk, d, bs = args.hq, args.hk, args.head_dim, args.block_size
    schemes = [s for s in args.schemes.split(",") if s]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    dev = jax.devices()[0]
    bw = copy_bandwidth()
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s")
    results = {"device": dev.device_kind, "jax": jax.__version__, "copy_bandwidth_Bps": bw,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "hq": hq, "hk": hk,
               "head_dim": d, "block_size": bs, "python": platform.python_version(), "checks": {}, "rows": []}
    try:
        results["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        results["commit"] = ""
    variant_names = args.variants.split(",") if args.variants else ["default"]
    if args.check:  # every variant, without and with a sliding window
        for s in schemes:
            for var in variant_names:
                kw = variant_kwargs(var, s)
                if kw is None:
                    continue
                for window in (None, 2 * bs + 3):
                    key = f"{s}/{var}" + (f"/window{window}" if window else "")
                    try:
                        err = check(s, hq, hk, d, bs, kw if kw else None, window)
                    except Exception as e:  # noqa: BLE001 - report and go on with the other schemes
                        print(f"check {key}: FAILED {type(e).__name__}: {str(e)[:2000]}")
                        results["checks"][key] = f"error: {type(e).__name__}"
                        continue
                    results["checks"][key] = err
                    print(f"check {key}: max|kernel - reference| / max|reference| {err:.2e}")
    splits = [int(x) for x in args.splits.split(",") if x] or [None]
    for batch, ctx in shapes:
        row = {"batch": batch, "ctx": ctx, "schemes": {}}
        if not args.no_baselines:
            row["fp16_sdpa_s"] = torch_sdpa_time(batch, ctx, hq, hk, d)
            row["jax_paged_fp16_s"] = jax_paged_time(batch, ctx, hq, hk, d, bs)
        for s in schemes:
            if any(isinstance(v, str) for k, v in results["checks"].items() if k.split("/")[0] == s):
                continue  # the kernel failed its check: timing it would mean nothing
            cache, tables, lens = random_cache(s, batch, ctx, hk, d, bs, jnp.float16)
            q = jax.random.normal(jax.random.PRNGKey(9), (batch, hq, d), jnp.float16)
            nbytes = kernel_bytes(cache, batch, ctx)
            best = None
            variants = {}
            sid = None  # sequence b's sink and tail at row b, as paged_decode_attention passes them
            for ns in splits:
                for var in variant_names:
                    kw = variant_kwargs(var, s)
                    if kw is None:
                        continue
                    # the kernel itself (q in the stored frame), as paged_decode_attention calls it
                    fn = lambda q, c, t, l, ns=ns, kw=kw: pdp.paged_decode_pallas(
                        q, c, t, l, sid, scale=1.0 / np.sqrt(d), window=None, num_splits=ns,
                        interpret=jax.default_backend() == "cpu", **kw)
                    t_dev = device_time(fn, (q, cache, tables, lens))
                    # the same call's kernels on the device, without the scan's per-iteration overhead
                    # (17-27 us on the H200, benchmarks/results/2026-12-01_decode_maxnreg_h200.md)
                    prof = profile_span(fn, (q, cache, tables, lens))
                    span, kern = prof if prof else (None, None)
                    variants[f"{var}_splits{ns}"] = {"scan_s": t_dev, "span_s": span, "kernels_s": kern}
                    # ranked by span where the profiler runs (GPU), else by the scan time
                    key = span if span is not None else t_dev
                    if best is None or key < best["rank_s"]:
                        best = {"device_s": t_dev, "span_s": span, "kernels_s": kern, "rank_s": key,
                                "num_splits": ns, "variant": var}
            best["variants"] = variants
            fn = lambda q, c, t, l, ns=best["num_splits"]: kj.paged_decode_attention(q, c, t, l, impl="pallas", num_splits=ns)
            best["loop_s"] = loop_time(fn, (q, cache, tables, lens))
            best["entry_device_s"] = device_time(fn, (q, cache, tables, lens))
            best["bytes"] = nbytes
            best["roofline_s"] = nbytes / bw
            best["roofline_frac"] = best["roofline_s"] / best["rank_s"]
            row["schemes"][s] = best
            del cache
        results["rows"].append(row)
        ms = lambda x: "   -   " if x is None else f"{x * 1e3:7.3f}"
        print(f"B={batch:<4d} L={ctx:<7d} fp16 SDPA {ms(row.get('fp16_sdpa_s'))} ms | jax paged fp16 {ms(row.get('jax_paged_fp16_s'))} ms")
        for s, r in row["schemes"].items():
            print(f"    {s:<18s} {ms(r['device_s'])} ms  (loop {ms(r['loop_s'])} ms, span {ms(r['span_s'])} ms)  roofline {ms(r['roofline_s'])} ms"
                  f"  {100 * r['roofline_frac']:5.1f}% of roofline  splits={r['num_splits']} {r['variant']}"
                  f"  entry {ms(r['entry_device_s'])} ms")
        if args.json:  # after every shape: a run cut off by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
