"""End-to-end generation through the serving engine, per KV-cache scheme, against the byte floor.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/generate.py [--config llama3-8b]
        [--kv-cache-dtype fp16,kvarn_k4v2_g128,...] [--batch 1,32] [--prompt-len 2048] [--new-tokens 64]
        [--model PATH | --random-weights] [--dtype auto] [--impl auto] [--json out.json]

For each batch size and scheme an engine is built on the same weights (fp16 first: every ratio is
against fp16 measured in the same process). Each row first runs a warm-up generation with the same
shapes (compiling what the timed run needs; a commit of completed blocks compiled later is
counted apart, `compiles_during_timed_run`), then the timed
generation: `batch` random prompts of `prompt-len` tokens, `new-tokens` tokens each (EOS ignored);
with `--repeats N`, N timed generations and the fastest decode kept (a shared CPU's load varies).

Per row: prefill and decode tokens/s, decode ms per step, the step's byte floor - the weights read
once plus the KV bytes one decode step must read (`kvarn_jax.cache.memory.decode_read_bytes`: quantized
pages, high-precision sink and tail), averaged over the run's contexts, at --bandwidth (default on a
GPU: a device-to-device copy measured at start, as `decode.py` does - 4.3 TB/s on the H200, 3.0 on
an H100; none on a CPU, whose caches hold a small model's bytes) - and the share of it reached, and
decode tokens/s against fp16's.
`--tensor-parallel N` runs the engine over N devices (heads, KV-cache heads and MLP units split;
the floor is then a device's share, replicated embeddings counted whole). A scheme whose cache does
not fit on the device is refused by the engine at start; the row records
the refusal (that is the point of a capacity run: e.g. --config llama3-8b --batch 128
--prompt-len 16384, where fp16 would need ~275 GB).

Weights: `--config NAME` builds random weights of a published architecture (smollm2-135m,
llama3-8b, qwen2.5-7b: `kvarn_jax.models.ARCHITECTURES`); `--model PATH` loads a checkpoint;
with neither, the default SmolLM2 checkpoint if installed, else random SmolLM2-135M weights. Random
weights give the same speed as real ones (no early stop: EOS is ignored).
CPU smoke settings: `--config smollm2-135m --num-layers 2 --prompt-len 64 --batch 1,2 --new-tokens 4`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time

import jax
import numpy as np

import kvarn_jax as kj
from flax import nnx
from kvarn_jax.attention.paged_decode import decode_impl
from kvarn_jax.impl import IMPLS
from kvarn_jax.cache.memory import decode_read_bytes
from kvarn_jax.models import ARCHITECTURES
from kvarn_jax.models.llama import Decoder
from kvarn_jax.serving import Engine, SamplingParams

DEFAULT_SCHEMES = "fp16,kvarn_k4v2_g128,kvarn_k4v4_g128,int8,int4,fp8"


def build_model(args):
    """(model, description, dtype). Real weights when asked for or found; otherwise random, said out loud."""
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if args.config is None and not args.random_weights:
        try:
            from kvarn_jax.models import load_model
            model, folder = load_model(args.model, dtype=dtype, progress=False)
            return model, f"checkpoint {folder}", dtype
        except (ImportError, FileNotFoundError) as e:
            if args.model:
                raise
            print(f"no default checkpoint here ({type(e).__name__}: {e}); using random weights")
    name = args.config or "smollm2-135m"
    cfg = ARCHITECTURES[name]
    if args.num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    model = Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(args.seed))
    return model, f"random weights, {name} architecture ({cfg.num_layers} layers)", dtype


def weight_bytes_read(model) -> int:
    """Bytes of weights a decode step reads: every parameter, less an untied input embedding table
    (only the batch's rows of it are read)."""
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not model.config.tie_word_embeddings:
        total -= int(np.prod(model.embed.embedding.shape)) * model.embed.embedding.dtype.itemsize
    return total


def profile_decode_steps(engine: Engine, prompts, steps: int) -> dict:
    """Trace `steps` decode steps of `engine` (after the prompts' prefill) and summarize the device's
    kernels: per step, wall time, time the device was busy (overlapping kernels merged) and the
    kernels by total time."""
    import tempfile

    ids = [engine.add_request(p, SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)) for p in prompts]
    pool = engine.pool()
    while not all(s.computed == len(s.prompt) and s.scheduled >= 1 for s in pool.running) or engine.waiting:
        engine.step()
    engine.step()
    folder = tempfile.mkdtemp(prefix="kvarn_profile_")
    t0 = time.perf_counter()
    with jax.profiler.trace(folder):
        for _ in range(steps):
            engine.step()
        engine._drain()
    wall = time.perf_counter() - t0
    engine.run()
    for i in ids:
        engine.pop_result(i)
    return {"steps": steps, "wall_ms_per_step": 1000 * wall / steps, **device_kernels(folder, steps)}


