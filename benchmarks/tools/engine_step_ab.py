"""Same-process A/B of the engine's decode step: variants of one scheme's decode executable timed in
turn on one prefilled engine, so machine drift between processes does not enter the comparison.

    python benchmarks/tools/engine_step_ab.py --config llama3-8b --batch 32 --prompt-len 8192 \
        --run fp16:base --run kvarn_k4v2_g128:base,f32rot,nounrot,splits1 [--rounds 3] [--steps 8] \
        [--profile] [--json out.json]

Per `--run SCHEME:VARIANTS` one engine (random bf16 weights of the architecture) prefills `batch`
random prompts once; each variant's decode executable is compiled once in an executable cache of its
own, then `rounds` rounds time `steps` decode steps of every variant in turn (after two untimed
steps). Rows: median and min ms/step over the rounds; with `--profile` (GPU) three traced steps per
variant: device-busy ms (overlapping kernels merged) and kernels a step.

Variants (marked t: timing only, wrong outputs):
  base      the code as it is
  f32rot    a bf16 query/K/V rotated in fp32 with the fp32 matrix (the rotation before 335d67a)
  nounrot   (t) the decode output left in the rotated frame: the most folding the unrotation into
            o_proj could save
  splitsN   every decode call with N splits
  uncapped  a bf16/fp32 cache's launch of 335d67a: two warps without a register cap, 2 splits at
            batch x kv heads >= SMs (now capped at 128 registers, 3 splits)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/

from kvarn_jax import hadamard  # noqa: E402
from kvarn_jax.attention import paged_decode  # noqa: E402
from kvarn_jax.attention.paged_decode_pallas import entry, launch  # noqa: E402
from kvarn_jax.models import ARCHITECTURES  # noqa: E402
from kvarn_jax.models.llama import Decoder  # noqa: E402
from kvarn_jax.serving import Engine, SamplingParams  # noqa: E402
from kvarn_jax.serving import runner  # noqa: E402
from generate import device_kernels  # noqa: E402

WARM = 2
_ORIGINAL = (hadamard._signs_product, paged_decode.unrotate, launch.default_num_splits, entry.launch_table)


def apply(variant: str) -> None:
    """Put the module functions a variant changes in place (every other variant's undone)."""
    hadamard._signs_product, paged_decode.unrotate, launch.default_num_splits, entry.launch_table = _ORIGINAL
    if variant == "base":
        return
    if variant == "f32rot":
        hadamard._signs_product = lambda x, max_abs: hadamard._matmul(
            x.astype(np.float32), hadamard.hadamard_matrix(x.shape[-1]), max_abs)
    elif variant == "nounrot":
        paged_decode.unrotate = lambda x, out_dtype=None, **kw: x if out_dtype is None else x.astype(out_dtype)
    elif variant.startswith("splits") and variant[6:].isdigit():
        n = int(variant[6:])
        launch.default_num_splits = lambda *a, **k: n
    elif variant == "uncapped":
        table = _ORIGINAL[3]
        entry.launch_table = lambda device=None: dataclasses.replace(table(device), tiled_wide_full=(2, None),
                                                                        wide_splits=2)
    else:
        raise SystemExit(f"unknown variant {variant!r} (base, f32rot, nounrot, splitsN, uncapped)")


def profile(engine: Engine, steps: int = 3) -> dict:
    """Device-busy ms and kernels per decode step over `steps` traced steps (`generate.device_kernels`)."""
    folder = tempfile.mkdtemp(prefix="engine_step_ab_")
    with jax.profiler.trace(folder):
        for _ in range(steps):
            engine.step()
        engine._drain()
    return device_kernels(folder, steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="llama3-8b", choices=sorted(ARCHITECTURES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--run", action="append", required=True, help="SCHEME:VARIANT[,VARIANT...] (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
    p.add_argument("--profile", action="store_true", help="trace 3 steps per variant (GPU)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    plan = []
    for r in args.run:
        scheme, _, variants = r.partition(":")
        plan.append((scheme, (variants or "base").split(",")))
    cfg = ARCHITECTURES[args.config]
    model = Decoder(cfg, dtype="bfloat16", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.vocab_size - 10, args.prompt_len).tolist() for _ in range(args.batch)]
    res = {"device": jax.devices()[0].device_kind, "config": args.config, "batch": args.batch,
           "prompt_len": args.prompt_len, "rounds": args.rounds, "steps_per_block": args.steps, "rows": {}}
    for scheme, variants in plan:
        new = args.rounds * len(variants) * (WARM + args.steps) + len(variants) * (WARM + 4) + 8
        t0 = time.perf_counter()
        engine = Engine(model, kv_cache_dtype=scheme, block_size=128, max_seqs=args.batch,
                        max_model_len=args.prompt_len + new + 8, prefill_chunk=512, prefill_batch=args.batch)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        pool = engine.pool()
        while not all(s.computed == len(s.prompt) and s.scheduled >= 1 for s in pool.running) or engine.waiting:
            engine.step()
        engine._drain()
        print(f"{scheme}: engine and prefill {time.perf_counter() - t0:.1f} s", flush=True)
        shared = runner._COMPILED  # prefill and store/commit executables serve every variant
        stores, times = {}, {v: [] for v in variants}
        for v in variants:
            apply(v)
            jax.clear_caches()  # nested jitted functions would otherwise keep the previous variant's trace
            runner._COMPILED = stores[v] = {k: e for k, e in shared.items() if k[0] != "decode"}
            t0 = time.perf_counter()
            for _ in range(WARM):
                engine.step()
            engine._drain()
            print(f"  {v}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.rounds):
            for v in variants:
                apply(v)
                runner._COMPILED = stores[v]
                for _ in range(WARM):
                    engine.step()
                engine._drain()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                engine._drain()
                times[v].append(1e3 * (time.perf_counter() - t0) / args.steps)
        row = {v: {"median_ms": statistics.median(t), "min_ms": min(t), "blocks_ms": t} for v, t in times.items()}
        if args.profile and jax.default_backend() == "gpu":
            for v in variants:
                apply(v)
                runner._COMPILED = stores[v]
                row[v]["profile"] = profile(engine)
        for v, x in row.items():
            line = f"  {scheme} {v}: median {x['median_ms']:.3f} ms/step, min {x['min_ms']:.3f}"
            if "profile" in x:
                line += (f"; busy {x['profile']['busy_ms_per_step']:.3f} ms, "
                         f"{x['profile']['kernels_per_step']:.0f} kernels a step")
            print(line, flush=True)
        res["rows"][scheme] = row
        apply("base")
        runner._COMPILED = shared
        del engine, pool
        gc.collect()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
