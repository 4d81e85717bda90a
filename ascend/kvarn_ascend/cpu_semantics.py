"""CPU functions with the documented semantics of the torch_npu ops kvarn_ascend uses.

Each function has the torch_npu signature (same argument names, same positional/keyword split), so
the op table (`ops.py`) hands one call to either. Inputs are assumed valid: `validators.py` checks
the documented constraints first. Arithmetic is fp32; results are rounded to the documented output
dtype once, at the end.

Conventions pinned here (where the documentation is silent, the source each follows is named):
- Rounding: round half to even (`torch.round`), as the op tests' CPU goldens do (np.round /
  torch.round) and `npu_rotate_quant`'s default round_mode="rint" names.
- int4: signed values in [-8, 7]; 8 of them packed in one int32, element j at bits 4j..4j+3
  (element 0 in the low nibble; two's complement nibbles). This is how the op tests unpack
  `npu_dynamic_quant(..., dst_type=torch.quint4x2)` output (low nibble of each little-endian byte
  first) and the same order as kvarn_jax.packing. The same bytes viewed as int8 [..., D/2] (how
  the codes go through npu_scatter_pa_kv_cache, which takes no int32 on Atlas A2/A3) hold element
  2j in the low and 2j+1 in the high nibble of byte j.
- Antiquant (npu_anti_quant, fused attention): `x_hat = (x + offset) * scale`.
- Paged caches: `slot = block_id * block_size + offset`; ND ("Norm") caches are
  [num_blocks, block_size, num_heads, head_dim]; fused attention reads them as
  [num_blocks, block_size, num_heads * head_dim] (BnBsH) or [num_blocks, num_heads, block_size, D].
"""

from __future__ import annotations

import math

import torch

INT8_RANGE = (-128, 127)
INT4_RANGE = (-8, 7)
EMPTY_ROW_LSE = -3.40e38  # the decode kernel's softmax lse of a row with no keys (float32)
_NIBBLE_SHIFTS = torch.arange(8, dtype=torch.int64) * 4


# ------------------------------------------------------------------------------------------ int4
def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[..., 8m] integers in [-8, 7] -> [..., m] int32 (element 0 in the low nibble)."""
    nib = (values.to(torch.int64) & 0xF).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    word = (nib << _NIBBLE_SHIFTS.to(nib.device)).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """[..., m] int32 -> [..., 8m] int8 in [-8, 7]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = (w[..., None] >> _NIBBLE_SHIFTS.to(w.device)) & 0xF
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(*words.shape[:-1], words.shape[-1] * 8).to(torch.int8)


def _is_int4(dst) -> bool:
    return dst is torch.quint4x2


def _emit(y: torch.Tensor, int4: bool) -> torch.Tensor:
    lo, hi = INT4_RANGE if int4 else INT8_RANGE
    y = y.clamp(lo, hi)
    return pack_int4(y) if int4 else y.to(torch.int8)


def _round(x: torch.Tensor, mode: str = "rint") -> torch.Tensor:
    if mode == "rint":
        return torch.round(x)  # half to even
    if mode == "round":
        return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)  # half away from zero
    return torch.floor(x)


def _smoothed(x: torch.Tensor, smooth_scales, group_index) -> torch.Tensor:
    xf = x.float()
    if smooth_scales is None:
        return xf
    if group_index is None:
        return xf * smooth_scales.float()
    # MoE: smooth_scales[i] applies to rows [group_index[i-1], group_index[i]) of x (as 2-D rows).
    rows = xf.reshape(-1, xf.shape[-1]).clone()
    start = 0
    for i, end in enumerate(group_index.tolist()):
        rows[start:end] *= smooth_scales[i].float()
        start = end
    return rows.reshape(xf.shape)


# ------------------------------------------------------------------------------------------ quant ops
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """Symmetric per-token quantization: `scale = rowmax|x| / DTYPE_MAX`, `y = round(x / scale)`.

    DTYPE_MAX is 127 (int8) or 7 (int4). Returns (y, scale) with scale float32 of x's shape minus the
    last axis; y int8, or int32 with 8 int4 per element for dst_type=torch.quint4x2.
    Doc: torch_npu-npu_dynamic_quant.md, aclnnDynamicQuantV2.md; CPU golden in op-plugin
    test/test_custom_ops/test_npu_dynamic_quant.py.
    Not documented: an all-zero row (0 / 0); here y = 0 and scale = 0, so that it dequantizes to 0.
    """
    int4 = _is_int4(dst_type)
    xf = _smoothed(input, smooth_scales, group_index)
    scale = xf.abs().amax(-1) / (INT4_RANGE[1] if int4 else INT8_RANGE[1])
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(scale[..., None] > 0, torch.round(xf / safe[..., None]), torch.zeros_like(xf))
    return _emit(y, int4), scale


