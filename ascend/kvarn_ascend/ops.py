"""The op table: for each torch_npu op kvarn_ascend uses, its NPU call, its CPU semantics, its
validator and the documentation they follow; `call` validates, then runs one of the two.

    out = ops.call("npu_dynamic_quant", x, dst_type=torch.int8, backend="auto")

backend "npu" calls `torch_npu.<name>` (tensors on the NPU), "cpu" the CPU function of the same
signature, "auto" the NPU when one is usable. Tolerances (`TOLERANCE`, `max_violation`) are those the
Ascend op tests compare an NPU result with its CPU golden: |got - ref| <= max(|ref|, 1) * tol(dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from . import cpu_semantics, npu, validators

# The contracts each op's validator encodes (tags of validators.SOURCES).
_CONTRACTS = {
    "npu_dynamic_quant": ("aclnnDynamicQuantV2.md", "DynamicQuantKernelNpuOpApi.cpp"),
    "npu_dynamic_quant_asymmetric": ("aclnnDynamicQuantV2.md", "DynamicQuantKernelNpuOpApi.cpp"),
    "npu_quantize": ("aclnnAscendQuantV3.md", "aclnn_ascend_quant_v3.cpp", "QuantizeKernelNpuOpApi.cpp"),
    "npu_anti_quant": ("aclnnAscendAntiQuant.md", "AntiQuantKernelNpuOpApi.cpp"),
    "npu_scatter_pa_kv_cache": ("aclnnScatterPaKvCache.md",),
    "npu_fused_infer_attention_score": ("FIA docs/context", "FusedInferAttentionScoreKernelNpuOpApi.cpp"),
    "npu_rotate_quant": (),
}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One entry of the op table. `name` is the torch_npu attribute (and the CPU function's name);
    `sources` the tags (validators.SOURCES) of the documents and files its validator follows."""

    name: str
    sources: tuple
    cpu: Callable
    validate: Callable
    notes: str = ""

    def npu_call(self) -> Callable:
        mod = npu.torch_npu_module()
        if mod is None:
            raise ValueError(f"{self.name}: {npu.unavailable_reason()}")
        return getattr(mod, self.name)


def _spec(name: str, notes: str = "") -> OpSpec:
    sources = ("op_plugin_functions.yaml", f"torch_npu-{name}.md") + _CONTRACTS[name]
    return OpSpec(name, sources, getattr(cpu_semantics, name), getattr(validators, name), notes)


OPS = {s.name: s for s in (
    _spec("npu_dynamic_quant", "symmetric per-token int8/int4; scale = rowmax|x| / 127 (or 7), float32"),
    _spec("npu_dynamic_quant_asymmetric", "asymmetric per-token; y = round(x/scale + offset), x = (y - offset)*scale"),
    _spec("npu_quantize", "given per-channel scales/zero points (div_mode=False: round(x*scales + zero_points), "
                          "scales and zero points of the input's dtype)"),
    _spec("npu_anti_quant", "(x + offset) * scale, 1-D scale along the last axis"),
    _spec("npu_scatter_pa_kv_cache", "paged write by slot (in place); cache_mode 'Norm' = ND [blocks, bs, N, D]; "
                                     "float16/bfloat16/int8 on Atlas A2/A3 (int4 codes go as int8 bytes)"),
    _spec("npu_fused_infer_attention_score", "decode branch: paged or contiguous KV, fp or int8/int4 antiquant"),
    _spec("npu_rotate_quant", "block rotation x @ R then per-token symmetric quant (not used by the cache: "
                              "KVarN needs Sinkhorn and asymmetric per-channel keys after the rotation)"),
)}


def call(name: str, *args, backend: str = "auto", **kwargs):
    """Validate the arguments against the documented constraints, then run the NPU op or its CPU semantics."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; the op table has {sorted(OPS)}")
    spec = OPS[name]
    spec.validate(*args, **kwargs)
    if npu.resolve_backend(backend) == "npu":
        return spec.npu_call()(*args, **kwargs)
    return spec.cpu(*args, **kwargs)


# ------------------------------------------------------------------------------------------ tolerances
TOLERANCE = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -13}


def max_violation(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """max(|got - ref| / (max(|ref|, 1) * tol(dtype))); <= 1 means within the Ascend op-test tolerance."""
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {list(TOLERANCE)}, got {dtype}")
    g, r = got.double(), ref.double()
    if g.shape != r.shape:
        raise ValueError(f"got {tuple(g.shape)} and ref {tuple(r.shape)} differ in shape")
    if g.numel() == 0:
        return 0.0
    return float(((g - r).abs() / (r.abs().clamp(min=1.0) * TOLERANCE[dtype])).max())
