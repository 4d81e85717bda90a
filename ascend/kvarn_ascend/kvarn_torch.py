"""KVarN and KIVI tile quantization in torch ops, for the NPU store path (no CANN op does 2-bit
codes or Sinkhorn): Hadamard rotation as a matmul, log-domain Sinkhorn, round-to-nearest, packing.

The math is kvarn_jax's (docs/design.md §1, `kvarn_jax/schemes/kvarn.py`, `kivi.py`, `rtn.py`,
`packing.py`, `hadamard.py`), written for torch so it runs on the NPU; fields, shapes and dtypes are
kvarn_jax's, so pages are interchangeable. Everything is fp32 except the stored metadata, which is in
the model dtype (fp16 or bf16) as kvarn_jax stores it. On an NPU keep `torch_npu.npu.matmul.allow_hf32`
off (its default), or the rotation loses fp32 precision.
"""

from __future__ import annotations

import torch

from kvarn_jax.hadamard import hadamard_matrix_np
from kvarn_jax.schemes.kvarn import K_CHAN_EXP, V_TOK_EXP

TIE_RTOL = 1e-6  # kvarn_jax's tie rule for Sinkhorn iterates (see kvarn_jax/schemes/kvarn.py)
SCALE_FLOOR = 2.0 ** -24


def saturate(x: torch.Tensor, dtype) -> torch.Tensor:
    """x in `dtype`, values beyond its largest finite one clipped to it (kvarn_jax.schemes.arith.saturate)."""
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def hadamard(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    return torch.as_tensor(hadamard_matrix_np(n), dtype=dtype, device=device)


def rotate(x: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """`x @ H` in fp32, rounded to out_dtype with saturation; fp16 inputs use the fp16-rounded H as the
    KVarN reference does (`fp16(x_fp16 @ fp16(H))`), other dtypes the fp32 H (as kvarn_jax.rotate).
    Callers keep |x| within kvarn_jax.storage.QUANT_MAX, so the fp32 products cannot overflow."""
    h_dtype = torch.float16 if x.dtype == torch.float16 else torch.float32
    h = hadamard(x.shape[-1], h_dtype, x.device).float()
    return saturate(x.float() @ h, out_dtype or x.dtype)


def unrotate(x: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """Inverse of `rotate` (H is symmetric and orthonormal), fp32 with the exact H."""
    return saturate(x.float() @ hadamard(x.shape[-1], torch.float32, x.device), out_dtype or x.dtype)


# ------------------------------------------------------------------------------------------ packing
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] codes in [0, 2^bits) -> [..., n*bits/8] uint8, element j of a byte at bit j*bits."""
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def store_tiled(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Tiled codes [..., R, C] -> kvarn_jax's stored field [..., C*bits/8, R] (packed along C, then the
    byte axes swapped; kvarn_jax.packing.store_tiled)."""
    return pack(codes, bits).transpose(-1, -2).contiguous()


def load_tiled(field: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `store_tiled`."""
    return unpack(field.transpose(-1, -2), bits)


# ------------------------------------------------------------------------------------------ RTN
def rtn_params(x: torch.Tensor, bits: int, floor: float = 1e-10):
    mn = x.amin(-1)
    scale = torch.clamp((x.amax(-1) - mn) / (2 ** bits - 1), min=floor)
    return mn, scale


def rtn_codes(x, mn, scale, bits: int) -> torch.Tensor:
    q = torch.round((x - mn[..., None]) / scale[..., None])  # half to even, as kvarn_jax
    return q.clamp(0, 2 ** bits - 1).to(torch.uint8)


def rtn_stored(x: torch.Tensor, bits: int, dtype=torch.float16):
    """Codes chosen against the (min, scale) rounded to `dtype`, as they get stored
    (kvarn_jax.schemes.rtn.rtn_stored)."""
    mn, scale = rtn_params(x, bits, floor=SCALE_FLOOR)
    s_m, z_m = saturate(scale, dtype), saturate(mn, dtype)
    return rtn_codes(x, z_m.float(), s_m.float(), bits), s_m, z_m


def rtn_dequant(codes, scale, zero) -> torch.Tensor:
    return codes.float() * scale.float()[..., None] + zero.float()[..., None]


# ------------------------------------------------------------------------------------------ Sinkhorn
LN2 = 0.6931471805599453
LOG_LO, LOG_HI = -0.3 / LN2, 10.0 / LN2   # the reference's log-scale clip [-0.3, 10], in base 2


def _var_from_sums(s1, s2, n: int) -> torch.Tensor:
    """Unbiased single-pass variance from Σx and Σx² (the reference's std, squared; kvarn_jax's form)."""
    return torch.clamp((s2 - s1 * s1 * (1.0 / n)) * (1.0 / (n - 1)), min=0.0)


def _var(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _var_from_sums(x.sum(dim), (x * x).sum(dim), x.shape[dim])


def _imbalance(col_var: torch.Tensor, row_var: torch.Tensor) -> torch.Tensor:
    """max/min of column stds + max/min of row stds (min floored at 1e-8), from variances."""
    return (torch.sqrt(col_var.amax(-1) / col_var.amin(-1).clamp(min=1e-16))
            + torch.sqrt(row_var.amax(-1) / row_var.amin(-1).clamp(min=1e-16)))


def _weighted_var(t, t2, w, w2, scale2, dim: int) -> torch.Tensor:
    """`_var` over `dim` of t·w·scale from t and t² (w, w2: weight of the summed axis and its square,
    broadcast against t; scale2: the other axis's weight squared). No per-element division."""
    return scale2 * _var_from_sums((t * w).sum(dim), (t2 * w2).sum(dim), t.shape[dim])


def _log2_std(var: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.log2(torch.clamp(var, 1e-6, 1e6))


def sinkhorn_log_scales(t: torch.Tensor, iters: int):
    """Log-domain variance normalization of t [..., R, C], as kvarn_jax.schemes.kvarn: base-2 logs
    (lc [..., C], lr [..., R]) of the scales of the iterate with the lowest imbalance, the all-zero
    start included, ties (within TIE_RTOL) going to the later. The iterate t / 2^lc / 2^lr = t·a·b is
    never formed: its variances come from t and t² weighted by a, b."""
    lc = torch.zeros(t.shape[:-2] + t.shape[-1:], dtype=torch.float32, device=t.device)
    lr = torch.zeros(t.shape[:-1], dtype=torch.float32, device=t.device)
    t2 = t * t
    row_var = lambda a, b2: _weighted_var(t, t2, a[..., None, :], (a * a)[..., None, :], b2, -1)  # noqa: E731
    col_var = lambda a2, b: _weighted_var(t, t2, b[..., :, None], (b * b)[..., :, None], a2, -2)  # noqa: E731
    # an iterate's column variances are also what the next column update starts from: computed once
    col = _var(t, -2)
    best_lc, best_lr, best_imb = lc, lr, _imbalance(col, _var(t, -1))
    for _ in range(iters):
        lc = torch.clamp(lc + _log2_std(col), LOG_LO, LOG_HI)
        a = torch.exp2(-lc)
        lr = torch.clamp(lr + _log2_std(row_var(a, torch.exp2(-2.0 * lr))), LOG_LO, LOG_HI)
        b = torch.exp2(-lr)
        col = col_var(a * a, b)
        imb = _imbalance(col, row_var(a, b * b))
        better = imb <= best_imb * (1.0 + TIE_RTOL)
        best_lc = torch.where(better[..., None], lc, best_lc)
        best_lr = torch.where(better[..., None], lr, best_lr)
        best_imb = torch.where(better, imb, best_imb)
    return best_lc, best_lr


def _balanced_rtn(t: torch.Tensor, bits: int, iters: int, meta=torch.float16):
    lc, lr = sinkhorn_log_scales(t, iters)
    s_col, s_row = torch.exp2(lc), torch.exp2(lr)
    bal = t * torch.exp2(-lc)[..., None, :] * torch.exp2(-lr)[..., :, None]
    mn, scale = rtn_params(bal, bits)
    row_scale, row_zero, col = saturate(s_row * scale, meta), saturate(s_row * mn, meta), saturate(s_col, meta)
    if meta == torch.float16:  # the reference's order (kvarn_jax.schemes.kvarn._quantize_matrix)
        codes = rtn_codes(bal, mn, scale, bits)
    else:  # bf16: codes against the stored scales
        codes = rtn_codes(t / col.float()[..., None, :], row_zero.float(), row_scale.float(), bits)
    return codes, row_scale, row_zero, col


def kvarn_balance(f: dict, side: str, meta) -> dict:
    """kvarn_jax.schemes.kvarn.balance: a power of two moved between a tile's scales (the same
    dequantized bits; keys' largest channel scale in [1, 2), values' largest token scale or zero
    point in [2^12, 2^13))."""
    if side == "k":
        bounded, down, up, target = ("scale_chan",), ("scale_chan", "zero_chan"), ("scale_tok",), K_CHAN_EXP
    else:
        bounded = down = ("scale_tok", "zero_tok")
        up, target = ("scale_chan",), V_TOK_EXP
    peak = torch.stack([f[n].float().abs().amax(-1, keepdim=True) for n in bounded]).amax(0)
    e = (torch.frexp(peak).exponent - 1).clamp(-120, 120) - target   # floor(log2 peak) - target
    out = dict(f)
    for names, sign in ((down, -1), (up, 1)):
        for n in names:
            out[n] = saturate(torch.ldexp(f[n].float(), sign * e), meta)
    return out


def kvarn_quantize(x: torch.Tensor, side: str, bits: int, iters: int, meta=torch.float16) -> dict:
    """Rotated tiles [..., G, D] -> kvarn_jax's stored fields for `side` ("k" or "v"), metadata in
    `meta`, balanced as kvarn_jax balances them unless `meta` is fp16."""
    t = x.float()
    if side == "k":
        codes, scale_chan, zero_chan, scale_tok = _balanced_rtn(t.transpose(-1, -2), bits, iters, meta)
        f = {"codes": store_tiled(codes, bits), "scale_chan": scale_chan, "zero_chan": zero_chan,
             "scale_tok": scale_tok}
    else:
        codes, scale_tok, zero_tok, scale_chan = _balanced_rtn(t, bits, iters, meta)
        f = {"codes": store_tiled(codes, bits), "scale_chan": scale_chan, "scale_tok": scale_tok, "zero_tok": zero_tok}
    return f if meta == torch.float16 else kvarn_balance(f, side, meta)


def kvarn_dequantize(f: dict, side: str, bits: int) -> torch.Tensor:
    """Stored fields -> rotated tiles [..., G, D] in fp32."""
    c = load_tiled(f["codes"], bits).float()
    if side == "k":  # c: [..., D, G]
        kt = (c * f["scale_chan"].float()[..., :, None] + f["zero_chan"].float()[..., :, None]) \
            * f["scale_tok"].float()[..., None, :]
        return kt.transpose(-1, -2)
    return (c * f["scale_tok"].float()[..., :, None] + f["zero_tok"].float()[..., :, None]) \
        * f["scale_chan"].float()[..., None, :]


def kivi_quantize(x: torch.Tensor, side: str, bits: int, group: int, meta=torch.float16) -> dict:
    """Tiles [..., G, D] -> KIVI fields: keys per channel over the tile, values per token in groups."""
    t = x.float()
    if side == "k":
        codes, scale, zero = rtn_stored(t.transpose(-1, -2), bits, meta)
        return {"codes": store_tiled(codes, bits), "scale": scale, "zero": zero}
    d = t.shape[-1]
    cg = min(group, d)
    codes, scale, zero = rtn_stored(t.reshape(*t.shape[:-1], d // cg, cg), bits, meta)
    return {"codes": store_tiled(codes.reshape(t.shape), bits), "scale": scale, "zero": zero}


def kivi_dequantize(f: dict, side: str, bits: int, group: int) -> torch.Tensor:
    c = load_tiled(f["codes"], bits)
    if side == "k":
        return rtn_dequant(c, f["scale"], f["zero"]).transpose(-1, -2)
    d = c.shape[-1]
    cg = min(group, d)
    rows = c.reshape(*c.shape[:-1], d // cg, cg)
    return rtn_dequant(rows, f["scale"], f["zero"]).reshape(c.shape)


def quantize_tiles(x: torch.Tensor, cfg, side: str, meta=torch.float16) -> dict:
    """Tiles [..., G, D] (storage frame) -> fields of `cfg` (a kvarn or kivi KVQuantConfig), scales and
    zero points in `meta` (the model dtype, as kvarn_jax stores them)."""
    b = cfg.bits(side)
    if cfg.method == "kvarn":
        return kvarn_quantize(x, side, b, cfg.sinkhorn_iters, meta)
    return kivi_quantize(x, side, b, cfg.group, meta)


def dequantize_tiles(f: dict, cfg, side: str) -> torch.Tensor:
    b = cfg.bits(side)
    if cfg.method == "kvarn":
        return kvarn_dequantize(f, side, b)
    return kivi_dequantize(f, side, b, cfg.group)
