"""Accuracy levers that change more than the RTN range, measured through `kvarn-jax eval`'s own
teacher-forced loop (serving semantics, same windows, same reference) before any of them is built
into the cache.

A lever is simulated: the serving attention's round trip is replaced, for one "carrier" scheme,
by quantize-then-dequantize in jnp with the lever applied (codes and scales computed as the cache
would, only not packed), and the result is reported under the lever's name with its bits per
element computed for fp16 scales. Levers:

  k4v2              kvarn_k4v2_g128 as the cache stores it (the anchor of a run)
  k4v2_clip         the first `_clip`: clip search on keys and values, keys on the values' grid
  k4v2_clip_vonly   clip search on the values only (keys over min..max; the shipped `_clipv`)
  k4v2_clip_ef      error-feedback Sinkhorn: of the Sinkhorn iterates (the all-ones start
                    included) keep the one whose clipped RTN has the least squared error of the
                    tile, instead of the least variance imbalance
  k3v2_clip         3-bit keys (no kernel packs 3-bit codes yet)
  k3v2_clip_ef      both
  k4v2_clip_unweighted  clip search on the balanced tile's own error, not weighted back to the
                    tile's scale (the shipped `_clip` weights it)
  k4v2_clipk_fine   keys: 8 ratios 1 .. 0.93 (half the values' step); values as `_clip`: the
                    shipped `_clip` (`rtn.clip_ratios(4, "k")`)
  k4v2_clipk_xfine  keys: 8 ratios 1 .. 0.965 (a quarter of the values' step)
  k4v2_clipk_refit1 keys: min..max or its unbiased refit, no clipping; values as `_clip`
  k4v2_clipk_p4     keys: candidates ranked by sum(err^4), which penalizes the few large errors
                    clipping puts on a channel's extreme tokens; values as `_clip`
  k4v2_clipk_p4_fine  both of the above on the keys
  k4v2_clipv16      values: 16 ratios 1 .. 0.475 (half the values' step); keys as k4v2_clip
  k4v2_clip_p4      every side ranked by sum(err^4)
  k3v3, k3v3_clip, k3v3_clipv  3-bit keys and values: k4v2's bits per element at any head_dim
  k4v2_fine_colfit_k / _v / (both)  k4v2_clipk_fine, then each key token's (_k) or value channel's
                    (_v) stored scale refit so that its error is orthogonal to it (no shrinkage along
                    it; the same fields); _colfit_ls: least-squares refits; k4v2_colfit: refits alone
  k4v2_signs        rotation diag(s) @ H with fixed random signs s instead of H (a different
                    rotation, same cost); k4v2_clip_signs: with `_clip`

    python benchmarks/accuracy_levers.py [--model PATH] [--tokens 4096] [--levers a,b] --json out.json

Runs on the CPU (the model's forward in torch, the levers in jnp).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import kvarn_jax as kj
from kvarn_jax.evaluation import agreement, serving_attention
from kvarn_jax.evaluation.loading import load_model_and_tokenizer, model_geometry
from kvarn_jax.evaluation.perplexity import REFERENCE, evaluate_perplexity, text_token_ids, token_windows
from kvarn_jax.hadamard import rotate, unrotate
from kvarn_jax.integrations.dlpack import bhtd_to_tokens, to_jax, to_torch, tokens_to_bhtd
from kvarn_jax.schemes import kvarn as K
from kvarn_jax.schemes.rtn import clip_search, rtn_codes, rtn_params

G = 128


def _sinkhorn_iterates(t, iters):
    """All (lc, lr) iterates of `kvarn.sinkhorn_log_scales` (the zero start first), unselected."""
    t2 = t * t
    lc = jnp.zeros(t.shape[:-2] + t.shape[-1:], jnp.float32)
    lr = jnp.zeros(t.shape[:-1], jnp.float32)
    out = [(lc, lr)]
    col = K._var(t, -2)
    for _ in range(iters):
        lc = jnp.clip(lc + K._log2_std(col, jnp.log2), K.LOG_LO, K.LOG_HI)
        a = jnp.exp2(-lc)
        rv = K._weighted_var(t, t2, a[..., None, :], (a * a)[..., None, :], jnp.exp2(-2.0 * lr), -1)
        lr = jnp.clip(lr + K._log2_std(rv, jnp.log2), K.LOG_LO, K.LOG_HI)
        b = jnp.exp2(-lr)
        col = K._weighted_var(t, t2, b[..., :, None], (b * b)[..., :, None], a * a, -2)
        out.append((lc, lr))
    return out


def _rtn_dequant_matrix(t, lc, lr, bits, clip, weighted=True):
    """Balanced RTN of t [..., R, C] under log scales (lc, lr), back in t's frame. clip: None (min..max)
    or the keyword arguments of `clip_search` ({} for its defaults)."""
    bal = t * jnp.exp2(-lc)[..., None, :] * jnp.exp2(-lr)[..., :, None]
    if clip is not None:
        w = jnp.exp2(2.0 * lc)[..., None, :] if weighted else None
        q, mn, scale = clip_search(bal, bits, weights=w, **clip)
    else:
        mn, scale = rtn_params(bal, bits)
        q = rtn_codes(bal, mn, scale, bits)
    q = q.astype(jnp.float32)
    return (q * scale[..., None] + mn[..., None]) * jnp.exp2(lc)[..., None, :] * jnp.exp2(lr)[..., :, None]


def _column_refit(t, d, how):
    """d [..., R, C] times a factor per column (the stored column scale absorbs it): "ls" least squares,
    "unbiased" the column's error orthogonal to the column (no shrinkage along it)."""
    dt, tt, dd = (jnp.sum(a * b, axis=-2) for a, b in ((d, t), (t, t), (d, d)))
    if how == "ls":
        f = jnp.where(dd > 0, dt / jnp.where(dd > 0, dd, 1.0), 1.0)
    else:
        f = jnp.where(dt > 0, tt / jnp.where(dt > 0, dt, 1.0), 1.0)
    return d * f[..., None, :]


