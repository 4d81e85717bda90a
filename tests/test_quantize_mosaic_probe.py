"""The Mosaic GPU Sinkhorn probe (`benchmarks/quantize_mosaic_probe.py`, the groundwork for a quantize
kernel with explicit register layouts) stays runnable: its arithmetic matches
`kvarn.sinkhorn_log_scales` in the GPU interpreter, and its layouts lower for CUDA on any machine."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvarn_jax.schemes import kvarn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import quantize_mosaic_probe as probe  # noqa: E402


@pytest.mark.parametrize("variant", probe.VARIANTS)
def test_probe_matches_the_reference_sinkhorn_interpreted(variant):
    x = probe.tiles(4, seed=3)
    lc, lr = jax.jit(probe.build(4, 8, interpret=True, variant=variant))(x)
    rlc, rlr = kvarn.sinkhorn_log_scales(x, 8)
    # same operations in the same order; exp2(log2/2) for the imbalance's square roots
    np.testing.assert_allclose(np.asarray(lc), np.asarray(rlc), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lr), np.asarray(rlr), rtol=0, atol=1e-5)
    assert float(jnp.abs(rlc).max()) > 0.1 and float(jnp.abs(rlr).max()) > 0.1  # the scales moved


@pytest.mark.parametrize("variant", probe.VARIANTS)
def test_probe_lowers_for_cuda(variant):
    f = probe.build(2, 8, interpret=False, variant=variant)
    low = jax.jit(f).trace(jax.ShapeDtypeStruct((2, probe.R, probe.C), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in low.as_text()
