"""Validators of the published contracts of each torch_npu op kvarn_ascend calls, for Atlas A2/A3.

Each validator has the op's Python signature (`op_plugin_functions.yaml`) and raises ValueError
(TypeError for an argument of the wrong Python type) naming the op, the argument and the source of
the rule, e.g. `npu_quantize: scales dtype torch.float32 must equal input's torch.bfloat16 ...
[aclnn_ascend_quant_v3.cpp]`. `SOURCES` maps each tag to the document or file it comes from; a
rule with the tag `kvarn_ascend` is a limit of this package's subset (an op feature it does not
use), not of the op. Tensors on the CPU also get their index values checked (slot and block ids);
on an NPU values are not read back (that would synchronize the device), as the op itself does not
check them ("block ids ... guaranteed by the user").
"""

from __future__ import annotations

import math

import torch

FLOAT16S = (torch.float16, torch.bfloat16)
INT4_DTYPE = torch.quint4x2
INT32_MAX = 2 ** 31 - 1

_OP_PLUGIN = "Ascend/op-plugin "
_DOC = _OP_PLUGIN + "docs/zh/custom_APIs/torch_npu/torch_npu-{}.md"
SOURCES = {
    "op_plugin_functions.yaml": _OP_PLUGIN + "op_plugin/config/op_plugin_functions.yaml (Python signatures; "
                                "a `Tensor self` argument binds as the keyword `input`)",
    **{f"torch_npu-{op}.md": _DOC.format(op) for op in (
        "npu_dynamic_quant", "npu_dynamic_quant_asymmetric", "npu_quantize", "npu_anti_quant",
        "npu_rotate_quant", "npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score")},
    "FIA docs/context": _OP_PLUGIN + "docs/context/torch_npu-npu_fused_infer_attention_score.md (2025-07 "
                        "version: the constraints of the decode branch and the antiquant-mode shape table)",
    "QuantizeKernelNpuOpApi.cpp": _OP_PLUGIN + "op_plugin/ops/opapi/QuantizeKernelNpuOpApi.cpp (div_mode=False "
                                  "calls aclnnAscendQuantV3 with axis -1, or -2 when asked)",
    "DynamicQuantKernelNpuOpApi.cpp": _OP_PLUGIN + "op_plugin/ops/opapi/DynamicQuantKernelNpuOpApi.cpp (pertoken "
                                      "and dst_type_max 0.0 call aclnnDynamicQuantV2)",
    "AntiQuantKernelNpuOpApi.cpp": _OP_PLUGIN + "op_plugin/ops/opapi/AntiQuantKernelNpuOpApi.cpp",
    "FusedInferAttentionScoreKernelNpuOpApi.cpp": _OP_PLUGIN + "op_plugin/ops/opapi/"
                                                  "FusedInferAttentionScoreKernelNpuOpApi.cpp",
    "aclnnAscendQuantV3.md": "cann/ops-nn quant/ascend_quant_v2/docs/aclnnAscendQuantV3.md",
    "aclnn_ascend_quant_v3.cpp": "cann/ops-nn quant/ascend_quant_v2/op_host/op_api/aclnn_ascend_quant_v3.cpp "
                                 "(CheckDtypeCompatible: float16 x needs float16 scale, bfloat16 x bfloat16)",
    "aclnnDynamicQuantV2.md": "cann/ops-nn quant/dynamic_quant_v2/docs/aclnnDynamicQuantV2.md",
    "aclnnAscendAntiQuant.md": "cann/ops-nn quant/ascend_anti_quant_v2/docs/aclnnAscendAntiQuant.md",
    "aclnnScatterPaKvCache.md": "cann/ops-transformer attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache.md",
    "kvarn_ascend": "a limit of kvarn_ascend's subset of the op (a feature it does not use), not of the op",
}


def _fail(op: str, msg: str, src: str):
    assert src in SOURCES, src
    raise ValueError(f"{op}: {msg} [{src}]")


def _tensor(op, x, name, src, dtypes=None, ndim=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__} [{src}]")
    if dtypes is not None and x.dtype not in dtypes:
        _fail(op, f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}", src)
    if ndim is not None and x.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        _fail(op, f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}", src)
    return x


def _contiguous(op, src, **tensors):
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            _fail(op, f"{name} must be contiguous (non-contiguous tensors are not supported)", src)


def _nonempty(op, src, **tensors):
    for name, t in tensors.items():
        if t.numel() == 0:
            _fail(op, f"{name} is empty (shape {tuple(t.shape)}); the op does not take empty tensors", src)


def _host(t: torch.Tensor):
    """The tensor's values when they can be read without a device sync, else None."""
    return t if t.device.type == "cpu" else None


def _outside(op, names_values, why):
    for name, val in names_values:
        if val is not None:
            _fail(op, f"{name} is outside what kvarn_ascend covers ({why}); pass None", "kvarn_ascend")


# ------------------------------------------------------------------------------------------ quantization
def _smooth(op, doc, x, smooth_scales, group_index, max_groups=None):
    if group_index is not None and smooth_scales is None:
        _fail(op, "group_index needs smooth_scales", "aclnnDynamicQuantV2.md")
    if smooth_scales is None:
        return
    _tensor(op, smooth_scales, "smooth_scales", doc, FLOAT16S)
    if smooth_scales.dtype != x.dtype:
        _fail(op, f"smooth_scales dtype {smooth_scales.dtype} must equal input's {x.dtype} (single-op mode)", doc)
    h = x.shape[-1]
    if group_index is None:
        if smooth_scales.ndim != 1 or smooth_scales.shape[0] != h:
            _fail(op, f"smooth_scales must be 1-D of input's last dimension ({h}), got {tuple(smooth_scales.shape)}",
                  doc)
        return
    _tensor(op, group_index, "group_index", doc, (torch.int32,), 1)
    if smooth_scales.ndim != 2 or smooth_scales.shape[1] != h:
        _fail(op, f"with group_index, smooth_scales must be [E, {h}], got {tuple(smooth_scales.shape)}", doc)
    e = smooth_scales.shape[0]
    if group_index.shape[0] != e:
        _fail(op, f"group_index has {group_index.shape[0]} entries for {e} smooth_scales rows", doc)
    if max_groups is not None and not 1 <= e <= max_groups:
        _fail(op, f"smooth_scales has E={e} groups; E must be in [1, {max_groups}]", doc)
    gi = _host(group_index)
    if gi is not None:
        rows = x.numel() // h
        if bool((gi[1:] < gi[:-1]).any()) or int(gi[-1]) != rows:
            _fail(op, f"group_index must be non-decreasing and end at input's row count {rows}, got {gi.tolist()}",
                  doc)


def _dynamic_quant(op, input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max, max_groups):
    doc = f"torch_npu-{op}.md"
    x = _tensor(op, input, "input", doc, FLOAT16S)
    if x.ndim < 2:
        _fail(op, f"input must have more than 1 dimension, got shape {tuple(x.shape)}",
              "DynamicQuantKernelNpuOpApi.cpp")
    if dst_type not in (None, torch.int8, INT4_DTYPE):
        _fail(op, f"dst_type must be None, torch.int8 or torch.quint4x2 on Atlas A2/A3, got {dst_type}", doc)
    if dst_type is INT4_DTYPE and x.shape[-1] % 8:
        _fail(op, f"int4 output needs input's last dimension to be a multiple of 8, got {x.shape[-1]}",
              "DynamicQuantKernelNpuOpApi.cpp")
    # other modes go to aclnnDynamicQuantV3/V4, which this package does not use
    if quant_mode != "pertoken":
        _fail(op, f"quant_mode must be 'pertoken', got {quant_mode!r}", "kvarn_ascend")
    if dst_type_max != 0.0:
        _fail(op, f"dst_type_max must be 0.0, got {dst_type_max!r}", "kvarn_ascend")
    _smooth(op, doc, x, smooth_scales, group_index, max_groups)


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    _dynamic_quant("npu_dynamic_quant", input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max,
                   max_groups=1024)


def npu_dynamic_quant_asymmetric(input, *, smooth_scales=None, group_index=None, dst_type=None,
                                 quant_mode="pertoken", dst_type_max=0.0):
    _dynamic_quant("npu_dynamic_quant_asymmetric", input, smooth_scales, group_index, dst_type, quant_mode,
                   dst_type_max, max_groups=1024)