# The asymmetric kernel floors the scale (ops-nn quant/dynamic_quant/op_kernel/dynamic_quant_base.h,
# GetScaleAndOffset): a constant row gets scale 1e-12 and dequantizes to its value within ~1e-10.
ASYMMETRIC_MIN_SCALE = 1e-12


def npu_dynamic_quant_asymmetric(input, *, smooth_scales=None, group_index=None, dst_type=None,
                                 quant_mode="pertoken", dst_type_max=0.0):
    """Asymmetric per-token quantization (doc formula, pertoken mode):

    `scale = max((rowMax - rowMin) / (DST_MAX - DST_MIN), 1e-12)`, `offset = DST_MAX - rowMax / scale`,
    `y = round(x / scale + offset)` clamped to the output range; dequantization is `(y - offset) * scale`.
    Returns (y, scale, offset), scale and offset float32 of x's shape minus the last axis.
    Doc: torch_npu-npu_dynamic_quant_asymmetric.md, aclnnDynamicQuantV2.md; CPU golden in op-plugin
    test/test_custom_ops/test_npu_dynamic_quant_asymmetric.py. The 1e-12 floor is the kernel's, not
    documented: a constant row's codes are then meaningless (rounding error of x / 1e-12) but its
    dequantization is the row's value up to ~(DST_MAX - DST_MIN) * 1e-12.
    """
    int4 = _is_int4(dst_type)
    lo, hi = INT4_RANGE if int4 else INT8_RANGE
    xf = _smoothed(input, smooth_scales, group_index)
    mx, mn = xf.amax(-1), xf.amin(-1)
    scale = torch.clamp((mx - mn) / (hi - lo), min=ASYMMETRIC_MIN_SCALE)
    offset = hi - mx / scale
    y = torch.round(xf / scale[..., None] + offset[..., None])
    return _emit(y, int4), scale, offset


