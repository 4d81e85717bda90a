"""Every scheme's GPU kernels (paged decode, quantize-on-write) lower to Triton for CUDA here, on CPU.

Interpret mode runs a kernel's jnp on the CPU, so it accepts operations that jax's Triton lowering
does not implement (a slice of a loaded block was one: `int_k8v4_static`'s decode kernel passed
every interpreted test and failed to lower on the H200). Lowering for an abstract CUDA platform is
the check that needs no GPU: a kernel that cannot lower raises here.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import kvarn_jax as kj
from kvarn_jax.attention import paged_decode_pallas as pdp
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas
from helpers import lower_for_cuda

SCHEMES = ["kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k2v8_g64", "kvarn_k8v8_g32", "kivi_k2v2_g128",
           "kivi_k2v4_g32", "kivi_k4v4_g32", "int8", "int4", "int2_g32", "int8_g16", "int_k8v2", "int_k8v4",
           "fp8", "fp16", "bf16", "int8_static", "int_k8v4_static", "int4_static", "fp8_static",
           "kvarn_k4v2_g128_clip", "int2_g32_clip",
           "kvarn_k4v2_g128_hpint8_sink16", "int8_hpint8_sink4", "kivi_k2v2_g32_sink16", "kvarn_k4v2_g128_clip_hpint8"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpu_kernels_lower_for_cuda(scheme):
    cfg = kj.parse(scheme)
    bs = max(cfg.tile_tokens, 32)
    for d, window in ((64, 37), (128, None)):  # both head sizes, with and without a window
        cal = None
        if cfg.static:
            k = jnp.asarray(np.random.default_rng(0).standard_normal((256, 2, d)), jnp.float32)
            cal = kj.calibrate((k, k), scheme)
        cache = kj.PagedKVCache.create(scheme, num_blocks=8, block_size=bs, num_kv_heads=2, head_dim=d, max_seqs=2,
                                       calibration=cal)
        args = (jnp.zeros((2, 8, d), jnp.float32), cache, jnp.zeros((2, 4), jnp.int32),
                jnp.full((2,), 3 * bs + 1, jnp.int32), jnp.arange(2, dtype=jnp.int32))
        fn = lambda q, c, t, l, s, w=window: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1, window=w)  # noqa: E731
        text = lower_for_cuda(fn, *args)
        assert f"kvarn_paged_decode_{cfg.name}" in text
        if d == 128:  # the default above is one split, finished in the kernel; two leave partials
            fn = lambda q, c, t, l, s: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1, window=None,  # noqa: E731
                                                               launch=pdp.Launch(num_splits=2))
            assert f"kvarn_paged_decode_{cfg.name}" in lower_for_cuda(fn, *args)
        if cfg.method in ("int", "fp8") and not pdp.tokens_major_unsupported(cfg, d):
            # the per-token schemes' optional tokens-major products
            fn = lambda q, c, t, l, s, w=window: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1,  # noqa: E731
                                                                         window=w, launch=pdp.Launch(orient="tokens"))
            assert f"kvarn_paged_decode_{cfg.name}" in lower_for_cuda(fn, *args)
        for side in ("k", "v"):
            static = cache.static[side] if cfg.static else None
            fn = lambda x, side=side, static=static: quantize_blocks_pallas(x, static, cfg=cfg, side=side)  # noqa: E731
            text = lower_for_cuda(fn, jnp.zeros((4, 2, bs, d), jnp.float16))
            assert f"kvarn_quantize_{cfg.name}_{side}" in text


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g128", "kivi_k2v4_g32", "int8", "int4_static", "fp8",
                                    "kvarn_k4v2_g128_clip", "int4_clip"])
def test_quantize_kernel_inline_asm(scheme, monkeypatch):
    """The quantize kernels' PTX (`schemes.arith`): lg2.approx for KVarN, IEEE division (div.rn) for
    the other schemes, and only on blocks - Triton rejects inline asm on scalars when it parses the
    module (the first `div.rn` build did that for KVarN's imbalance ratio on the H200), which jax's
    lowering alone does not catch."""
    from jax._src.pallas.triton import lowering
    modules, original = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = original(*a, **k)
        modules.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    cfg = kj.parse(scheme)
    static = None
    if cfg.static:
        k = jnp.asarray(np.random.default_rng(0).standard_normal((256, 2, 64)), jnp.float32)
        static = kj.PagedKVCache.create(scheme, num_blocks=2, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=1,
                                        calibration=kj.calibrate((k, k), scheme)).static["k"]
    bs = max(cfg.tile_tokens, 32)
    for side in ("k", "v"):
        lower_for_cuda(lambda x, side=side: quantize_blocks_pallas(x, static, cfg=cfg, side=side),
                       jnp.zeros((2, 2, bs, 64), jnp.float16))
    assert len(modules) == 2
    for ir in modules:
        asm = [line for line in ir.splitlines() if "tt.elementwise_inline_asm" in line]
        assert all("tensor<" in line.split(":")[-1] for line in asm), [line for line in asm if "tensor<" not in line]
        assert any("lg2.approx.f32" in line for line in asm) == (cfg.method == "kvarn")
        assert any("div.rn.f32" in line for line in asm) == (cfg.method != "kvarn")


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g128", "kivi_k2v2_g128", "int8", "int4", "fp8", "bf16"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_wide_cache_decode_lowers_for_cuda(scheme, dtype):
    """bf16/fp32 caches take the wide products (operands narrowed to fp16 by a power of two, once per
    operand: `layout.Narrowed`): that path lowers too, for the default launch and tokens/heads-major."""
    cfg = kj.parse(scheme)
    bs = max(cfg.tile_tokens, 32)
    cache = kj.PagedKVCache.create(scheme, num_blocks=8, block_size=bs, num_kv_heads=2, head_dim=128, max_seqs=2,
                                   dtype=dtype)
    args = (jnp.zeros((2, 8, 128), jnp.float32), cache, jnp.zeros((2, 4), jnp.int32),
            jnp.full((2,), 3 * bs + 1, jnp.int32), jnp.arange(2, dtype=jnp.int32))
    for launch in (pdp.Launch(), pdp.Launch(num_splits=2, orient="heads", narrow="bound"), pdp.Launch(sums="mma", narrow="bound")):
        if launch.sums and cfg.method not in ("kvarn", "kivi"):
            continue
        fn = lambda q, c, t, l, s, launch=launch: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1,  # noqa: E731
                                                                          window=None, launch=launch)
        assert f"kvarn_paged_decode_{cfg.name}" in lower_for_cuda(fn, *args)
