"""A/B of decode kernel versions (checkouts) and launch variants, by span, in one process.

    git worktree add /tmp/old 10cafbf        # or: mkdir /tmp/old && git archive 10cafbf kvarn_jax | tar -x -C /tmp/old
    python3 benchmarks/tools/decode_ab.py --version old=/tmp/old --version new=. --variants default,w2r128 \\
        --shapes 32x32768,1x131072,8x16384,256x8192 [--rounds 2] [--json out.json]

Each version is the `kvarn_jax` package of a checkout (the folder holding `kvarn_jax/`), imported
under a name of its own, and its GPU decode kernel entry is timed: the versions and variants run
side by side on the same caches (built by this checkout) and the same device, interleaved `--rounds`
times, so commits compared this way differ by their kernel only. Versions from before the kernel
became a package (a module taking launch options as keywords) and after (a `Launch` object) both
work. Every (version, variant) is first checked against the reference on a small
cache. Timing: `timing.profile_span` (first kernel start to last kernel end of one call, median of
20 calls; torch's profiler). Variants: "default" (the version's own defaults) or "wWrR" (num_warps
W, maxnreg R), followed by any of "-pm" (the splits merged by the Pallas kernel, merge="pallas",
for versions that have it), "-mx" (merge="xla"), "-sN" (num_splits=N), "-tN" (num_stages=N), "-qN" (q_in_kernel=bool(N))
and "-n" (seq_ids=None: sequence b's sink and tail at row b, no sequence-id operand; without it the
ids are built inside the timed call, an iota kernel in XLA; versions that need ids are not timed
with -n): e.g. `--variants default,default-pm,w2r128-pm,w1r168-s8,default-t3,default-q1,default-n`.
`--check-tol`: the check's tolerance (default 4e-3, the kernel tests'; fp8's random e4m3 codes need ~7e-3, see
benchmarks/results/2026-12-01_decode_all_shapes_h200.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))         # the suite's shared helpers (timing.py)
sys.path.insert(0, os.path.join(HERE, "..", ".."))   # the repository (kvarn_jax)
import timing  # noqa: E402
from kvarn_jax.attention.workload import random_cache  # noqa: E402
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.hadamard import rotate, unrotate  # noqa: E402


CHECK_TOL = 4e-3  # max |kernel - reference| / max |reference|, the decode kernel tests' tolerance


def load_version(name: str, root: str):
    """The GPU decode kernel module of the checkout at `root`: its `kvarn_jax` imported as package
    `kvarn_jax_ab_<name>` (the package's imports are relative, so they stay inside that copy)."""
    pkg = f"kvarn_jax_ab_{re.sub(r'[^0-9A-Za-z_]', '_', name)}"
    init = os.path.join(os.path.abspath(root), "kvarn_jax", "__init__.py")
    if not os.path.exists(init):
        raise SystemExit(f"--version {name}={root}: {init} does not exist (give the folder that holds kvarn_jax/)")
    spec = importlib.util.spec_from_file_location(pkg, init, submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(f"{pkg}.attention.paged_decode_pallas")


def launch_options(mod) -> set:
    """The launch options a kernel version takes (fields of its `Launch`, or keyword arguments)."""
    if hasattr(mod, "Launch"):
        return {f.name for f in dataclasses.fields(mod.Launch)}
    return set(inspect.signature(mod.paged_decode_pallas).parameters)


def variant_kwargs(var: str) -> dict:
    """default or wW[rR] (num_warps W, register cap R), followed by the suffixes -pm
    (merge="pallas"; only for kernel versions that have the option), -mx (merge="xla": also with
    one split, where the default finishes the output in the kernel), -sN (num_splits N), -tN
    (num_stages N), -qN (q_in_kernel bool(N)) and/or -n (seq_ids None)."""
    base, *suffixes = var.split("-")
    kw = {}
    if base != "default":
        m = re.fullmatch(r"w(\d+)(?:r(\d+))?", base)
        if not m:
            raise SystemExit(f"bad variant {var!r} (expected default or wW[rR], then -pm, -sN, -tN, -qN)")
        kw = dict(num_warps=int(m.group(1)), maxnreg=int(m.group(2)) if m.group(2) else None)
    for sfx in suffixes:
        if sfx == "n":
            kw["seq_ids"] = None
            continue
        m = re.fullmatch(r"(pm|mx|s|t|q)(\d*)", sfx)
        if not m or (m.group(1) in ("pm", "mx")) == bool(m.group(2)):
            raise SystemExit(f"bad suffix -{sfx} in variant {var!r} (expected -pm, -mx, -sN, -tN, -qN or -n)")
        key = {"pm": "merge", "mx": "merge", "s": "num_splits", "t": "num_stages", "q": "q_in_kernel"}[m.group(1)]
        if key == "merge":
            kw[key] = "pallas" if m.group(1) == "pm" else "xla"
        else:
            kw[key] = bool(int(m.group(2))) if key == "q_in_kernel" else int(m.group(2))
    return kw


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="append", required=True,
                   help="name=folder of a checkout (the folder holding kvarn_jax/); repeat for each version")
    p.add_argument("--variants", default="default", help="comma list of launch variants (see above)")
    p.add_argument("--scheme", default="kvarn_k4v2_g128")
    p.add_argument("--shapes", default="32x32768,1x131072,8x16384,256x8192", help="comma list of BATCHxCONTEXT")
    p.add_argument("--rounds", type=int, default=1, help="times every (version, variant) is timed, interleaved")
    p.add_argument("--json", default="")
    p.add_argument("--check-tol", type=float, default=CHECK_TOL)
    args = p.parse_args()
    hq, hk, d, bs = 32, 8, 128, 128
    versions = {n: load_version(n, path) for n, path in (v.split("=", 1) for v in args.version)}
    runs = {f"{n}/{var}": (mod, variant_kwargs(var)) for n, mod in versions.items() for var in args.variants.split(",")}
    rot = kj.parse(args.scheme).rotated
    interpret = jax.default_backend() == "cpu"

    def call(mod, kw):
        kw = dict(kw)
        none = "seq_ids" in kw and kw.pop("seq_ids") is None
        ids = (lambda q: None) if none else (lambda q: jnp.arange(q.shape[0], dtype=jnp.int32))
        if interpret:  # a smoke run on CPU
            kw["interpret"] = True
        if hasattr(mod, "Launch"):
            launch = mod.Launch(**{k: v for k, v in kw.items() if k != "interpret"})
            return lambda q, c, t, l: mod.paged_decode_pallas(q, c, t, l, ids(q), scale=1 / np.sqrt(d), window=None,
                                                              interpret=interpret, launch=launch)
        return lambda q, c, t, l: mod.paged_decode_pallas(q, c, t, l, ids(q), scale=1 / np.sqrt(d), window=None, **kw)

    out = {"device": jax.devices()[0].device_kind, "scheme": args.scheme, "versions": dict(v.split("=", 1) for v in args.version),
           "checks": {}, "rows": []}
    cache, tables, _ = random_cache(args.scheme, 4, 4 * bs + 37, hk, d, bs, jnp.float16, seed=7)
    lens = jnp.array([4 * bs + 37, 3 * bs, bs - 5, 2 * bs + 1], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(5), (4, hq, d), jnp.float32)
    ref = kj.paged_decode_attention(q, cache, tables, lens, impl="reference")
    for name, (mod, kw) in list(runs.items()):
        missing = set(kw) - launch_options(mod) - {"seq_ids"}
        if missing:  # an older version without an option the variant sets (e.g. merge)
            print(f"check {name}: this version has no {sorted(missing)}: not timed", flush=True)
            del runs[name]
            continue
        try:
            o = jax.jit(call(mod, kw))(rotate(q) if rot else q, cache, tables, lens)
        except Exception as e:  # e.g. seq_ids=None for a version that needs the ids
            print(f"check {name}: {type(e).__name__}: {str(e)[:200]}: not timed", flush=True)
            del runs[name]
            continue
        o = unrotate(o) if rot else o
        err = float(jnp.max(jnp.abs(o - ref)) / jnp.max(jnp.abs(ref)))
        out["checks"][name] = err
        bad = not err <= args.check_tol
        print(f"check {name}: max|kernel - reference| / max|reference| {err:.2e}" + (" FAILED: not timed" if bad else ""),
              flush=True)
        if bad:  # timing a wrong kernel would mean nothing
            del runs[name]
    for shape in filter(None, args.shapes.split(",")):
        b, ctx = (int(x) for x in shape.split("x"))
        cache, tables, lens = random_cache(args.scheme, b, ctx, hk, d, bs, jnp.float16)
        q = jax.random.normal(jax.random.PRNGKey(9), (b, hq, d), jnp.float16)
        row = {"batch": b, "ctx": ctx, "span_ms": {}}
        for _ in range(args.rounds):
            for name, (mod, kw) in runs.items():
                span = timing.profile_span(call(mod, kw), (q, cache, tables, lens))
                row["span_ms"].setdefault(name, []).append(None if span is None else span[0] * 1e3)
        fmt = lambda v: "/".join("-" if x is None else f"{x:.4f}" for x in v)  # noqa: E731
        print(f"B={b} L={ctx}: " + "  ".join(f"{k} {fmt(v)}" for k, v in row["span_ms"].items()), flush=True)
        out["rows"].append(row)
        del cache
        if args.json:  # after every shape: a run cut off by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
