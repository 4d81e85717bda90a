"""Where a decode call's device time goes: every GPU kernel of one call, with its duration.

    python benchmarks/decode_profile.py [--shapes 1x131072,8x16384] [--schemes kvarn_k4v2_g128]
                                        [--entry kernel|public] [--merge default|xla|pallas|kernel] [--calls 20] [--json out.json]

`decode.py` times whole calls (a scan of dependent calls); at small batch that time is far above the
byte roofline, and this script says which kernels make it up. It runs `--calls` calls of the kernel
entry (`paged_decode_pallas`, as decode.py times it) or the public `paged_decode_attention` under
torch's profiler, whose CUPTI tracing records every kernel of the process, JAX's included. It prints,
per kernel name, the launches per call and the device microseconds per call, the sum of all kernels,
the span of one call from its first kernel's start to its last kernel's end (gaps included), and the
scan-loop time decode.py reports, so the three can be compared, and ends with a markdown table of
those three per shape and scheme. Needs torch with CUDA.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402
from kvarn_jax.attention.workload import random_cache  # noqa: E402
from timing import add_model_args, device_time, kernel_events, markdown_table, run_info, spans  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x131072,8x16384,32x32768", help="comma list of BATCHxCONTEXT (default: %(default)s)")
    p.add_argument("--schemes", default="kvarn_k4v2_g128", help="comma list of scheme strings (default: %(default)s)")
    p.add_argument("--entry", default="kernel", choices=["kernel", "public"],
                   help="the kernel entry as decode.py times it, or the public paged_decode_attention")
    p.add_argument("--splits", type=int, default=None, help="num_splits (default: the launch rule's)")
    p.add_argument("--merge", default="default", choices=["default", "xla", "pallas", "kernel"],
                   help="kernel entry: how the splits are merged (default: the kernel's own choice, "
                        "`default_merge` or, with one split, kernel; kernel needs one split: --splits 1)")
    p.add_argument("--calls", type=int, default=20, help="calls profiled per shape and scheme")
    add_model_args(p)
    p.add_argument("--json", default="", help="write the measurements here")
    args = p.parse_args()
    hq, hk, d, bs = args.hq, args.hk, args.head_dim, args.block_size
    if args.merge == "kernel" and args.splits != 1:
        p.error("--merge kernel needs --splits 1 (the kernel finishes its output only with one split)")
    if args.merge != "default" and args.entry != "kernel":
        p.error("--merge applies to --entry kernel (the public entry uses the kernel's default)")
    res = {**run_info(), "entry": args.entry, "merge": args.merge, "rows": []}
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        for s in args.schemes.split(","):
            cache, tables, lens = random_cache(s, batch, ctx, hk, d, bs, jnp.float16)
            q = jax.random.normal(jax.random.PRNGKey(9), (batch, hq, d), jnp.float16)
            sid = None  # sequence b's sink and tail at row b, as paged_decode_attention passes them
            if args.entry == "kernel":
                fn = lambda q, c, t, l: pdp.paged_decode_pallas(  # noqa: E731
                    q, c, t, l, sid, scale=1.0 / np.sqrt(d), window=None,
                    launch=pdp.Launch(num_splits=args.splits, merge=None if args.merge == "default" else args.merge))
            else:
                fn = lambda q, c, t, l: kj.paged_decode_attention(q, c, t, l, impl="pallas",  # noqa: E731
                                                                  num_splits=args.splits)
            ev = kernel_events(fn, (q, cache, tables, lens), args.calls)
            per = collections.defaultdict(lambda: [0, 0.0])
            for name, _, dur in ev:
                per[name][0] += 1
                per[name][1] += dur
            sp = spans(ev, args.calls)
            span_us = float(np.median([b - a for a, b in sp])) if sp else float("nan")
            total_us = sum(v[1] for v in per.values()) / args.calls
            scan_us = device_time(fn, (q, cache, tables, lens)) * 1e6
            row = {"batch": batch, "ctx": ctx, "scheme": s, "kernel_sum_us": total_us, "span_us": span_us,
                   "scan_us": scan_us,
                   "kernels": {n: {"per_call": c / args.calls, "us_per_call": t / args.calls}
                               for n, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])}}
            res["rows"].append(row)
            print(f"B={batch} L={ctx} {s} ({args.entry}, merge={args.merge}): kernels {total_us:.1f} us/call, one call's span "
                  f"{span_us:.1f} us, scan-loop time {scan_us:.1f} us")
            for n, v in row["kernels"].items():
                print(f"    {v['us_per_call']:8.1f} us  x{v['per_call']:.0f}  {n[:110]}")
            del cache
    print()
    print(markdown_table(["batch x context", "scheme", "kernels (us)", "span (us)", "scan loop (us)", "kernel launches"],
                         [[f"{r['batch']} x {r['ctx']}", r["scheme"], f"{r['kernel_sum_us']:.1f}", f"{r['span_us']:.1f}",
                           f"{r['scan_us']:.1f}", f"{sum(k['per_call'] for k in r['kernels'].values()):.0f}"]
                          for r in res["rows"]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
