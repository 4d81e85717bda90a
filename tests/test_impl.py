"""One rule for `impl="auto"` (`kvarn_jax.impl.resolve_impl`): which implementation decode attention
and the write path run on each platform, and that every entry point follows it."""

import jax
import pytest

import kvarn_jax as kj
from kvarn_jax.attention.paged_decode import decode_impl
from kvarn_jax.cache import paged
from kvarn_jax.cache.quantize_pallas import supports as quantize_supports
from kvarn_jax.impl import resolve_impl

SCHEMES = ["kvarn_k4v2_g128", "kvarn_k4v4_g64", "kivi_k2v2_g32", "int8", "int4_g32", "int8_static", "fp8",
           "fp8_static", "fp16"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_auto_runs_the_platforms_kernel(scheme):
    cfg = kj.parse(scheme)
    # on CPUs KVarN caches run the C++ kernel (tests/test_paged_decode_cpu.py), the others the reference
    on_cpu = "native" if cfg.method == "kvarn" else "reference"
    assert decode_impl(cfg, 128, 128, backend="cpu")[:2] == (on_cpu, "gpu")
    assert decode_impl(cfg, 128, 128, backend="gpu")[:2] == ("pallas", "gpu")
    assert decode_impl(cfg, 128, 128, backend="tpu")[:2] == ("pallas", "tpu")   # the TPU kernel, not the reference
    # a cache the kernel cannot take: the reference, and the reason is there for impl="pallas" to raise with
    impl, _, why = decode_impl(cfg, 128, 96, backend="gpu")
    assert impl == "reference" and "head_dim=96" in why
    assert decode_impl(cfg, 128, 128, "reference", backend="gpu")[0] == "reference"
    assert decode_impl(cfg, 128, 128, "pallas", backend="cpu")[0] == "pallas"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_write_auto_is_the_write_paths_rule(scheme, backend, monkeypatch):
    """The rule, and what `write(impl="auto")` does (`paged.auto_quantizer`), agree on every scheme and
    platform: the quantize kernel on GPUs for KVarN and fp8 only."""
    cfg = kj.parse(scheme)
    k = jax.numpy.ones((128, 1, 128))
    cal = kj.calibrate([(k, k)], cfg) if cfg.static else None
    cache = kj.PagedKVCache.create(cfg, num_blocks=2, block_size=128, num_kv_heads=1, head_dim=128, max_seqs=1,
                                   calibration=cal)
    want = "pallas" if backend == "gpu" and cfg.method in ("kvarn", "fp8") else "reference"
    assert resolve_impl("auto", "write", cfg, quantize_supports(cfg, 128, 128), backend) == want
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert paged.auto_quantizer(cache) == want


def test_bad_arguments_name_themselves():
    cfg = kj.parse("int8")
    with pytest.raises(ValueError, match="impl must be one of \\['auto', 'pallas', 'native', 'reference'\\], got 'triton'"):
        resolve_impl("triton", "decode", cfg, None)
    with pytest.raises(ValueError, match="op must be one of"):
        resolve_impl("auto", "prefill", cfg, None)
    with pytest.raises(ValueError, match="kernel must be one of"):
        decode_impl(cfg, 128, 128, kernel="cuda")