def _param_shape(op, src, p, name, x, ax, allow_multi):
    """1-D of x.shape[ax] or 1; or (if allow_multi) x.ndim dims, all 1 but `ax` (= x.shape[ax] or 1)."""
    n = x.shape[ax]
    if p.ndim == 1:
        if p.shape[0] not in (n, 1):
            _fail(op, f"{name} has {p.shape[0]} elements; it must have 1 or input.shape[{ax}] = {n}", src)
        return
    if not allow_multi or p.ndim != x.ndim:
        _fail(op, f"{name} must be 1-D (or have input's {x.ndim} dims), got shape {tuple(p.shape)}", src)
    axn = ax % x.ndim
    for i, (ps, xs) in enumerate(zip(p.shape, x.shape)):
        if i == axn and ps not in (xs, 1) or i != axn and ps != 1:
            _fail(op, f"{name} shape {tuple(p.shape)} must be 1 on every axis but {ax} (which is {xs} or 1)", src)


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    op, doc = "npu_quantize", "torch_npu-npu_quantize.md"
    x = _tensor(op, input, "input", doc, (torch.float32,) + FLOAT16S)
    if not isinstance(div_mode, bool):
        raise TypeError(f"{op}: div_mode must be a bool, got {type(div_mode).__name__} [op_plugin_functions.yaml]")
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__} [op_plugin_functions.yaml]")
    if div_mode:  # aclnnQuantize (torch.quantize_per_channel's arithmetic)
        if dtype not in (torch.qint8, torch.quint8, torch.qint32, torch.int32):
            _fail(op, f"with div_mode=True dtype must be torch.qint8, torch.quint8 or torch.int32, got {dtype}", doc)
        if not -x.ndim <= axis < x.ndim:
            _fail(op, f"axis={axis} is out of range for input with {x.ndim} dims", doc)
        _tensor(op, scales, "scales", doc, (torch.float32, torch.bfloat16))
        _param_shape(op, doc, scales, "scales", x, axis, allow_multi=False)
        if zero_points is not None:
            _tensor(op, zero_points, "zero_points", doc, (torch.int8, torch.uint8, torch.int32, torch.bfloat16))
            if zero_points.shape != scales.shape:
                _fail(op, f"zero_points shape {tuple(zero_points.shape)} must equal scales' {tuple(scales.shape)}", doc)
        return
    # div_mode=False: aclnnAscendQuantV3, y = round(input * scales + zero_points) saturated to the output
    if dtype not in (torch.qint8, INT4_DTYPE):
        _fail(op, f"with div_mode=False dtype must be torch.qint8 or torch.quint4x2, got {dtype}", doc)
    if not 1 <= x.ndim <= 8:
        _fail(op, f"input must have 1 to 8 dimensions, got {x.ndim}", "aclnnAscendQuantV3.md")
    if dtype is INT4_DTYPE and x.shape[-1] % 8:
        _fail(op, f"quint4x2 output needs input's last dimension to be a multiple of 8, got {x.shape[-1]}",
              "QuantizeKernelNpuOpApi.cpp")
    if not -2 <= axis < x.ndim:
        _fail(op, f"with div_mode=False axis must be in [-2, input.ndim={x.ndim}), got {axis}", doc)
    ax = -2 if axis == -2 else -1  # QuantizeKernelNpuOpApi.cpp: any axis > -2 is passed as -1
    if x.ndim == 1 and ax == -2:
        _fail(op, "axis=-2 needs input with at least 2 dimensions", "aclnnAscendQuantV3.md")
    _tensor(op, scales, "scales", doc, (torch.float32,) + FLOAT16S)
    if scales.ndim == 0:
        _fail(op, "scales must have at least 1 dimension (scalars are not supported)", "aclnn_ascend_quant_v3.cpp")
    # The doc: scales' dtype "must equal input's"; the aclnn check lets float32 input take any scale dtype
    # but rejects a float16/bfloat16 input with scales of another dtype (error 161002). The doc's rule,
    # the stricter, is enforced: pass float32 input with float32 scales to keep fp32 parameters exact.
    if scales.dtype != x.dtype:
        _fail(op, f"scales dtype {scales.dtype} must equal input's {x.dtype} (div_mode=False); cast the input to "
                  "float32 (exact) rather than the scales to the input's dtype", "aclnn_ascend_quant_v3.cpp")
    _param_shape(op, "aclnnAscendQuantV3.md", scales, "scales", x, ax, allow_multi=True)
    if zero_points is not None:
        _tensor(op, zero_points, "zero_points", doc)
        if zero_points.shape != scales.shape or zero_points.dtype != scales.dtype:
            _fail(op, f"zero_points ({tuple(zero_points.shape)}, {zero_points.dtype}) must have scales' shape and "
                      f"dtype ({tuple(scales.shape)}, {scales.dtype})", "aclnnAscendQuantV3.md")


def npu_anti_quant(x, scale, *, offset=None, dst_dtype=None, src_dtype=None):
    op, doc = "npu_anti_quant", "torch_npu-npu_anti_quant.md"
    _tensor(op, x, "x", doc, (torch.int8, torch.int32))
    if not 1 <= x.ndim <= 8:
        _fail(op, f"x must have 1 to 8 dimensions, got {x.ndim}", doc)
    if x.dtype == torch.int32 and not x.is_contiguous():
        _fail(op, "int32 x (int4 codes) must be contiguous", "aclnnAscendAntiQuant.md")
    _tensor(op, scale, "scale", doc, (torch.float32, torch.bfloat16), 1)
    n = x.shape[-1] * (8 if x.dtype == torch.int32 else 1)
    if scale.shape[0] not in (1, n):
        _fail(op, f"scale has {scale.shape[0]} elements; it must have 1 or {n} (x's last dimension"
                  + (", times 8 for int32 x holding int4)" if x.dtype == torch.int32 else ")"), doc)
    if offset is not None:
        _tensor(op, offset, "offset", doc)
        if offset.shape != scale.shape or offset.dtype != scale.dtype:
            _fail(op, "offset must have scale's shape and dtype", doc)
    if dst_dtype not in (None,) + FLOAT16S:
        _fail(op, f"dst_dtype must be None (float16), torch.float16 or torch.bfloat16, got {dst_dtype}", doc)
    if src_dtype not in (None, torch.int8, INT4_DTYPE):
        _fail(op, f"src_dtype must be None (int8), torch.int8 or torch.quint4x2, got {src_dtype}", doc)
    if src_dtype is not None and src_dtype is not (INT4_DTYPE if x.dtype == torch.int32 else torch.int8):
        _fail(op, f"src_dtype {src_dtype} does not match x's dtype {x.dtype} (int32 x holds int4: torch.quint4x2)",
              "AntiQuantKernelNpuOpApi.cpp")


def npu_rotate_quant(x, rotation, *, alpha=None, dst_dtype=None, axis=-1, round_mode="rint", scale_alg=0,
                     dst_type_max=0.0, transpose_y=False):
    op, doc = "npu_rotate_quant", "torch_npu-npu_rotate_quant.md"
    _tensor(op, x, "x", doc, FLOAT16S, 2)
    _tensor(op, rotation, "rotation", doc, FLOAT16S, 2)
    if rotation.dtype != x.dtype:
        _fail(op, f"rotation dtype {rotation.dtype} must equal x's {x.dtype}", doc)
    k = rotation.shape[0]
    if rotation.shape[1] != k or not 16 <= k <= 1024:
        _fail(op, f"rotation must be [K, K] with K in [16, 1024] (Atlas A2/A3), got {tuple(rotation.shape)}", doc)
    n = x.shape[1]
    if n % k or n % 8 or not 128 <= n <= 16000:
        _fail(op, f"x's last dimension {n} must be in [128, 16000], a multiple of 8 and of K={k}", doc)
    if dst_dtype not in (None, torch.int8, INT4_DTYPE):
        _fail(op, f"dst_dtype must be torch.int8 or torch.quint4x2 on Atlas A2/A3, got {dst_dtype}", doc)
    if alpha is not None:
        _fail(op, "alpha must be None on Atlas A2/A3", doc)
    if axis not in (-1, 1):
        _fail(op, f"axis must be -1 or 1, got {axis}", doc)
    if round_mode not in ("rint", "round", "floor"):
        _fail(op, f"round_mode must be 'rint', 'round' or 'floor', got {round_mode!r}", doc)
    if scale_alg != 0 or dst_type_max != 0.0 or transpose_y is not False:
        _fail(op, "scale_alg must be 0, dst_type_max 0.0 and transpose_y False on Atlas A2/A3", doc)


# ------------------------------------------------------------------------------------------ paged write
# Atlas A2/A3 take FLOAT16, BFLOAT16 and INT8 only (the doc lists the others as unsupported there):
# int4 codes are written as their bytes, an int8 view [..., D/2] of the packed int32 [..., D/8].
SCATTER_DTYPES = (torch.float16, torch.bfloat16, torch.int8)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    op, doc, acl = "npu_scatter_pa_kv_cache", "torch_npu-npu_scatter_pa_kv_cache.md", "aclnnScatterPaKvCache.md"
    _outside(op, (("compress_lens", compress_lens), ("compress_seq_offsets", compress_seq_offsets),
                  ("seq_lens", seq_lens)), "the KV-compression scenarios")
    for name, t in (("key", key), ("value", value)):
        _tensor(op, t, name, acl, SCATTER_DTYPES, 3)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(op, t, name, acl, SCATTER_DTYPES, 4)
    _tensor(op, slot_mapping, "slot_mapping", doc, (torch.int32, torch.int64), 1)
    _contiguous(op, doc, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=slot_mapping)
    _nonempty(op, acl, key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if not key.dtype == value.dtype == key_cache.dtype == value_cache.dtype:
        _fail(op, f"key, value, key_cache and value_cache must share one dtype, got {key.dtype}, {value.dtype}, "
                  f"{key_cache.dtype}, {value_cache.dtype}", doc)
    if key.shape[:2] != value.shape[:2]:
        _fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree on [tokens, heads]", doc)
    if cache_mode not in (None, "Norm", "PA_NZ"):
        _fail(op, f"cache_mode must be None, 'Norm' (ND) or 'PA_NZ', got {cache_mode!r}", doc)
    for name, src, cache in (("key_cache", key, key_cache), ("value_cache", value, value_cache)):
        t, n, d = src.shape
        if cache_mode in (None, "Norm"):
            if tuple(cache.shape[2:]) != (n, d):
                _fail(op, f"{name} must be [num_blocks, block_size, {n}, {d}] for cache_mode 'Norm', "
                          f"got {tuple(cache.shape)}", acl)
        else:
            last = 32 // src.element_size()  # a 32-byte row of the NZ layout
            if (d * src.element_size()) % 32 or tuple(cache.shape[1:2] + cache.shape[3:]) != (n * d // last, last):
                _fail(op, f"{name} must be [num_blocks, {n}*{d}//{last}, block_size, {last}] for cache_mode 'PA_NZ' "
                          f"with a head dim of a multiple of 32 bytes, got {tuple(cache.shape)}", acl)
            if cache.shape[2] >= 65535:
                _fail(op, f"{name}'s block_size {cache.shape[2]} must be below 65535 (UINT16_MAX) for 'PA_NZ'", acl)
    bdim = 1 if cache_mode in (None, "Norm") else 2
    if key_cache.shape[0] != value_cache.shape[0] or key_cache.shape[bdim] != value_cache.shape[bdim]:
        _fail(op, "key_cache and value_cache must have the same num_blocks and block_size", doc)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(op, f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens", doc)
    sm = _host(slot_mapping)
    if sm is not None:
        total = key_cache.shape[0] * key_cache.shape[bdim]
        bad = (sm < 0) | (sm >= total)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            _fail(op, f"slot_mapping[{i}] = {int(sm[i])} is outside [0, num_blocks * block_size - 1 = {total - 1}] "
                      "(padding slots such as -1 must be removed before the call)", doc)
        if torch.unique(sm).numel() != sm.numel():
            _fail(op, "slot_mapping has repeated slots; the op does not guarantee a result for them", doc)


# ------------------------------------------------------------------------------------------ attention
def _lens(op, actual_seq_lengths_kv):
    if actual_seq_lengths_kv is None:
        return None
    if not isinstance(actual_seq_lengths_kv, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in actual_seq_lengths_kv):
        raise TypeError(f"{op}: actual_seq_lengths_kv must be a list of ints (SymInt[]), got "
                        f"{type(actual_seq_lengths_kv).__name__} [op_plugin_functions.yaml]")
    return list(actual_seq_lengths_kv)


def _antiquant_shape_ok(mode, p, nkv, d, b, s_needed, nblocks, bs):
    """(ok, wanted): the documented shapes of each antiquant mode (FIA docs/context table)."""
    shp = tuple(p.shape)
    if mode == 0:
        return (shp in ((1,), (1, nkv, 1, d), (1, nkv, d), (1, nkv * d)),
                f"(1,), (1, {nkv}, 1, {d}), (1, {nkv}, {d}) or (1, {nkv * d})")
    if mode == 1:
        return len(shp) == 3 and shp[:2] == (1, b) and shp[2] >= s_needed, f"(1, {b}, S >= {s_needed})"
    if mode == 2:
        return shp == (nkv,), f"({nkv},)"
    if mode == 3:
        return len(shp) == 3 and shp[:2] == (b, nkv) and shp[2] >= s_needed, f"({b}, {nkv}, S >= {s_needed})"
    if mode == 4:
        return shp == (nblocks, bs), f"({nblocks}, {bs})"
    return shp == (nblocks, nkv, bs), f"({nblocks}, {nkv}, {bs})"


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
    op, doc, ctx = "npu_fused_infer_attention_score", "torch_npu-npu_fused_infer_attention_score.md", "FIA docs/context"
    _outside(op, (("pse_shift", pse_shift), ("atten_mask", atten_mask), ("dequant_scale1", dequant_scale1),
                  ("quant_scale1", quant_scale1), ("dequant_scale2", dequant_scale2), ("quant_scale2", quant_scale2),
                  ("quant_offset2", quant_offset2), ("query_padding_size", query_padding_size),
                  ("kv_padding_size", kv_padding_size), ("key_shared_prefix", key_shared_prefix),
                  ("value_shared_prefix", value_shared_prefix), ("actual_shared_prefix_len", actual_shared_prefix_len),
                  ("query_rope", query_rope), ("key_rope", key_rope),
                  ("key_rope_antiquant_scale", key_rope_antiquant_scale)),
             "its decode branch without masks, position encodings, prefix, rope, padding or full quantization")
    if input_layout not in ("BSH", "BSND", "BNSD"):
        _fail(op, f"input_layout must be 'BSH', 'BSND' or 'BNSD' for kvarn_ascend's decode subset, "
                  f"got {input_layout!r}", "kvarn_ascend")
    for name, v in (("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads),
                    ("block_size", block_size), ("inner_precise", inner_precise), ("antiquant_mode", antiquant_mode),
                    ("key_antiquant_mode", key_antiquant_mode), ("value_antiquant_mode", value_antiquant_mode),
                    ("sparse_mode", sparse_mode), ("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__} [op_plugin_functions.yaml]")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"{op}: scale must be a finite float (usually 1/sqrt(D)), got {scale!r} "
                        "[op_plugin_functions.yaml]")
    if not isinstance(softmax_lse_flag, bool):
        raise TypeError(f"{op}: softmax_lse_flag must be a bool [op_plugin_functions.yaml]")
    q = _tensor(op, query, "query", doc, FLOAT16S, 3 if input_layout == "BSH" else 4)
    _contiguous(op, doc, query=query, key=key, value=value)
    q_s = q.shape[2] if input_layout == "BNSD" else q.shape[1]
    if q_s != 1:
        _fail(op, f"query's S is {q_s}; kvarn_ascend covers the decode branch (S = 1) only", "kvarn_ascend")
    b = q.shape[0]
    if not 1 <= b <= 65536:
        _fail(op, f"batch B={b} must be in [1, 65536]", doc)
    if not 1 <= num_heads <= 256:
        _fail(op, f"num_heads must be in [1, 256], got {num_heads}", doc)
    nkv = num_key_value_heads or num_heads
    if not 1 <= nkv <= 256 or num_heads % nkv or num_heads // nkv > 64:
        _fail(op, f"num_key_value_heads={num_key_value_heads}: num_heads={num_heads} must be a multiple of it "
                  "with a ratio of at most 64, and both at most 256", doc)
    if input_layout == "BSH":
        if q.shape[2] % num_heads:
            _fail(op, f"query's H={q.shape[2]} is not a multiple of num_heads={num_heads}", doc)
        d = q.shape[2] // num_heads
    else:
        qn = q.shape[1] if input_layout == "BNSD" else q.shape[2]
        if qn != num_heads:
            _fail(op, f"query has {qn} heads but num_heads={num_heads} ({input_layout} must agree)", doc)
        d = q.shape[3]
    if d > 512:
        _fail(op, f"head dim D={d} exceeds 512", doc)
    _tensor(op, key, "key", doc, (q.dtype, torch.int8, torch.int32))
    _tensor(op, value, "value", doc, (q.dtype, torch.int8, torch.int32))
    if key.shape != value.shape or key.dtype != value.dtype:
        _fail(op, f"key ({tuple(key.shape)}, {key.dtype}) and value ({tuple(value.shape)}, {value.dtype}) "
                  "must have the same shape and dtype", doc)
    if key.numel() > INT32_MAX:
        _fail(op, f"key has {key.numel()} elements, more than int32 can index", ctx)
    kvq = key.dtype in (torch.int8, torch.int32)
    align, what = {torch.int8: (32, "int8 needs 32-byte"), torch.int32: (64, "int4 needs 64-element")}.get(
        key.dtype, (8, f"{q.dtype} needs 16-byte"))
    if d % align:
        _fail(op, f"head dim D={d} is not aligned: {what} alignment (D a multiple of {align})", doc)
    dk = d // 8 if key.dtype == torch.int32 else d  # int32 holds 8 int4: KV's last axis is D/8
    lens = _lens(op, actual_seq_lengths_kv)
    if lens is not None:
        if len(lens) != 1 and len(lens) < b:
            _fail(op, f"actual_seq_lengths_kv has {len(lens)} entries; it needs 1 or at least the batch {b}", ctx)
        if min(lens) < 0:
            _fail(op, f"actual_seq_lengths_kv must be >= 0, got {lens}", doc)
        lens = lens * b if len(lens) == 1 else lens[:b]
    nblocks = bs = 0
    if block_table is not None:
        _tensor(op, block_table, "block_table", doc, (torch.int32,), 2)
        if block_table.shape[0] != b:
            _fail(op, f"block_table has {block_table.shape[0]} rows for a batch of {b}", ctx)
        if key.dtype == torch.int32:
            _fail(op, "int4 (int32) key/value cannot be used with page attention (block_table) in the decode "
                      "branch; gather the blocks into a contiguous tensor instead", ctx)
        bs = block_size
        if not 0 < bs <= 512:
            _fail(op, f"block_size must be in [1, 512] with page attention, got {bs}", ctx)
        balign = 32 if key.dtype == torch.int8 else 16
        if bs % balign:
            _fail(op, f"block_size={bs} must be a multiple of {balign} for {key.dtype} key/value", ctx)
        if key.ndim == 3:
            if key.shape[1] != bs or key.shape[2] != nkv * dk:
                _fail(op, f"paged key must be [num_blocks, block_size={bs}, {nkv}*{dk}] (BnBsH), "
                          f"got {tuple(key.shape)}", ctx)
            if nkv * dk > 65535:
                _fail(op, f"a BnBsH cache with KV_N*D = {nkv * dk} > 65535 is not supported; use [num_blocks, KV_N, "
                          "block_size, D] with BNSD or fewer kv heads", ctx)
        elif key.ndim == 4:
            if input_layout != "BNSD":
                _fail(op, f"a [num_blocks, KV_N, block_size, D] cache needs input_layout BNSD, got {input_layout}", ctx)
            if tuple(key.shape[1:]) != (nkv, bs, dk):
                _fail(op, f"paged key must be [num_blocks, {nkv}, {bs}, {dk}] (BnNBsD), got {tuple(key.shape)}", ctx)
        else:
            _fail(op, f"paged key must have 3 or 4 dimensions, got shape {tuple(key.shape)}", ctx)
        nblocks = key.shape[0]
        if lens is None:
            _fail(op, "actual_seq_lengths_kv is required with page attention", doc)
        mb = block_table.shape[1]
        if max(lens) > mb * bs:
            _fail(op, f"actual_seq_lengths_kv {max(lens)} exceeds block_table.shape[1] * block_size = {mb * bs}", ctx)
        need = sum(-(-n // bs) for n in lens)
        if nblocks < need:
            _fail(op, f"the cache has {nblocks} blocks, fewer than the {need} the sequences use", ctx)
        bt = _host(block_table)
        if bt is not None:
            for i, n in enumerate(lens):
                used = bt[i, :-(-n // bs)]
                if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nblocks):
                    _fail(op, f"block_table[{i}] uses block ids outside [0, {nblocks}): {used.tolist()}", ctx)
        s_needed = mb * bs
    else:
        if input_layout == "BSH":
            ok = key.ndim == 3 and key.shape[0] == b and key.shape[2] == nkv * dk
            s_kv, want = (key.shape[1] if key.ndim == 3 else -1), f"[{b}, S, {nkv * dk}]"
        elif input_layout == "BSND":
            ok = key.ndim == 4 and key.shape[0] == b and tuple(key.shape[2:]) == (nkv, dk)
            s_kv, want = (key.shape[1] if key.ndim == 4 else -1), f"[{b}, S, {nkv}, {dk}]"
        else:
            ok = key.ndim == 4 and key.shape[0] == b and key.shape[1] == nkv and key.shape[3] == dk
            s_kv, want = (key.shape[2] if key.ndim == 4 else -1), f"[{b}, {nkv}, S, {dk}]"
        if not ok:
            _fail(op, f"key must be {want} for input_layout {input_layout}, got {tuple(key.shape)}", doc)
        if s_kv > 262144:
            _fail(op, f"KV length {s_kv} exceeds 262144 (decode branch)", doc)
        if lens is not None and max(lens) > s_kv:
            _fail(op, f"actual_seq_lengths_kv {max(lens)} exceeds key/value's S = {s_kv}", ctx)
        s_needed = s_kv
    if inner_precise not in (0, 1):
        _fail(op, f"inner_precise must be 0 or 1 in the decode branch, got {inner_precise}", doc)

    # ---- antiquant (KV int8 / int4 dequantized inside the op)
    if antiquant_scale is not None and key_antiquant_scale is None:
        if key.dtype != torch.int8:
            _fail(op, "antiquant_scale/antiquant_offset (combined form) need int8 key/value", doc)
        if antiquant_mode not in (0, 1):
            _fail(op, f"antiquant_mode must be 0 (per-channel) or 1 (per-token), got {antiquant_mode}", doc)
        _tensor(op, antiquant_scale, "antiquant_scale", doc)
        if antiquant_scale.shape[0] != 2:
            _fail(op, f"antiquant_scale's first dimension must be 2 (key, value), got {tuple(antiquant_scale.shape)}",
                  doc)
        if antiquant_offset is not None and (antiquant_offset.shape != antiquant_scale.shape
                                             or antiquant_offset.dtype != antiquant_scale.dtype):
            _fail(op, "antiquant_offset must have antiquant_scale's shape and dtype", doc)
        key_antiquant_scale = value_antiquant_scale = antiquant_scale[0:1]
        key_antiquant_offset = value_antiquant_offset = None if antiquant_offset is None else antiquant_offset[0:1]
        key_antiquant_mode = value_antiquant_mode = antiquant_mode
    elif antiquant_offset is not None and antiquant_scale is None:
        _fail(op, "antiquant_offset needs antiquant_scale", doc)
    if (key_antiquant_scale is None) != (value_antiquant_scale is None):
        _fail(op, "key_antiquant_scale and value_antiquant_scale must both be given or both be None", ctx)
    if (key_antiquant_offset is None) != (value_antiquant_offset is None):
        _fail(op, "key_antiquant_offset and value_antiquant_offset must both be given or both be None", ctx)
    if key_antiquant_offset is not None and key_antiquant_scale is None:
        _fail(op, "antiquant offsets need the matching scales", ctx)
    if not kvq:
        if key_antiquant_scale is not None:
            _fail(op, f"antiquant scales need int8 or int4 (int32) key/value, got {key.dtype}", ctx)
        return
    if key_antiquant_scale is None:
        _fail(op, f"{key.dtype} key/value need key_antiquant_scale and value_antiquant_scale (antiquant); "
                  "full quantization (int8 query) is outside kvarn_ascend's subset", "kvarn_ascend")
    km, vm = key_antiquant_mode, value_antiquant_mode
    if km not in range(6) or vm not in range(6):
        _fail(op, f"key_antiquant_mode / value_antiquant_mode must be in 0..5, got {km} / {vm}", doc)
    if km != vm and (km, vm) != (0, 1):
        _fail(op, f"key_antiquant_mode={km} and value_antiquant_mode={vm} must be equal, except key 0 "
                  "(per-channel) with value 1 (per-token)", doc)
    if (km, vm) == (0, 1) and key.dtype == torch.int8 and q.dtype != torch.float16:
        _fail(op, "key per-channel with value per-token on int8 key/value needs a float16 query", ctx)
    if (km, vm) != (0, 1):
        for what, a, c in (("scale", key_antiquant_scale, value_antiquant_scale),
                           ("offset", key_antiquant_offset, value_antiquant_offset)):
            if a is not None and a.shape != c.shape:
                _fail(op, f"key_antiquant_{what} {tuple(a.shape)} and value_antiquant_{what} {tuple(c.shape)} must "
                          "have the same shape", ctx)
    for name, mode in (("key_antiquant_mode", km), ("value_antiquant_mode", vm)):
        if mode in (4, 5) and (block_table is None or key.dtype != torch.int8):
            _fail(op, f"{name}={mode} (scales managed by page attention) needs int8 key/value and block_table", ctx)
        if mode == 2 and key.dtype != torch.int8:
            _fail(op, f"{name}={mode} (per-tensor per-head) needs int8 key/value", ctx)
    for side, sc, off, mode in (("key", key_antiquant_scale, key_antiquant_offset, km),
                                ("value", value_antiquant_scale, value_antiquant_offset, vm)):
        _tensor(op, sc, f"{side}_antiquant_scale", ctx)
        want_dtypes = (q.dtype,) if mode in (0, 2) else (torch.float32,)
        if sc.dtype not in want_dtypes:
            _fail(op, f"{side}_antiquant_scale must be {want_dtypes[0]} for antiquant mode {mode}, got {sc.dtype}", ctx)
        if mode == 0 and sc.numel() == 1 and key.dtype != torch.int8:
            _fail(op, f"per-tensor {side}_antiquant_scale needs int8 key/value", ctx)
        ok, want = _antiquant_shape_ok(mode, sc, nkv, d, b, s_needed, nblocks, bs)
        if not ok:
            _fail(op, f"{side}_antiquant_scale must have shape {want} for antiquant mode {mode}, got "
                      f"{tuple(sc.shape)}", ctx)
        if off is not None:
            _tensor(op, off, f"{side}_antiquant_offset", ctx)
            if off.shape != sc.shape or off.dtype != sc.dtype:
                _fail(op, f"{side}_antiquant_offset must have {side}_antiquant_scale's shape and dtype", ctx)
