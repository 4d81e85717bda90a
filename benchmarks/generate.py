"""End-to-end generation throughput per KV-cache scheme: prefill and decode tokens/s of the serving engine.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/generate.py [--json out.json]
        [--kv-cache-dtype fp16,kvarn_k4v2_g128,...] [--batch 1,32] [--prompt-len 2048] [--new-tokens 64]
        [--model PATH | --random-weights] [--dtype auto] [--impl auto] [--layers-per-call 1]

For each batch size one engine is built and every scheme runs on the same loaded weights (the
engine's precision switch: one cache pool per scheme, released after use). Each (scheme, batch)
first runs a short warm-up generation with the same shapes (compiles everything), then the timed
generation: `batch` random prompts of `prompt-len` tokens, `new-tokens` tokens each (EOS ignored).
Tokens/s exclude compilation; the engine syncs once per step (it needs the tokens to schedule).

Weights: `--model PATH` (HF folder or GGUF), else the default SmolLM2-135M checkpoint if it can be
found, else random weights of the SmolLM2-135M architecture from the embedded config (the GPU
machine has no checkpoint and no transformers). Which one ran is printed and recorded. Random
weights give the same tokens/s as real ones (no early stop: EOS is ignored).
CPU smoke settings: `--prompt-len 64 --batch 1,2 --new-tokens 4`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kvarn_jax as kj  # noqa: E402
from flax import nnx  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas  # noqa: E402
from kvarn_jax.models.llama import SMOLLM2_135M, Decoder  # noqa: E402
from kvarn_jax.serving import Engine, SamplingParams  # noqa: E402

DEFAULT_SCHEMES = "fp16,kvarn_k4v2_g128,kvarn_k4v4_g128,int8,int4,fp8"


def build_model(args):
    """(model, description). Real weights when asked for or found; otherwise random, said out loud."""
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if not args.random_weights:
        try:
            from kvarn_jax.models import load_model
            model, folder = load_model(args.model, dtype=dtype, progress=False)
            return model, f"checkpoint {folder}", dtype
        except (ImportError, FileNotFoundError) as e:
            if args.model:
                raise
            print(f"no default checkpoint here ({type(e).__name__}: {e}); using random weights")
    cfg = SMOLLM2_135M if args.num_layers is None else dataclasses.replace(SMOLLM2_135M, num_layers=args.num_layers)
    model = Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(args.seed))
    return model, f"random weights, SmolLM2-135M architecture ({cfg.num_layers} layers, embedded config)", dtype


def run_one(engine: Engine, scheme: str, prompts, new_tokens: int):
    """Warm up (compile) with the same shapes, then time one generation; returns a result row."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True), kv_cache_dtype=scheme)
    engine.stats = type(engine.stats)()
    c0 = engine.runner.stats.compiles
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, kv_cache_dtype=scheme)
    wall = time.perf_counter() - t0
    st = engine.stats
    assert all(len(r.output_ids) == new_tokens for r in results)
    mem = engine.memory_report(scheme)
    return {
        "scheme": kj.parse(scheme).name, "batch": len(prompts), "prompt_len": len(prompts[0]),
        "new_tokens": new_tokens, "prefill_tokens_per_s": st.prefill_tokens / st.prefill_s,
        "decode_tokens_per_s": st.decode_tokens / st.decode_s,
        "decode_ms_per_step": 1000 * st.decode_s / st.decode_calls,
        "prefill_s": st.prefill_s, "decode_s": st.decode_s, "wall_s": wall,
        "compiles_during_timed_run": engine.runner.stats.compiles - c0,
        "kv_total_bytes": mem["total_bytes"], "kv_fp16_bytes": mem["fp16_bytes"],
        "kv_capacity_vs_fp16": mem["capacity_vs_fp16"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-cache-dtype", default=DEFAULT_SCHEMES)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefill-batch", type=int, help="sequences per prefill call (default: the whole batch, so that "
                                                    "all sequences decode together)")
    p.add_argument("--layers-per-call", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--impl", default="auto", choices=["auto", "pallas", "reference"])
    p.add_argument("--model", help="HF folder or .gguf (default: SmolLM2 if found, else random weights)")
    p.add_argument("--random-weights", action="store_true", help="random weights of the SmolLM2-135M architecture")
    p.add_argument("--num-layers", type=int, help="override the embedded config's depth (random weights only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows and the environment to this file")
    args = p.parse_args(argv)
    if args.num_layers is not None and not args.random_weights:
        p.error("--num-layers applies to --random-weights only")

    schemes = [kj.parse(s).name for s in args.kv_cache_dtype.split(",") if s]
    batches = [int(b) for b in args.batch.split(",") if b]
    model, weights, dtype = build_model(args)
    cfg = model.config
    backend = jax.default_backend()
    device = str(jax.devices()[0].device_kind)
    print(f"device: {device} ({backend}), jax {jax.__version__}; model: {weights}; dtype {dtype}; "
          f"prompt {args.prompt_len} + {args.new_tokens} new tokens; block size {args.block_size}; "
          f"layers per call {args.layers_per_call}")
    rng = np.random.default_rng(args.seed)
    rows = []
    for b in batches:
        prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(b)]
        max_len = args.prompt_len + args.new_tokens
        engine = Engine(model, kv_cache_dtype=schemes[0], block_size=args.block_size, max_seqs=b,
                        max_model_len=max_len, num_blocks=b * -(-max_len // args.block_size),
                        prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch or b,
                        layers_per_call=args.layers_per_call, impl=args.impl)
        for s in schemes:
            attn = args.impl
            if attn == "auto":
                ok = paged_decode_pallas.supports(kj.parse(s), args.block_size, cfg.head_dim) is None
                attn = "pallas" if backend == "gpu" and ok else "reference"
            row = run_one(engine, s, prompts, args.new_tokens)
            row["attention"] = attn
            rows.append(row)
            engine.release_pool(s)
            print(f"  batch {b:>3} {s:<18} prefill {row['prefill_tokens_per_s']:>10.1f} tok/s   decode "
                  f"{row['decode_tokens_per_s']:>9.1f} tok/s ({row['decode_ms_per_step']:.2f} ms/step)   "
                  f"KV {row['kv_capacity_vs_fp16']:.2f}x fp16   [{attn}]", flush=True)
        compile_s = engine.runner.stats.compile_s
        print(f"  (batch {b}: {engine.runner.stats.compiles} compiled functions, {compile_s:.1f} s compiling, "
              "not counted)")

    hdr = "| batch | scheme | prefill tok/s | decode tok/s | decode ms/step | KV capacity vs fp16 | attention |"
    print("\n" + hdr + "\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['scheme']} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | "
              f"{r['decode_ms_per_step']:.2f} | {r['kv_capacity_vs_fp16']:.2f}x | {r['attention']} |")
    if args.json:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__)).stdout.strip()
        except OSError:
            commit = ""
        env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device, "backend": backend,
               "jax": jax.__version__, "python": platform.python_version(), "commit": commit, "weights": weights,
               "dtype": dtype, "argv": sys.argv[1:] if argv is None else list(argv),
               "config": dataclasses.asdict(cfg)}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
