import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvarn_jax.packing import pack, unpack


def test_bit_order_element0_in_low_bits():
    # 2-bit codes [1, 2, 3, 0] -> 1 | 2<<2 | 3<<4 | 0<<6 = 0b00111001
    assert int(pack(jnp.array([1, 2, 3, 0], jnp.uint8), 2)[0]) == 0b00111001
    # 4-bit codes [0xA, 0x5] -> 0x5A
    assert int(pack(jnp.array([0xA, 0x5], jnp.uint8), 4)[0]) == 0x5A


@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 4), groups=st.integers(1, 16))
def test_round_trip(bits, rows, groups):
    n = groups * (8 // bits)
    codes = np.random.default_rng(rows * 100 + groups).integers(0, 2 ** bits, (rows, n)).astype(np.uint8)
    packed = pack(jnp.asarray(codes), bits)
    assert packed.shape == (rows, n * bits // 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits)), codes)


def test_pack_refuses_partial_bytes():
    with pytest.raises(ValueError, match="whole bytes"):
        pack(jnp.zeros((3,), jnp.uint8), 2)
