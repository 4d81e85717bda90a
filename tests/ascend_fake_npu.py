"""A recording fake of `torch_npu` for the kvarn_ascend NPU call path on a machine without an NPU.

`FakeTorchNpu` is a module object whose ops have the real Python signatures (parsed from the schema
lines of op-plugin's `op_plugin_functions.yaml` in `REAL_SCHEMAS`: a wrong keyword is a TypeError,
as with the real binding). Every call is
1. recorded (name, bound arguments summarized as dtype/shape),
2. checked by `kvarn_ascend.validators` (the published A2/A3 contracts), so a call the real op would
   reject fails here even when it bypasses `ops.call`,
3. checked again by a few assertions written here independently of the validators (a second
   reading of the same documents, for the rules whose breach has reached this code before),
4. answered by kvarn_ascend's CPU semantics, so the NPU path runs end to end on CPU tensors.
`npu.is_available()` is True. Install it with `install(monkeypatch)`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types

import torch

from kvarn_ascend import cpu_semantics, validators

F16 = (torch.float16, torch.bfloat16)

# The schema of each op as op_plugin_functions.yaml declares it (the `func:` line).
REAL_SCHEMAS = {
    "npu_dynamic_quant": "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
                         "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)",
    "npu_dynamic_quant_asymmetric": "npu_dynamic_quant_asymmetric(Tensor input, *, Tensor? smooth_scales=None, "
                                    "Tensor? group_index=None, int? dst_type=None, str quant_mode=\"pertoken\", "
                                    "float dst_type_max=0.0) -> (Tensor, Tensor, Tensor)",
    "npu_quantize": "npu_quantize(Tensor self, Tensor scales, Tensor? zero_points, int dtype, int axis=1, "
                    "bool div_mode=True) -> Tensor",
    "npu_anti_quant": "npu_anti_quant(Tensor x, Tensor scale, *, Tensor? offset=None, int? dst_dtype=None, "
                      "int? src_dtype=None) -> Tensor",
    "npu_scatter_pa_kv_cache": "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
                               "Tensor(b!) value_cache, Tensor slot_mapping, *, Tensor? compress_lens=None, "
                               "Tensor? compress_seq_offsets=None, Tensor? seq_lens=None, "
                               "str? cache_mode='PA_NZ') -> ()",
    "npu_fused_infer_attention_score": (
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
        "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, "
        "Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, "
        "Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
        "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", "
        "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
        "int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, "
        "bool softmax_lse_flag=False) -> (Tensor, Tensor)"),
    "npu_rotate_quant": "npu_rotate_quant(Tensor x, Tensor rotation, *, Tensor? alpha=None, int? dst_dtype=None, "
                        "int? axis=-1, str? round_mode=\"rint\", int? scale_alg=0, float? dst_type_max=0.0, "
                        "bool? transpose_y=False) -> (Tensor, Tensor)",
}


def _default(text: str):
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "'\"":
        return text[1:-1]
    return float(text) if "." in text else int(text)


def real_signature(op: str) -> inspect.Signature:
    """The Python signature the binding of `op` has: parameters in schema order, those after `*`
    keyword-only, `Tensor self` named `input` (torchgen's rule for functions), schema defaults."""
    args = re.match(r"\w+\((.*)\) ->", REAL_SCHEMAS[op]).group(1)
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in (p.strip() for p in args.split(", ")):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        decl, _, default = part.partition("=")
        name = decl.split()[-1]
        name = "input" if name == "self" else name
        params.append(inspect.Parameter(name, kind, default=_default(default) if default else inspect.Parameter.empty))
    return inspect.Signature(params)


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
        for name in REAL_SCHEMAS:
            setattr(self, name, self._wrap(name))

    def names(self):
        return [c.name for c in self.calls]

    def _wrap(self, name):
        sig = real_signature(name)
        validate, cpu = getattr(validators, name), getattr(cpu_semantics, name)
        second_reading = getattr(self, "_" + name)

        def op(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # TypeError on a wrong name or positional misuse
            bound.apply_defaults()
            self.calls.append(Call(name, {k: _summary(v) for k, v in bound.arguments.items()}))
            validate(*bound.args, **bound.kwargs)
            second_reading(**bound.arguments)
            out = cpu(*bound.args, **bound.kwargs)
            self._check_output(name, bound.arguments, out)
            return out
        op.__signature__ = sig
        op.__name__ = name
        return op

    # ---------------------------------------------------------------- a second reading of the contracts
    @staticmethod
    def _npu_dynamic_quant(input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max):
        assert input.dtype in F16 and input.ndim > 1, (input.dtype, input.shape)
        assert dst_type in (None, torch.int8, torch.quint4x2)

    _npu_dynamic_quant_asymmetric = _npu_dynamic_quant

    @staticmethod
    def _npu_quantize(input, scales, zero_points, dtype, axis, div_mode):
        assert input.dtype in (torch.float32,) + F16
        if not div_mode:
            assert dtype in (torch.qint8, torch.quint4x2), dtype
            # torch_npu-npu_quantize.md: scales' dtype must be input's (aclnnAscendQuantV3, error 161002)
            assert scales.dtype == input.dtype, f"scales {scales.dtype} with input {input.dtype}"
            assert zero_points is None or (zero_points.shape == scales.shape and zero_points.dtype == scales.dtype)
            assert scales.ndim != 1 or scales.shape[0] in (1, input.shape[-2 if axis == -2 else -1])

    @staticmethod
    def _npu_anti_quant(x, scale, offset, dst_dtype, src_dtype):
        assert x.dtype in (torch.int8, torch.int32)
        assert scale.ndim == 1 and scale.dtype in (torch.float32, torch.bfloat16)
        assert scale.shape[0] in (1, x.shape[-1] * (8 if x.dtype == torch.int32 else 1))
        assert offset is None or (offset.shape == scale.shape and offset.dtype == scale.dtype)
        assert dst_dtype in (None,) + F16

    @staticmethod
    def _npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens,
                                 compress_seq_offsets, seq_lens, cache_mode):
        # aclnnScatterPaKvCache.md: Atlas A2/A3 take FLOAT16, BFLOAT16 and INT8 only
        assert key.dtype in F16 + (torch.int8,), f"scatter of {key.dtype}"
        assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        assert key.ndim == value.ndim == 3 and key_cache.ndim == value_cache.ndim == 4
        assert slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == key.shape[:1]
        assert all(t.is_contiguous() and t.numel() for t in (key, value, key_cache, value_cache, slot_mapping))
        if cache_mode in (None, "Norm"):
            assert key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:]
            total = key_cache.shape[0] * key_cache.shape[1]
        else:
            total = key_cache.shape[0] * key_cache.shape[2]
        assert int(slot_mapping.min()) >= 0 and int(slot_mapping.max()) < total, "slot out of range"
        assert torch.unique(slot_mapping).numel() == slot_mapping.numel(), "repeated slots"

    @staticmethod
    def _npu_fused_infer_attention_score(query, key, value, actual_seq_lengths_kv, block_table, block_size,
                                         key_antiquant_scale, value_antiquant_scale, key_antiquant_offset,
                                         key_antiquant_mode, value_antiquant_mode, num_heads, num_key_value_heads,
                                         input_layout, scale, **_):
        assert query.dtype in F16
        assert key.dtype in (query.dtype, torch.int8, torch.int32) and key.dtype == value.dtype
        assert key.shape == value.shape and all(t.is_contiguous() for t in (query, key, value))
        assert isinstance(actual_seq_lengths_kv, list) and all(type(n) is int for n in actual_seq_lengths_kv), \
            "actual_seq_lengths_kv is a List[int]"
        assert isinstance(scale, float)
        q_s = query.shape[2] if input_layout == "BNSD" else query.shape[1]
        assert q_s == 1, "decode: query S = 1"
        if block_table is not None:
            assert block_table.dtype == torch.int32 and block_table.ndim == 2 and block_table.shape[0] == query.shape[0]
            assert key.dtype != torch.int32, "int4 KV is not paged"
            assert block_size % (32 if key.dtype == torch.int8 else 16) == 0 and 0 < block_size <= 512
        if key.dtype in (torch.int8, torch.int32):
            assert key_antiquant_scale is not None and value_antiquant_scale is not None
            modes = (key_antiquant_mode, value_antiquant_mode)
            assert modes[0] == modes[1] or modes == (0, 1)
            for sc, mode in zip((key_antiquant_scale, value_antiquant_scale), modes):
                assert sc.dtype == (query.dtype if mode in (0, 2) else torch.float32)

    @staticmethod
    def _npu_rotate_quant(x, rotation, **_):
        assert x.dtype in F16 and rotation.dtype == x.dtype and x.ndim == 2

    @staticmethod
    def _check_output(name, a, out):
        if name == "npu_fused_infer_attention_score":
            o, lse = out
            assert o.dtype == a["query"].dtype and o.shape == a["query"].shape
            q = a["query"]
            b, n = q.shape[0], a["num_heads"]
            want = (b, n, 1, 1) if a["softmax_lse_flag"] else (0,)  # FusedInferAttentionScoreKernelNpuOpApi.cpp
            assert lse.dtype == torch.float32 and tuple(lse.shape) == want, tuple(lse.shape)
        elif name == "npu_dynamic_quant_asymmetric":
            y, scale, offset = out
            x, int4 = a["input"], a["dst_type"] is torch.quint4x2
            assert y.shape == x.shape[:-1] + (x.shape[-1] // 8 if int4 else x.shape[-1],)
            assert y.dtype == (torch.int32 if int4 else torch.int8)
            assert scale.dtype == offset.dtype == torch.float32 and scale.shape == offset.shape == x.shape[:-1]


def install(monkeypatch) -> FakeTorchNpu:
    """A FakeTorchNpu installed as sys.modules["torch_npu"] for one test (monkeypatch removes it)."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake
