"""A recording fake of `torch_npu` for the kvarn_ascend NPU call path on a machine without an NPU.

`FakeTorchNpu` is a module object with the documented signatures of the ops kvarn_ascend calls
(same parameter names, same positional/keyword-only split: a wrong keyword is a TypeError, as with
the real op). Each call is recorded (name, bound arguments summarized as dtype/shape), checked
against the documented dtypes and shapes by assertions written here from the docs (independent of
kvarn_ascend.validators), and answered by kvarn_ascend's CPU semantics, so the NPU path runs end to
end on CPU tensors. `npu.is_available()` is True. Install it with the `fake_torch_npu` fixture.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import torch

from kvarn_ascend import cpu_semantics

F16 = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Call:
    name: str
    args: dict  # parameter -> ("tensor", dtype, shape) or the plain value

    def tensor(self, name):
        a = self.args[name]
        assert isinstance(a, tuple) and a[0] == "tensor", f"{self.name}.{name} is not a tensor: {a!r}"
        return a[1], a[2]


def _summary(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape))
    return v


class FakeTorchNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.calls: list[Call] = []
        self.npu = types.SimpleNamespace(is_available=lambda: True)
        for name in ("npu_dynamic_quant", "npu_dynamic_quant_asymmetric", "npu_quantize", "npu_anti_quant",
                     "npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "npu_rotate_quant"):
            setattr(self, name, self._wrap(name, getattr(self, "_" + name)))

    def names(self):
        return [c.name for c in self.calls]

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def op(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # TypeError on a wrong name or positional misuse
            bound.apply_defaults()
            self.calls.append(Call(name, {k: _summary(v) for k, v in bound.arguments.items()}))
            return fn(*bound.args, **bound.kwargs)
        op.__signature__ = sig
        op.__name__ = name
        return op

    # ---------------------------------------------------------------- documented signatures
    @staticmethod
    def _npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
        assert x.dtype in F16 and x.ndim > 1, (x.dtype, x.shape)
        assert dst_type in (None, torch.int8, torch.quint4x2)
        y, scale = cpu_semantics.npu_dynamic_quant(x, smooth_scales=smooth_scales, group_index=group_index,
                                                   dst_type=dst_type)
        assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
        return y, scale

    @staticmethod
    def _npu_dynamic_quant_asymmetric(x, *, smooth_scales=None, group_index=None, dst_type=None):
        assert x.dtype in F16 and x.ndim > 1, (x.dtype, x.shape)
        assert dst_type in (None, torch.int8, torch.quint4x2)
        if dst_type is torch.quint4x2:
            assert x.shape[-1] % 8 == 0
        y, scale, offset = cpu_semantics.npu_dynamic_quant_asymmetric(x, smooth_scales=smooth_scales,
                                                                      group_index=group_index, dst_type=dst_type)
        want = x.shape[:-1] + ((x.shape[-1] // 8,) if dst_type is torch.quint4x2 else (x.shape[-1],))
        assert y.shape == want and y.dtype == (torch.int32 if dst_type is torch.quint4x2 else torch.int8)
        assert scale.dtype == offset.dtype == torch.float32 and scale.shape == offset.shape == x.shape[:-1]
        return y, scale, offset

    @staticmethod
    def _npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
        assert input.dtype in (torch.float32,) + F16
        if not div_mode:
            assert dtype in (torch.qint8, torch.quint4x2), dtype
            assert scales.dtype in (torch.float32,) + F16
            assert zero_points is None or (zero_points.shape == scales.shape and zero_points.dtype == scales.dtype)
            assert scales.ndim != 1 or scales.shape[0] in (1, input.shape[-2 if axis == -2 else -1])
        return cpu_semantics.npu_quantize(input, scales, zero_points, dtype, axis=axis, div_mode=div_mode)

    @staticmethod
    def _npu_anti_quant(x, scale, *, offset=None, dst_dtype=None, src_dtype=None):
        assert x.dtype in (torch.int8, torch.int32)
        assert scale.ndim == 1 and scale.dtype in (torch.float32, torch.bfloat16)
        assert scale.shape[0] in (1, x.shape[-1] * (8 if x.dtype == torch.int32 else 1))
        assert offset is None or (offset.shape == scale.shape and offset.dtype == scale.dtype)
        assert dst_dtype in (None,) + F16
        assert (src_dtype is torch.quint4x2) == (x.dtype == torch.int32)
        return cpu_semantics.npu_anti_quant(x, scale, offset=offset, dst_dtype=dst_dtype, src_dtype=src_dtype)

    @staticmethod
    def _npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                                 compress_seq_offsets=None, seq_lens=None, cache_mode='PA_NZ'):
        assert key.ndim == value.ndim == 3 and key_cache.ndim == value_cache.ndim == 4
        assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        assert slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == key.shape[:1]
        assert all(t.is_contiguous() for t in (key, value, key_cache, value_cache, slot_mapping))
        if cache_mode in (None, "Norm"):
            assert key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:]
            total = key_cache.shape[0] * key_cache.shape[1]
        else:
            total = key_cache.shape[0] * key_cache.shape[2]
        assert int(slot_mapping.min()) >= 0 and int(slot_mapping.max()) < total, "slot out of range"
        assert torch.unique(slot_mapping).numel() == slot_mapping.numel(), "repeated slots"
        return cpu_semantics.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
                                                     compress_lens=compress_lens,
                                                     compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens,
                                                     cache_mode=cache_mode)

    @staticmethod
    def _npu_fused_infer_attention_score(
            query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
            actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
            quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None, block_table=None,
            query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
            value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
            value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None, key_rope=None,
            key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
            next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
            block_size=0, antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0, value_antiquant_mode=0):
        assert query.dtype in F16
        assert key.dtype in (query.dtype, torch.int8, torch.int32) and key.dtype == value.dtype
        assert key.shape == value.shape
        assert isinstance(actual_seq_lengths_kv, list) and all(type(n) is int for n in actual_seq_lengths_kv), \
            "actual_seq_lengths_kv is a List[int]"
        assert isinstance(scale, float)
        nkv = num_key_value_heads or num_heads
        if input_layout == "BNSD":
            _, n, s, d = query.shape
        elif input_layout == "BSND":
            _, s, n, d = query.shape
        else:
            (_, s, h), n = query.shape, num_heads
            d = h // n
        assert n == num_heads and s == 1, "decode: query S = 1"
        if block_table is not None:
            assert block_table.dtype == torch.int32 and block_table.ndim == 2 and block_table.shape[0] == query.shape[0]
            assert key.dtype != torch.int32, "int4 KV is not paged"
            assert block_size % (32 if key.dtype == torch.int8 else 16) == 0 and 0 < block_size <= 512
            assert key.ndim == 3 and key.shape[1] == block_size
        if key.dtype in (torch.int8, torch.int32):
            assert key_antiquant_scale is not None and value_antiquant_scale is not None
            modes = (key_antiquant_mode, value_antiquant_mode)
            assert modes[0] == modes[1] or modes == (0, 1)
            for sc, off, mode in ((key_antiquant_scale, key_antiquant_offset, key_antiquant_mode),
                                  (value_antiquant_scale, value_antiquant_offset, value_antiquant_mode)):
                if mode == 0:
                    assert sc.dtype == query.dtype
                    assert tuple(sc.shape) in ((1,), (1, nkv, 1, d), (1, nkv, d), (1, nkv * d))
                elif mode == 3:
                    assert sc.dtype == torch.float32 and sc.shape[:2] == (query.shape[0], nkv)
                elif mode == 5:
                    assert sc.dtype == torch.float32 and tuple(sc.shape) == (key.shape[0], nkv, block_size)
                else:
                    raise AssertionError(f"kvarn_ascend uses antiquant modes 0, 3 and 5, got {mode}")
                assert off is None or (off.shape == sc.shape and off.dtype == sc.dtype)
        out = cpu_semantics.npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths_kv=actual_seq_lengths_kv, block_table=block_table,
            key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
            value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
            num_heads=num_heads, scale=scale, input_layout=input_layout, num_key_value_heads=num_key_value_heads,
            block_size=block_size, softmax_lse_flag=softmax_lse_flag, key_antiquant_mode=key_antiquant_mode,
            value_antiquant_mode=value_antiquant_mode)
        assert out[0].dtype == query.dtype and out[0].shape == query.shape
        return out

    @staticmethod
    def _npu_rotate_quant(x, rotation, *, alpha=None, dst_dtype=None, axis=-1, round_mode="rint", scale_alg=0,
                          dst_type_max=0.0, transpose_y=False):
        assert x.dtype in F16 and rotation.dtype == x.dtype and x.ndim == 2
        return cpu_semantics.npu_rotate_quant(x, rotation, alpha=alpha, dst_dtype=dst_dtype, axis=axis,
                                              round_mode=round_mode, scale_alg=scale_alg, dst_type_max=dst_type_max,
                                              transpose_y=transpose_y)


def install(monkeypatch) -> FakeTorchNpu:
    """A FakeTorchNpu installed as sys.modules["torch_npu"] for one test (monkeypatch removes it)."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


