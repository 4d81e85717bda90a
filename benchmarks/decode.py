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
`--check` first compares each scheme's kernel (every variant) with the reference on a small random
cache (4 sequences of different lengths, with and without a window) and skips timing a scheme that
fails. Prints a line per shape and scheme, then a markdown table of ms per call and % of the byte
roofline, and writes JSON. On CPU the kernel runs interpreted: use tiny shapes (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402
from kvarn_jax.attention.workload import decode_bytes, random_cache  # noqa: E402
from timing import (add_model_args, copy_bandwidth, device_time, loop_time, markdown_table, ms,  # noqa: E402
                    profile_span, run_info)

DEFAULT_SHAPES = "32x32768,128x4096,256x8192,8x16384,1x131072"
DEFAULT_SCHEMES = "kvarn_k4v2_g128,kvarn_k4v4_g128,int8,int4,fp8,fp16"










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
    m = re.fullmatch(r"fold-(none|keys|all)", var)  # the defaults with this fold (`Launch.fold`)
    if m:
        return None if kj.parse(scheme).method == "fp8" else {"fold": m.group(1)}
    m = re.fullmatch(r"narrow-(max|bound)", var)  # bf16/fp32 caches: how operands reach fp16 (`Launch.narrow`)
    if m:
        return {"narrow": m.group(1)}
    m = re.fullmatch(r"r(\d+)", var)
    if m:
        return {"maxnreg": int(m.group(1))}
    if "=" in var:  # FIELD=VALUE[+FIELD=VALUE...]: the defaults with those `Launch` fields set
        kw = {}
        for item in var.split("+"):
            name, _, val = item.partition("=")
            if name not in pdp.Launch.__dataclass_fields__:
                raise SystemExit(f"bad variant {var!r}: {name!r} is not a Launch field")
            kw[name] = int(val) if val.isdigit() else None if val == "none" else val
        return kw
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


def check(cfg, hq, hk, d, bs, kw=None, window=None, dtype=jnp.float16):
    """Kernel (with launch/variant keywords `kw`) vs reference on a moderately sized random cache:
    max |kernel - reference| / max |reference|."""
    from kvarn_jax.hadamard import rotate, unrotate
    cache, tables, lens = random_cache(cfg, 4, 4 * bs + 37, hk, d, bs, dtype, seed=7)
    lens = jnp.array([4 * bs + 37, 3 * bs, bs - 5, 2 * bs + 1], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(5), (4, hq, d), jnp.float32)
    ref = kj.paged_decode_attention(q, cache, tables, lens, impl="reference", window=window)
    if kw is None:
        out = kj.paged_decode_attention(q, cache, tables, lens, impl="pallas", window=window)
    else:  # the kernel itself, in the stored frame, as paged_decode_attention calls it
        rot = kj.parse(cfg).rotated
        o = pdp.paged_decode_pallas(rotate(q) if rot else q, cache, tables, lens, jnp.arange(4, dtype=jnp.int32),
                                    scale=1.0 / np.sqrt(d), window=window,
                                    interpret=jax.default_backend() == "cpu", launch=pdp.Launch(**kw))
        out = unrotate(o) if rot else o
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BATCHxCONTEXT (default: %(default)s)")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES, help="comma list of scheme strings (default: %(default)s)")
    add_model_args(p)
    p.add_argument("--splits", default="", help="comma list of num_splits to try (default: the launch rule's only)")
    p.add_argument("--variants", default="", help="comma list of kernel variants wWsS[a][t][f][m][pP][iI][kK][rR] (num_warps W, num_stages S; "
                   "flags: a the PTX unpack, t tokens-major products (orient='tokens'), f the "
                   "magic bias folded into the sums (fold=True), m those sums as products with a ones matrix (sums='mma'); pP: tokens-major tiles in P parts; "
                   "iI: I tile-loop iterations per tile (steps); kK: per-token schemes' tokens per step (chunk); rR: at most R registers per thread (maxnreg); rR alone: the defaults with that cap; "
                   "fold-none|fold-keys|fold-all alone: the defaults with that fold; narrow-max|narrow-bound: with that Launch.narrow (bf16 caches); "
                   "FIELD=VALUE[+FIELD=VALUE...]: the defaults with those Launch fields, e.g. num_warps=2+num_stages=3; "
                   "suffix -pm: splits merged by the Pallas kernel, e.g. default-pm); default: the kernel's own defaults")
    p.add_argument("--no-baselines", action="store_true", help="skip torch SDPA and JAX's paged attention")
    p.add_argument("--check", action="store_true",
                   help="first compare every scheme and variant with the reference (with and without a window); "
                        "a scheme that fails is not timed")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                   help="the cache's (model's) dtype; bfloat16 caches take the kernel's wide products (default: %(default)s)")
    p.add_argument("--json", default="", help="write every measurement here (rewritten after each shape)")
    args = p.parse_args()
    hq, hk, d, bs = args.hq, args.hk, args.head_dim, args.block_size
    schemes = [s for s in args.schemes.split(",") if s]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    bw = copy_bandwidth()
    table = pdp.launch_table()
    results = {**run_info(), "copy_bandwidth_Bps": bw, "dtype": args.dtype, "hq": hq, "hk": hk, "head_dim": d, "block_size": bs,
               "launch_table": {"measured_on": table.measured_on, "num_sms": table.num_sms,
                                "this_family_measured": pdp.is_measured()},
               "checks": {}, "rows": []}
    print(f"device: {results['device']} ({results['backend']}), jax {results['jax']}; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"launch table of the {table.measured_on} ({table.num_sms} SMs)"
          + ("" if pdp.is_measured() else ", not measured on this GPU family"))
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
                        err = check(s, hq, hk, d, bs, kw if kw else None, window, jnp.dtype(args.dtype))
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
            cache, tables, lens = random_cache(s, batch, ctx, hk, d, bs, jnp.dtype(args.dtype))
            q = jax.random.normal(jax.random.PRNGKey(9), (batch, hq, d), jnp.dtype(args.dtype))
            nbytes = decode_bytes(cache, batch, ctx)
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
                        q, c, t, l, sid, scale=1.0 / np.sqrt(d), window=None,
                        interpret=jax.default_backend() == "cpu", launch=pdp.Launch(num_splits=ns, **kw))
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
        print(f"B={batch:<4d} L={ctx:<7d} fp16 SDPA {ms(row.get('fp16_sdpa_s'))} ms | jax paged fp16 {ms(row.get('jax_paged_fp16_s'))} ms")
        for s, r in row["schemes"].items():
            print(f"    {s:<18s} {ms(r['device_s'])} ms  (loop {ms(r['loop_s'])} ms, span {ms(r['span_s'])} ms)  roofline {ms(r['roofline_s'])} ms"
                  f"  {100 * r['roofline_frac']:5.1f}% of roofline  splits={r['num_splits']} {r['variant']}"
                  f"  entry {ms(r['entry_device_s'])} ms")
        if args.json:  # after every shape: a run cut off by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    print()
    print(summary_table(results))


def summary_table(results: dict) -> str:
    """Scheme x shape: ms per call (span where the profiler ran, else the scan time) and, in brackets,
    the share of the byte roofline; then the fp16 baselines."""
    rows = results["rows"]
    header = ["batch x context"] + [f"{r['batch']} x {r['ctx']}" for r in rows]
    schemes = list(dict.fromkeys(s for r in rows for s in r["schemes"]))
    body = [[s] + [f"{ms(r['schemes'][s]['rank_s'])} ({100 * r['schemes'][s]['roofline_frac']:.0f}%)"
                   if s in r["schemes"] else "-" for r in rows] for s in schemes]
    for key, name in (("fp16_sdpa_s", "torch SDPA, fp16, contiguous"), ("jax_paged_fp16_s", "JAX paged attention, fp16")):
        if any(r.get(key) is not None for r in rows):
            body.append([name] + [ms(r.get(key)) for r in rows])
    return markdown_table(header, body)


if __name__ == "__main__":
    main()