def device_kernels(folder: str, steps: int) -> dict:
    """The GPU kernels of a `jax.profiler` trace in `folder`, per step of `steps`: device-busy ms
    (overlapping kernels merged), kernels, the 15 that took longest and every kernel's calls and ms."""
    import glob

    from jax.profiler import ProfileData

    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    spans, kernels = [], {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for e in line.events:
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += e.duration_ns / 1e6
    busy, end = 0.0, -1.0
    for a, b in sorted(spans):  # union of kernel intervals
        if b > end:
            busy += (b - max(a, end)) / 1e6
            end = b
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {"busy_ms_per_step": busy / steps,
            "kernels_per_step": sum(k[0] for k in kernels.values()) / steps,
            "top_kernels": [{"name": n[:120], "calls_per_step": c / steps, "ms_per_step": t / steps}
                            for n, (c, t) in top],
            # every kernel, to match against the step's optimized HLO (XLA_FLAGS=--xla_dump_to=...)
            "kernels": {n[:120]: [c / steps, t / steps] for n, (c, t) in sorted(kernels.items())}}


def run_one(model, scheme: str, prompts, args):
    """One engine for one (scheme, batch): warm up (compile), then time one generation; a result row."""
    b, new = len(prompts), args.new_tokens
    max_len = len(prompts[0]) + new
    cfg = model.config
    row = {"scheme": kj.parse(scheme).name, "batch": b, "prompt_len": len(prompts[0]), "new_tokens": new}
    # what impl="auto" runs for this cache (the engine makes the same choice), and why not the kernel
    row["decode_attention"], _, why = decode_impl(kj.parse(scheme), args.block_size, cfg.head_dim, args.impl)
    if why is not None and row["decode_attention"] == "reference":
        row["kernel_refused"] = why
    try:
        # the pool the engine sizes for b sequences of max_len tokens (blocks held only in high precision
        # take no page)
        engine = Engine(model, kv_cache_dtype=scheme, block_size=args.block_size, max_seqs=b, max_model_len=max_len,
                        prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch or b, impl=args.impl,
                        decode_loop=args.decode_loop, tensor_parallel=args.tensor_parallel)
    except ValueError as e:  # e.g. the pool does not fit on the device: refused at engine start
        row["refused"] = str(e)
        return row
    # warm-up: one prefill chunk per prompt compiles the timed run's prefill and decode shapes
    engine.generate([p[:args.prefill_chunk] for p in prompts], SamplingParams(max_new_tokens=2, ignore_eos=True))
    c0 = engine.runner.stats.compiles
    runs = []  # (decode ms/step, stats, wall s) of each timed generation; the fastest decode is the row's
    for _ in range(args.repeats):
        engine.stats = type(engine.stats)()
        t0 = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
        wall = time.perf_counter() - t0
        assert all(len(r.output_ids) == new for r in results)
        runs.append((1000 * engine.stats.decode_s / max(1, engine.stats.decode_calls), engine.stats, wall))
    _, st, wall = min(runs, key=lambda r: r[0])
    mem = engine.memory_report()
    # the decode steps read contexts prompt+1 .. prompt+new-1 (the first token comes from prefill)
    ctxs = range(len(prompts[0]) + 1, max_len)
    kv = np.mean([decode_read_bytes(scheme, c, block_size=args.block_size, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, dtype=model.dtype) for c in ctxs])
    # sequences per decode-only step: the batch, unless --prefill-batch lets sequences join (and finish)
    # a group at a time, when the decode-only steps hold fewer; the floor reads what the steps held
    seqs = st.decode_tokens / max(1, st.decode_calls)
    # per device under tensor parallelism: each reads its share of the split weights and of the cache
    floor_bytes = (weight_bytes_read(model) + seqs * cfg.num_layers * kv) / args.tensor_parallel
    ms = 1000 * st.decode_s / max(1, st.decode_calls)
    floor_ms = 1000 * floor_bytes / args.bandwidth if args.bandwidth else None
    row.update({
        "prefill_tokens_per_s": st.prefill_tokens / st.prefill_s, "decode_tokens_per_s": st.decode_tokens / st.decode_s,
        "decode_ms_per_step": ms, "floor_ms_per_step": floor_ms, "floor_share": floor_ms / ms if floor_ms else None,
        "kv_bytes_per_step": seqs * cfg.num_layers * kv, "decode_seqs_per_step": seqs,
        "prefill_s": st.prefill_s, "decode_s": st.decode_s,
        "wall_s": wall, "decode_steps": st.decode_calls, "decode_ms_per_step_runs": [r[0] for r in runs], "commit_calls": st.commit_calls,
        # tokens decoded in steps that also prefilled (with --prefill-batch below the batch): not in the
        # decode rate, whose time excludes those steps
        "mixed_decode_tokens": st.mixed_decode_tokens,
        "compiles_during_timed_run": engine.runner.stats.compiles - c0, "compile_s": engine.runner.stats.compile_s,
        "kv_total_bytes": mem["total_bytes"], "kv_fp16_bytes": mem["fp16_bytes"],
        "kv_capacity_vs_fp16": mem["capacity_vs_fp16"], "decode_loop": engine.runner.decode_loop,
        "devices": mem["devices"], "kv_bytes_per_device": mem["per_device_bytes"],
        "dropped_tokens": int(engine.pool().caches.dropped_tokens),
    })
    if args.profile_steps and jax.default_backend() == "gpu":
        row["profile"] = profile_decode_steps(engine, prompts, args.profile_steps)
    del engine
    gc.collect()
    return row


def _floor(row, lead: str, sep: str = " ms: ") -> str:
    """The row's byte floor and the share of it reached, as text ('' or '- | -' without a floor)."""
    if row["floor_ms_per_step"] is None:
        return "" if lead else "-" + sep + "-"
    return f"{lead}{row['floor_ms_per_step']:.2f}{sep}{100 * row['floor_share']:.0f}%"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", choices=sorted(ARCHITECTURES),
                   help="random weights of this published architecture (default: the SmolLM2 checkpoint if "
                        "installed, else random smollm2-135m)")
    p.add_argument("--kv-cache-dtype", default=DEFAULT_SCHEMES, help="comma-separated schemes (fp16 runs first)")
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--block-size", type=int, default=128, help="tokens per cache page")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per sequence per prefill call")
    p.add_argument("--prefill-batch", type=int, help="sequences per prefill call (default: the whole batch)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--impl", default="auto", choices=list(IMPLS), help="decode attention")
    p.add_argument("--decode-loop", default="auto", choices=["auto", "unroll", "scan", "switch"],
                   help="how a decode step runs the layers (auto: unroll on GPU/TPU, switch on CPU)")
    p.add_argument("--model", help="HF folder or .gguf")
    p.add_argument("--random-weights", action="store_true", help="random smollm2-135m weights (same as --config "
                                                                 "smollm2-135m)")
    p.add_argument("--num-layers", type=int, help="override the architecture's depth (random weights only)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="bytes/s of the byte floor (default: a device-to-device copy, measured at start)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--repeats", type=int, default=1, help="timed generations per row after the warm-up; the row is "
                   "the one with the fastest decode (on a shared machine, the least disturbed)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="split heads, KV-cache heads and MLP units over this many devices (one compiled step "
                        "over the mesh); the byte floor is then per device")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="on a GPU, also trace this many decode steps per row and list the device's kernels")
    p.add_argument("--json", help="write the rows and the environment to this file")
    args = p.parse_args(argv)
    if args.num_layers is not None and args.config is None and not args.random_weights:
        p.error("--num-layers applies to random weights only (--config or --random-weights)")

    schemes = [kj.parse(s).name for s in args.kv_cache_dtype.split(",") if s]
    schemes = sorted(schemes, key=lambda s: s != "fp16")  # the baseline first
    batches = [int(b) for b in args.batch.split(",") if b]
    model, weights, dtype = build_model(args)
    cfg = model.config
    backend = jax.default_backend()
    device = str(jax.devices()[0].device_kind)
    print(f"device: {device} ({backend}), jax {jax.__version__}; model: {weights}; dtype {dtype}; "
          f"prompt {args.prompt_len} + {args.new_tokens} new tokens; block size {args.block_size}", flush=True)
    if args.bandwidth is None and backend == "gpu":
        from timing import copy_bandwidth  # benchmarks/timing.py, beside this script
        args.bandwidth = copy_bandwidth()
        print(f"byte floors at the measured copy bandwidth: {args.bandwidth / 1e12:.2f} TB/s", flush=True)
    elif args.bandwidth is None:  # a CPU's caches hold small models' bytes: no meaningful floor
        print("no byte floor on this backend (pass --bandwidth for one)", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for b in batches:
        prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(b)]
        base = None
        for s in schemes:
            row = run_one(model, s, prompts, args)
            rows.append(row)
            if "refused" in row:
                print(f"  batch {b:>3} {s:<18} refused at engine start: {row['refused']}", flush=True)
                continue
            if s == "fp16":
                base = row
            row["decode_vs_fp16"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else None
            print(f"  batch {b:>3} {s:<18} [{row['decode_attention']}] prefill {row['prefill_tokens_per_s']:>9.0f} tok/s  decode "
                  f"{row['decode_tokens_per_s']:>9.1f} tok/s ({row['decode_ms_per_step']:.2f} ms/step{_floor(row, ', floor ')})"
                  + (f"  {row['decode_vs_fp16']:.2f}x fp16" if row["decode_vs_fp16"] else "")
                  + f"  KV {row['kv_capacity_vs_fp16']:.2f}x fp16"
                  + (f", {row['kv_bytes_per_device'] / 2 ** 30:.2f} GiB per device x {row['devices']}"
                     if row["devices"] > 1 else ""), flush=True)
            if "profile" in row:
                pr = row["profile"]
                print(f"      profile: {pr['wall_ms_per_step']:.2f} ms/step wall, device busy "
                      f"{pr['busy_ms_per_step']:.2f} ms, {pr['kernels_per_step']:.0f} kernels/step; top: "
                      + "; ".join(f"{k['name'][:40]} {k['ms_per_step']:.3f} ms x{k['calls_per_step']:.0f}"
                                  for k in pr["top_kernels"][:6]), flush=True)

    print("\n| batch | scheme | attention | decode tok/s | ms/step | byte floor ms | % of floor | vs fp16 | prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['batch']} | {r['scheme']} | {r['decode_attention']} | refused at start | | | | | |")
            continue
        vs = f"{r['decode_vs_fp16']:.2f}x" if r.get("decode_vs_fp16") else "-"
        print(f"| {r['batch']} | {r['scheme']} | {r['decode_attention']} | {r['decode_tokens_per_s']:.1f} | {r['decode_ms_per_step']:.2f} | "
              f"{_floor(r, '', ' | ')} | {vs} | {r['prefill_tokens_per_s']:.0f} |")
    if args.json:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            commit = ""
        env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device, "backend": backend,
               "jax": jax.__version__, "python": platform.python_version(), "commit": commit, "weights": weights,
               "dtype": dtype, "bandwidth_Bps": args.bandwidth, "argv": sys.argv[1:] if argv is None else list(argv),
               "config": dataclasses.asdict(cfg)}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