# The documented parameter lists (op-plugin torch_npu API docs), for the signature test.
DOCUMENTED_PARAMS = {
    "npu_dynamic_quant": ["x", "smooth_scales", "group_index", "dst_type"],
    "npu_dynamic_quant_asymmetric": ["x", "smooth_scales", "group_index", "dst_type"],
    "npu_quantize": ["input", "scales", "zero_points", "dtype", "axis", "div_mode"],
    "npu_anti_quant": ["x", "scale", "offset", "dst_dtype", "src_dtype"],
    "npu_scatter_pa_kv_cache": ["key", "value", "key_cache", "value_cache", "slot_mapping", "compress_lens",
                                "compress_seq_offsets", "seq_lens", "cache_mode"],
    "npu_fused_infer_attention_score": [
        "query", "key", "value", "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv",
        "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2", "antiquant_scale",
        "antiquant_offset", "block_table", "query_padding_size", "kv_padding_size", "key_antiquant_scale",
        "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset", "key_shared_prefix",
        "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale",
        "num_heads", "scale", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads", "sparse_mode",
        "inner_precise", "block_size", "antiquant_mode", "softmax_lse_flag", "key_antiquant_mode",
        "value_antiquant_mode"],
    "npu_rotate_quant": ["x", "rotation", "alpha", "dst_dtype", "axis", "round_mode", "scale_alg", "dst_type_max",
                         "transpose_y"],
}
