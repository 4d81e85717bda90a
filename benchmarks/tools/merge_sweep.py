"""The Pallas split merge alone, over its launches: channels per program x warps.

    python benchmarks/tools/merge_sweep.py [--shapes 1x131072,8x16384] [--scheme kvarn_k4v2_g128]
                                     [--channels 1,2,4,8,16,32] [--warps 1,2,4,8] [--json out.json]

At small batch the decode call is the kernel plus the merge of its splits (`paged_decode_pallas/merge.py`); at
1 x 128K the merge was 5.1 us of a 54.4 us call on the H200 (2026-12-04_decode_profile_small_h200.json)
for ~4 MB of partial outputs that the decode kernel has just written (they sit in L2). This script
builds partial outputs of the shapes the decode entry gives the merge by default for each shape
(split count, value planes, GQA heads stored; tokens-major partials, the layout of every scheme
whose default merge is the Pallas one), random but valid (finite maxima, positive sums), and
times `merge_splits_pallas` for every launch (`merge_launch`'s chunk and warps overridden), each
checked against `merge_splits_reference` first. Device time per call is the kernel's duration from
torch's profiler (needs torch with CUDA; without it only the checks run). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))         # the suite's shared helpers (timing.py)
sys.path.insert(0, os.path.join(HERE, "..", ".."))   # the repository (kvarn_jax)
import kvarn_jax as kj  # noqa: E402
from timing import add_model_args, kernel_events  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402
from kvarn_jax.attention.paged_decode_pallas import merge as split_merge  # noqa: E402


def partials(cfg, batch, ctx, hq, hk, d, bs, seed=0):
    """Random (acc, m, l) shaped as the decode entry's default hands them to the Pallas merge, and
    the split count."""
    warps, maxnreg = pdp.default_launch(cfg, batch, hk)
    splits = split_merge.unpadded_splits(pdp.default_num_splits(batch, hk, ctx // bs, warps, maxnreg))
    vp = pdp.value_planes(cfg)
    _, written = pdp.group_rows(hq // hk, tokens_major=True)
    s_pad = split_merge.padded_splits(splits)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    acc = jax.random.normal(k1, (batch, hk, s_pad, vp, d // vp, written), jnp.float32)
    m = jax.random.normal(k2, (batch, hk, s_pad, written), jnp.float32) * 4.0
    l = jax.random.uniform(k3, (batch, hk, s_pad, written), jnp.float32, 1.0, 64.0)
    return acc, m, l, splits


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x131072,8x16384")
    p.add_argument("--scheme", default="kvarn_k4v2_g128")
    p.add_argument("--channels", default="1,2,4,8,16,32")
    p.add_argument("--warps", default="1,2,4,8")
    p.add_argument("--calls", type=int, default=20)
    add_model_args(p)
    p.add_argument("--json", default="")
    args = p.parse_args()
    cfg = kj.parse(args.scheme)
    interpret = jax.default_backend() == "cpu"
    try:
        import torch
        timed = torch.cuda.is_available()
    except ImportError:
        timed = False
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "scheme": args.scheme,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": []}
    rule = split_merge.merge_launch
    try:
        sweep(args, cfg, rule, interpret, timed, res)
    finally:
        split_merge.merge_launch = rule


def sweep(args, cfg, rule, interpret, timed, res):
    """Every (channels, warps) launch per shape, into res["rows"] (and the JSON after each shape)."""
    hq, hk, d, bs = args.hq, args.hk, args.head_dim, args.block_size
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        acc, m, l, splits = partials(cfg, batch, ctx, hq, hk, d, bs)
        ref = split_merge.merge_splits_reference(acc, m, l, splits, -1)
        s_pad, c0, w0 = rule(batch, hk, acc.shape[3], splits, m.shape[-1], acc.shape[4], -1)
        row = {"batch": batch, "ctx": ctx, "splits": splits, "acc_shape": list(acc.shape),
               "default": f"c{c0}w{w0}", "us": {}, "err": {}}
        print(f"B={batch} L={ctx}: {splits} splits, partials {acc.shape} ({acc.nbytes / 1e6:.1f} MB), "
              f"default launch c{c0} w{w0}")
        for c in (int(x) for x in args.channels.split(",")):
            if c > acc.shape[4]:
                continue
            for w in (int(x) for x in args.warps.split(",")):
                name = f"c{c}w{w}"
                split_merge.merge_launch = lambda *a, c=c, w=w: (s_pad, c, w)
                jax.clear_caches()
                fn = lambda acc, m, l: split_merge.merge_splits_pallas(  # noqa: E731
                    acc, m, l, splits=splits, heads_axis=-1, interpret=interpret)
                try:
                    out = jax.block_until_ready(fn(acc, m, l))
                    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is reported
                    print(f"    {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    row["err"][name] = f"error: {type(e).__name__}"
                    continue
                row["err"][name] = err
                if err > 1e-5:
                    print(f"    {name}: wrong, max rel. error {err:.2e}")
                    continue
                if timed:
                    ev = kernel_events(fn, (acc, m, l), args.calls)
                    us = sum(dur for n, _, dur in ev if "split_merge" in n) / args.calls
                    row["us"][name] = us
                    print(f"    {name}: {us:7.2f} us  (error {err:.1e})")
                else:
                    print(f"    {name}: error {err:.1e} (not timed: no CUDA)")
        if row["us"]:
            best = min(row["us"], key=row["us"].get)
            print(f"  best {best} {row['us'][best]:.2f} us; default {row['default']} {row['us'].get(row['default'], float('nan')):.2f} us")
        res["rows"].append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
