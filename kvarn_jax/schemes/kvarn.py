"""KVarN tile quantization, exactly as DESIGN.md §1.2-1.5 (pure jnp; the oracle for the kernels).

A tile is G tokens x D channels of one head, already rotated (`hadamard.rotate`). Keys are
normalized as a [D x G] matrix (rows = channels), values as [G x D] (rows = tokens); the RTN runs per
row of the balanced tile and the Sinkhorn row scale is folded into the stored fp16 scale and zero.

Codes are packed as the reference packs them (K along tokens, V along channels) but stored with the
byte axes swapped: K codes [G*b/8, D], V codes [D*b/8, G] (see `packing.store_tiled`): the decode
kernel contracts keys over channels and values over tokens, and reads codes along that axis.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..packing import load_tiled, store_tiled
from .rtn import rtn_codes, rtn_params


TIE_RTOL = 1e-6


def _std(x: jnp.ndarray, axis: int) -> jnp.ndarray:
    """Unbiased single-pass std, means not subtracted first: sqrt(max((E[x²]-E[x]²)·n/(n-1), 0))."""
    n = x.shape[axis]
    m = jnp.mean(x, axis=axis)
    m2 = jnp.mean(x * x, axis=axis)
    return jnp.sqrt(jnp.maximum((m2 - m * m) * (n / (n - 1)), 0.0))


def _imbalance(col_std: jnp.ndarray, row_std: jnp.ndarray) -> jnp.ndarray:
    return (jnp.max(col_std, -1) / jnp.maximum(jnp.min(col_std, -1), 1e-8)
            + jnp.max(row_std, -1) / jnp.maximum(jnp.min(row_std, -1), 1e-8))


def _weighted_moments(t, t2, w, w2, axis: int):
    """Mean of t·w and of t²·w² along `axis` (w, w2: the summed axis's weight and its square,
    broadcast against t)."""
    n = t.shape[axis]
    return jnp.sum(t * w, axis=axis) / n, jnp.sum(t2 * w2, axis=axis) / n


def _std_from_moments(m, m2, scale, n: int):
    """`_std` of values whose moments are (m, m2), multiplied by `scale`."""
    m, m2 = m * scale, m2 * (scale * scale)
    return jnp.sqrt(jnp.maximum((m2 - m * m) * (n / (n - 1)), 0.0))


def sinkhorn_log_scales(t: jnp.ndarray, iters: int):
    """Log-domain variance normalization of `t` [..., R, C] (fp32).

    Returns (lc [..., C], lr [..., R]) of the iterate with the lowest imbalance, the all-zero start
    included, ties going to the later iterate.

    The normalized iterate is t / exp(lc)[c] / exp(lr)[r] = t·a[c]·b[r]. Its row and column stds are
    computed from t and t² weighted by a, b (exp on vectors only): the same quantities as forming
    the normalized matrix and taking `_std`, up to float rounding, at a fraction of the per-element
    work (no divisions; this loop dominates the cost of quantizing a tile).
    """
    r_n, c_n = t.shape[-2], t.shape[-1]
    t2 = t * t
    lc = jnp.zeros(t.shape[:-2] + t.shape[-1:], jnp.float32)
    lr = jnp.zeros(t.shape[:-1], jnp.float32)

    def row_std(a, b):  # std over columns of t·a·b, per row
        m, m2 = _weighted_moments(t, t2, a[..., None, :], (a * a)[..., None, :], -1)
        return _std_from_moments(m, m2, b, c_n)

    def col_std(a, b):  # std over rows of t·a·b, per column
        m, m2 = _weighted_moments(t, t2, b[..., :, None], (b * b)[..., :, None], -2)
        return _std_from_moments(m, m2, a, r_n)

    # The column stds an iterate's imbalance needs are the ones the next column update starts from:
    # computed once and carried (3 std passes per iteration instead of 4; same values).
    col = _std(t, -2)
    best_lc, best_lr, best_imb = lc, lr, _imbalance(col, _std(t, -1))
    for _ in range(iters):
        lc = jnp.clip(lc + jnp.log(jnp.clip(col, 1e-3, 1e3)), -0.3, 10.0)
        a = jnp.exp(-lc)
        lr = jnp.clip(lr + jnp.log(jnp.clip(row_std(a, jnp.exp(-lr)), 1e-3, 1e3)), -0.3, 10.0)
        b = jnp.exp(-lr)
        col = col_std(a, b)
        imb = _imbalance(col, row_std(a, b))
        # Ties go to the later iterate. Iterates that differ by a uniform factor moved between rows
        # and columns have the same imbalance up to float rounding, so "tie" means equal within
        # TIE_RTOL; otherwise summation order (device, library) would decide which one is kept.
        better = imb <= best_imb * (1.0 + TIE_RTOL)
        best_lc = jnp.where(better[..., None], lc, best_lc)
        best_lr = jnp.where(better[..., None], lr, best_lr)
        best_imb = jnp.where(better, imb, best_imb)
    return best_lc, best_lr


def _quantize_matrix(t: jnp.ndarray, bits: int, iters: int):
    """Balance `t` [..., R, C], RTN per row. Returns codes [..., R, C], row scale/zero (folded), col scale."""
    lc, lr = sinkhorn_log_scales(t, iters)
    s_col, s_row = jnp.exp(lc), jnp.exp(lr)
    bal = t * jnp.exp(-lc)[..., None, :] * jnp.exp(-lr)[..., :, None]
    mn, scale = rtn_params(bal, bits)
    codes = rtn_codes(bal, mn, scale, bits)
    return (codes, (s_row * scale).astype(jnp.float16), (s_row * mn).astype(jnp.float16),
            s_col.astype(jnp.float16))


def fields(side: str, bits: int, group: int, head_dim: int):
    g, d = group, head_dim
    if side == "k":
        return {"codes": ((g * bits // 8, d), jnp.uint8), "scale_chan": ((d,), jnp.float16),
                "zero_chan": ((d,), jnp.float16), "scale_tok": ((g,), jnp.float16)}
    return {"codes": ((d * bits // 8, g), jnp.uint8), "scale_chan": ((d,), jnp.float16),
            "scale_tok": ((g,), jnp.float16), "zero_tok": ((g,), jnp.float16)}


def quantize(x: jnp.ndarray, side: str, bits: int, iters: int) -> dict:
    """x: rotated tiles [..., G, D] -> stored fields (see `fields`)."""
    t = x.astype(jnp.float32)
    if side == "k":
        codes, scale_chan, zero_chan, scale_tok = _quantize_matrix(jnp.swapaxes(t, -1, -2), bits, iters)
        return {"codes": store_tiled(codes, bits), "scale_chan": scale_chan, "zero_chan": zero_chan,
                "scale_tok": scale_tok}
    codes, scale_tok, zero_tok, scale_chan = _quantize_matrix(t, bits, iters)
    return {"codes": store_tiled(codes, bits), "scale_chan": scale_chan, "scale_tok": scale_tok,
            "zero_tok": zero_tok}


def dequantize(f: dict, side: str, bits: int) -> jnp.ndarray:
    """Stored fields -> rotated tiles [..., G, D] in fp32."""
    c = load_tiled(f["codes"], bits).astype(jnp.float32)
    if side == "k":  # c: [..., D, G]
        kt = (c * f["scale_chan"].astype(jnp.float32)[..., :, None]
              + f["zero_chan"].astype(jnp.float32)[..., :, None]) * f["scale_tok"].astype(jnp.float32)[..., None, :]
        return jnp.swapaxes(kt, -1, -2)
    # c: [..., G, D]
    return ((c * f["scale_tok"].astype(jnp.float32)[..., :, None] + f["zero_tok"].astype(jnp.float32)[..., :, None])
            * f["scale_chan"].astype(jnp.float32)[..., None, :])