def _along_axis(p: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    """A 1-D parameter lined up with input axis `axis` (multi-dimensional ones broadcast as given)."""
    if p.ndim != 1:
        return p
    axis = axis % ndim
    return p.reshape((-1,) + (1,) * (ndim - 1 - axis))


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    """Quantize with given scales.

    div_mode=False: `y = round(input * scales + zero_points)`, clamped to the output range; the
      element-wise axis of 1-D scales is the second-to-last for axis=-2, else the last.
      dtype torch.qint8 -> int8; torch.quint4x2 -> int32 holding 8 int4 (last axis / 8).
    div_mode=True: `y = zero_points + round(input * (1 / scales))` along channel axis `axis`,
      clamped to the dtype's range - the arithmetic of torch.quantize_per_channel, which is the
      op tests' CPU golden (the doc's formula `input / scales + zero_points` leaves the rounding
      point open; the golden rounds before adding the integer zero point).
    Arithmetic in float32, rounding half to even and saturation to the output range are those of
    aclnnAscendQuantV3's golden (ops-nn quant/ascend_quant_v2/tests/assets/golden.py: float32,
    np.round, np.clip) - the torch_npu doc gives neither.
    Doc: torch_npu-npu_quantize.md, aclnnAscendQuantV3.md; golden in op-plugin
    test/test_custom_ops/test_npu_quantize.py.
    """
    x = input.float()
    if not div_mode:
        ax = -2 if axis == -2 else -1
        s = _along_axis(scales.float(), x.ndim, ax)
        y = x * s
        if zero_points is not None:
            y = y + _along_axis(zero_points.float(), x.ndim, ax)
        return _emit(torch.round(y), _is_int4(dtype))
    s = _along_axis(scales.float(), x.ndim, axis)
    y = torch.round(x * (1.0 / s))
    if zero_points is not None:
        y = y + _along_axis(zero_points.float(), x.ndim, axis)
    lo, hi, out = {torch.qint8: (-128, 127, torch.int8), torch.quint8: (0, 255, torch.uint8),
                   torch.qint32: (-2 ** 31, 2 ** 31 - 1, torch.int32),
                   torch.int32: (-2 ** 31, 2 ** 31 - 1, torch.int32)}[dtype]
    return y.clamp(lo, hi).to(out)


def npu_anti_quant(x, scale, *, offset=None, dst_dtype=None, src_dtype=None):
    """`out = (x + offset) * scale` cast to dst_dtype (default float16).

    x: int8, or int32 holding 8 int4 (then scale/offset have 8x x's last axis). scale/offset are 1-D
    (n,), n = 1 or the (unpacked) last axis. Doc: torch_npu.npu_anti_quant (op-plugin docs).
    """
    xi = unpack_int4(x) if x.dtype == torch.int32 else x
    y = xi.float()
    if offset is not None:
        y = y + offset.float()
    return (y * scale.float()).to(dst_dtype or torch.float16)


def npu_rotate_quant(x, rotation, *, alpha=None, dst_dtype=None, axis=-1, round_mode="rint", scale_alg=0,
                     dst_type_max=0.0, transpose_y=False):
    """Block rotation then symmetric per-token quantization (Atlas A2/A3 behaviour).

    `x_rot = x.view(M, N/K, K) @ rotation`, cast back to x's dtype; then as npu_dynamic_quant on
    x_rot with round_mode "rint" (half to even), "round" (half away from zero) or "floor".
    Returns (y, scale float32 [M]). Doc: torch_npu.npu_rotate_quant (op-plugin docs; golden in
    test/test_custom_ops/test_npu_rotate_quant.py, which rotates, casts and calls npu_dynamic_quant).
    """
    m, n = x.shape
    k = rotation.shape[0]
    x_rot = (x.float().reshape(m, n // k, k) @ rotation.float()).reshape(m, n).to(x.dtype).float()
    int4 = _is_int4(dst_dtype)
    scale = x_rot.abs().amax(-1) / (INT4_RANGE[1] if int4 else INT8_RANGE[1])
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(scale[:, None] > 0, _round(x_rot / safe[:, None], round_mode), torch.zeros_like(x_rot))
    return _emit(y, int4), scale


# ------------------------------------------------------------------------------------------ paged write
def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    """Write token i of key/value [T, N, D] into slot `slot_mapping[i]` of the caches, in place.

    cache_mode "Norm"/None (ND): caches [num_blocks, block_size, N, D]; token goes to
      cache[slot // block_size, slot % block_size].
    cache_mode "PA_NZ": caches [num_blocks, N * D // last, block_size, last]; the token's N*D values
      are cut into rows of `last` and row r goes to cache[slot // block_size, r, slot % block_size].
    Returns None. Doc: torch_npu.npu_scatter_pa_kv_cache (scenario 1 and the ND scenario of
    aclnnScatterPaKvCache; golden in test/test_custom_ops/test_scatter_pa_kv_cache.py).
    """
    slots = slot_mapping.long()
    for src, cache in ((key, key_cache), (value, value_cache)):
        if cache_mode in (None, "Norm"):
            bs = cache.shape[1]
            cache[slots // bs, slots % bs] = src.to(cache.dtype)
        else:
            bs, last = cache.shape[2], cache.shape[3]
            rows = src.reshape(src.shape[0], -1, last).to(cache.dtype)
            cache[slots // bs, :, slots % bs] = rows
    return None


# ------------------------------------------------------------------------------------------ attention
def _kv_dense(x: torch.Tensor, layout: str, heads: int, block_table, block_size: int) -> torch.Tensor:
    """K or V as [B, heads, S, d] (d packed for int4), plus for paged input the physical (block, offset)
    of each position. Non-paged input follows `layout`; paged input is BnBsH or BnNBsD."""
    if block_table is None:
        if layout == "BNSD":
            return x, None
        if layout == "BSND":
            return x.permute(0, 2, 1, 3), None
        b, s, h = x.shape  # BSH
        return x.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3), None
    bt = block_table.long()
    nbt, mb = bt.shape
    if x.ndim == 3:  # [num_blocks, block_size, H]
        pages = x.reshape(x.shape[0], block_size, heads, x.shape[2] // heads).permute(0, 2, 1, 3)
    else:  # [num_blocks, heads, block_size, d]
        pages = x
    g = pages[bt.clamp(0, pages.shape[0] - 1)]  # [B, mb, heads, bs, d]
    dense = g.permute(0, 2, 1, 3, 4).reshape(nbt, heads, mb * block_size, pages.shape[-1])
    pos = torch.arange(mb * block_size)
    phys = (bt[:, pos // block_size], pos % block_size)  # [B, S] block ids and offsets
    return dense, phys


def _antiquant_param(p, mode: int, heads: int, s: int, phys, dense_d: int):
    """Scale or offset broadcast against a [B, heads, S, D] KV tensor, in fp32."""
    p = p.float()
    if mode == 0:  # per-channel (1, N, 1, D) / (1, N, D) / (1, H) or per-tensor (1,)
        if p.numel() == 1:
            return p.reshape(1, 1, 1, 1)
        return p.reshape(1, heads, 1, dense_d)
    if mode == 1:  # per-token (1, B, S), shared by all heads
        return p.reshape(p.shape[-2], 1, p.shape[-1], 1)[:, :, :s]
    if mode == 2:  # per-tensor per-head (N,)
        return p.reshape(1, heads, 1, 1)
    if mode == 3:  # per-token per-head (B, N, S)
        return p[:, :, :s, None]
    blk, off = phys
    if mode == 4:  # paged per-token (blocknum, blocksize)
        return p[blk, off][:, None, :, None]
    return p[blk, :, off].permute(0, 2, 1)[..., None]  # mode 5: paged (blocknum, N, blocksize)


def npu_fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
        quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
        key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
        value_antiquant_offset=None, block_table=None, query_padding_size=None, kv_padding_size=None,
        key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
        key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
        next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
        block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False):
    """Decode branch (query S = 1) of the fused attention: `softmax(scale * q k^T) v` per sequence.

    Covered: layouts BSH / BSND / BNSD; GQA (query head h reads kv head h // (N / KV_N)); page
    attention (`block_table` [B, max_blocks] of physical blocks, `block_size`, caches BnBsH
    [num_blocks, block_size, KV_N * D] or BnNBsD [num_blocks, KV_N, block_size, D]); fp16/bf16 KV or
    int8 / int4-in-int32 KV dequantized as `(kv + offset) * scale` with antiquant modes 0-5 (separate
    key/value parameters, or the combined `antiquant_scale`/`antiquant_offset` with shapes (2, ...));
    `actual_seq_lengths_kv` (length 1 = shared by all rows). Positions >= a row's length are masked.
    Returns (out in query's dtype and layout, softmax_lse): lse is float32 [B, N, 1, 1] =
    log(sum(exp(scale * q k^T))) when softmax_lse_flag (the scaled scores: what the documented
    ring-attention merge of two outputs needs), else an empty float32 tensor of shape (0,), as
    op-plugin's FusedInferAttentionScoreKernelNpuOpApi.cpp allocates it (the doc says "(1,) zero").
    A row with actual length 0 (not in the docs): output 0 and lse -3.40e38, as the decode kernel
    writes it (ops-transformer incre_flash_attention_split_Bbn2s2_Us2.h, InitAllZeroOutput).
    Doc: torch_npu-npu_fused_infer_attention_score.md and its 2025-07 docs/context version (the
    antiquant-mode shape table); the antiquant formula `(kv + offset) * scale` is IncreFlashAttention's.
    """
    layout = input_layout
    nq = num_heads
    nkv = num_key_value_heads or num_heads
    if layout == "BNSD":
        q = query[:, :, 0, :]
    elif layout == "BSND":
        q = query[:, 0, :, :]
    else:
        q = query[:, 0, :].reshape(query.shape[0], nq, -1)
    b, _, d = q.shape
    if antiquant_scale is not None and key_antiquant_scale is None:  # combined form: [0] key, [1] value
        key_antiquant_scale, value_antiquant_scale = antiquant_scale[0:1], antiquant_scale[1:2]
        if antiquant_offset is not None:
            key_antiquant_offset, value_antiquant_offset = antiquant_offset[0:1], antiquant_offset[1:2]
        key_antiquant_mode = value_antiquant_mode = antiquant_mode
    bs = block_size if block_table is not None else 0
    kd, phys = _kv_dense(key, layout, nkv, block_table, bs)
    vd, _ = _kv_dense(value, layout, nkv, block_table, bs)
    s = kd.shape[2]

    def dequant(x, sc, off, mode):
        if x.dtype == torch.int32:
            x = unpack_int4(x)
        x = x.float()
        if sc is None:
            return x
        if off is not None:
            x = x + _antiquant_param(off, mode, nkv, s, phys, d)
        return x * _antiquant_param(sc, mode, nkv, s, phys, d)

    kf = dequant(kd, key_antiquant_scale, key_antiquant_offset, key_antiquant_mode)
    vf = dequant(vd, value_antiquant_scale, value_antiquant_offset, value_antiquant_mode)
    lens = torch.as_tensor(actual_seq_lengths_kv if actual_seq_lengths_kv is not None else [s]).reshape(-1).long()
    lens = lens.expand(b) if lens.numel() == 1 else lens[:b]
    valid = torch.arange(s)[None, :] < lens[:, None]  # [B, S]
    # positions past a row's length are never read: whatever they hold (even NaN) cannot leak in
    kf = torch.where(valid[:, None, :, None], kf, torch.zeros_like(kf))
    vf = torch.where(valid[:, None, :, None], vf, torch.zeros_like(vf))
    qf = q.float().reshape(b, nkv, nq // nkv, d)
    scores = torch.einsum("bhgd,bhsd->bhgs", qf, kf) * float(scale)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgs,bhsd->bhgd", p, vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out.reshape(b, nq, d).to(query.dtype)
    if layout == "BNSD":
        out = out[:, :, None, :]
    elif layout == "BSND":
        out = out[:, None, :, :]
    else:
        out = out.reshape(b, 1, nq * d)
    if not softmax_lse_flag:
        return out, torch.zeros(0, dtype=torch.float32)
    lse = torch.where(denom > 0, torch.log(torch.where(denom > 0, denom, torch.ones_like(denom))) + m,
                      torch.full_like(denom, EMPTY_ROW_LSE))
    return out, lse.reshape(b, nq, 1, 1)