def _matrix(t, bits, clip, select, weighted=True, colfit=None):
    if select == "imbalance":
        lc, lr = K.sinkhorn_log_scales(t, 8)
        d = _rtn_dequant_matrix(t, lc, lr, bits, clip, weighted)
        return d if colfit is None else _column_refit(t, d, colfit)
    best = best_err = None
    for lc, lr in _sinkhorn_iterates(t, 8):
        d = _rtn_dequant_matrix(t, lc, lr, bits, clip, weighted)
        err = jnp.sum((d - t) ** 2, axis=(-1, -2))
        if best is None:
            best, best_err = d, err
        else:
            better = err < best_err
            best = jnp.where(better[..., None, None], d, best)
            best_err = jnp.where(better, err, best_err)
    return best


def _signs(d):
    """A fixed random +-1 per channel (seed 0): the rotation diag(s) @ H instead of H."""
    return jnp.asarray(np.random.default_rng(0).choice([-1.0, 1.0], d), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Lever:
    k_bits: int = 4
    v_bits: int = 2
    clip_k: dict | None = None            # None: min..max; else `clip_search` keyword arguments
    clip_v: dict | None = None
    sinkhorn_select: str = "imbalance"    # or "error"
    weighted_clip_error: bool = True
    rotation: str = "hadamard"            # or "signs"
    colfit_k: str | None = None           # per-token key refit: None, "ls" or "unbiased"
    colfit_v: str | None = None           # per-channel value refit


def make_lever(lv: Lever):
    def rot(x):
        return rotate(x * _signs(x.shape[-1])) if lv.rotation == "signs" else rotate(x)

    def unrot(x):
        return unrotate(x) * _signs(x.shape[-1]) if lv.rotation == "signs" else unrotate(x)

    @jax.jit
    def roundtrip(k, v):  # [T, H, D] fp32, un-rotated
        out = []
        for x, side in ((k, "k"), (v, "v")):
            bits, clip, colfit = ((lv.k_bits, lv.clip_k, lv.colfit_k) if side == "k"
                                  else (lv.v_bits, lv.clip_v, lv.colfit_v))
            t, h, d = x.shape
            tiles = rot(x).reshape(t // G, G, h, d).transpose(0, 2, 1, 3)   # [n, H, G, D]
            m = jnp.swapaxes(tiles, -1, -2) if side == "k" else tiles
            r = _matrix(m, bits, clip, lv.sinkhorn_select, lv.weighted_clip_error, colfit)
            r = jnp.swapaxes(r, -1, -2) if side == "k" else r
            out.append(unrot(r.transpose(0, 2, 1, 3).reshape(t, h, d)))
        return tuple(out)
    return roundtrip


def kvarn_bits(k_bits, v_bits, d):
    """Bits per element of a KVarN G=128 tile with fp16 scales (K: scale/zero per channel, scale per
    token; V: scale per channel, scale/zero per token)."""
    k = k_bits + (2 * d + G) * 16 / (G * d)
    v = v_bits + (d + 2 * G) * 16 / (G * d)
    return (k + v) / 2


def _ratios(step, n):
    return tuple(1.0 - k * step for k in range(n))


CLIP = {}                                   # the values' grid
FINE4 = {"ratios": _ratios(0.01, 8)}        # 4-bit keys, half the values' step (the shipped key grid)
XFINE4 = {"ratios": _ratios(0.005, 8)}      # a quarter
P4 = {"power": 4}
C = CLIP
LEVERS = {
    "k4v2": Lever(),   # kvarn_k4v2_g128 itself: the anchor
    "k4v2_clip": Lever(clip_k=C, clip_v=C),
    "k4v2_clip_vonly": Lever(clip_v=C),
    "k4v2_clip_ef": Lever(clip_k=C, clip_v=C, sinkhorn_select="error"),
    "k3v2_clip": Lever(k_bits=3, clip_k=C, clip_v=C),
    "k3v2_clip_ef": Lever(k_bits=3, clip_k=C, clip_v=C, sinkhorn_select="error"),
    "k4v2_clip_unweighted": Lever(clip_k=C, clip_v=C, weighted_clip_error=False),
    "k4v2_clipk_fine": Lever(clip_k=FINE4, clip_v=C),
    "k4v2_clipk_xfine": Lever(clip_k=XFINE4, clip_v=C),
    "k4v2_clipk_refit1": Lever(clip_k={"ratios": (1.0,)}, clip_v=C),
    "k4v2_clipk_p4": Lever(clip_k=P4, clip_v=C),
    "k4v2_clipk_p4_fine": Lever(clip_k={**P4, **FINE4}, clip_v=C),
    "k4v2_clipv16": Lever(clip_k=C, clip_v={"ratios": _ratios(0.035, 16)}),
    "k4v2_clip_p4": Lever(clip_k=P4, clip_v=P4),
    "k3v3": Lever(k_bits=3, v_bits=3),
    "k3v3_clip": Lever(k_bits=3, v_bits=3, clip_k=C, clip_v=C),
    "k3v3_clipv": Lever(k_bits=3, v_bits=3, clip_v=C),
    "k4v2_signs": Lever(rotation="signs"),
    "k4v2_clip_signs": Lever(clip_k=C, clip_v=C, rotation="signs"),
    "k4v2_fine_colfit_k": Lever(clip_k=FINE4, clip_v=C, colfit_k="unbiased"),
    "k4v2_fine_colfit_v": Lever(clip_k=FINE4, clip_v=C, colfit_v="unbiased"),
    "k4v2_fine_colfit": Lever(clip_k=FINE4, clip_v=C, colfit_k="unbiased", colfit_v="unbiased"),
    "k4v2_fine_colfit_ls": Lever(clip_k=FINE4, clip_v=C, colfit_k="ls", colfit_v="ls"),
    "k4v2_colfit": Lever(colfit_k="unbiased", colfit_v="unbiased"),
}
# Carriers: real schemes whose round trip the lever replaces (any KVarN G=128 scheme will do; the
# carrier's own quantizer never runs).
CARRIERS = ["kvarn_k8v8_g128", "kvarn_k8v4_g128", "kvarn_k8v2_g128", "kvarn_k4v8_g128", "kvarn_k2v8_g128",
            "kvarn_k2v4_g128", "kvarn_k4v4_g128", "kvarn_k2v2_g128"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    levers = [x for x in args.levers.split(",") if x]
    for x in levers:
        if x not in LEVERS:
            raise SystemExit(f"--levers: unknown lever {x!r}; known: {', '.join(LEVERS)}")
    if len(levers) > len(CARRIERS):
        raise SystemExit(f"--levers: at most {len(CARRIERS)} at once")
    t0 = time.perf_counter()
    model, tok, folder = load_model_and_tokenizer(args.model, args.model_dtype)
    geo = model_geometry(model)
    from kvarn_jax.data import load_text
    ids = text_token_ids(tok, load_text("persuasion"), 5000)
    windows = token_windows(ids, args.window, args.tokens // args.window)
    carriers = dict(zip(CARRIERS, levers))
    fns = {c: make_lever(LEVERS[name]) for c, name in carriers.items()}
    real = serving_attention.roundtrip_bhtd

    def roundtrip(k, v, cfg):
        name = kj.parse(cfg).name
        if name not in fns:
            return real(k, v, cfg)
        kh, vh = fns[name](to_jax(bhtd_to_tokens(k.float())), to_jax(bhtd_to_tokens(v.float())))
        return tokens_to_bhtd(to_torch(kh), k.shape[0]), tokens_to_bhtd(to_torch(vh), k.shape[0])

    serving_attention.roundtrip_bhtd = roundtrip
    agreement.roundtrip_bhtd = roundtrip
    res = evaluate_perplexity(model, windows, {carriers[c]: c for c in carriers}, progress=False)
    ref = res[REFERENCE]
    rows = []
    for c, name in carriers.items():
        kb, vb = LEVERS[name].k_bits, LEVERS[name].v_bits
        r = res[name]
        rows.append({"scheme": name, "bits_per_element": kvarn_bits(kb, vb, geo["head_dim"]), "ppl": r.ppl,
                     "ppl_increase": r.ppl / ref.ppl - 1, "kl_mean": r.kl_mean, "top1_agreement": r.top1_agreement,
                     "simulated": True, "lever": dataclasses.asdict(LEVERS[name])})
        print(f"{name:24s} bits {rows[-1]['bits_per_element']:.3f}  PPL {r.ppl:.3f} ({100 * rows[-1]['ppl_increase']:+.2f}%)"
              f"  KL {r.kl_mean:.5f}  top-1 {100 * r.top1_agreement:.1f}%", flush=True)
    doc = {"argv": sys.argv, "model": str(folder), "geometry": geo, "window": args.window,
           "windows": int(windows.shape[0]), "reference": {"ppl": ref.ppl}, "rows": rows,
           "seconds": time.perf_counter() - t0}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"reference PPL {ref.ppl:.3f}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
