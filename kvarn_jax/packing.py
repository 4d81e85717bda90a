"""Bit packing of integer codes into bytes (docs/design.md §1.5).

`8 // bits` codes share a byte; element j of each group sits at bit shift `j * bits` (element 0 in
the low bits). Packing is along the last axis, whose length must be a multiple of `8 // bits`.
"""

from __future__ import annotations

import jax.numpy as jnp


def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """[..., n] integer codes in [0, 2**bits) -> [..., n * bits // 8] uint8."""
    if bits == 8:
        return codes.astype(jnp.uint8)
    per = 8 // bits
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"cannot pack {n} {bits}-bit codes into whole bytes ({per} per byte)")
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], n // per, per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)
    # Codes occupy disjoint bit ranges, so the sum equals the bitwise or.
    return jnp.sum(jnp.left_shift(c, shifts), axis=-1, dtype=jnp.uint8)


def unpack(packed: jnp.ndarray, bits: int) -> jnp.ndarray:
    """[..., m] uint8 -> [..., m * 8 // bits] uint8 codes."""
    if bits == 8:
        return packed.astype(jnp.uint8)
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)
    mask = jnp.uint8((1 << bits) - 1)
    c = jnp.bitwise_and(jnp.right_shift(packed[..., None], shifts), mask)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def store_tiled(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """A tiled scheme's codes [..., R, C] (packed along C, as the KVarN reference packs them) ->
    the stored field [..., C * bits // 8, R]: the packed bytes with the two axes swapped.

    For keys (R = channels, C = tokens) and values (R = tokens, C = channels) this puts the axis the
    decode kernel contracts over (channels for q.K, tokens for p.V) contiguous in memory, so the
    kernel loads 4 contraction-consecutive bytes per register instead of single bytes, and the
    reference's record layout is one `swapaxes` away (`load_tiled`).
    """
    return jnp.swapaxes(pack(codes, bits), -1, -2)


def code_planes(field: jnp.ndarray, bits: int) -> jnp.ndarray:
    """A `store_tiled` field [..., C * bits // 8, R] -> its codes as planes [..., 8 // bits, C * bits // 8, R]
    (uint8): code c of row r is at [..., c % (8 // bits), c // (8 // bits), r]. A product over C can then
    contract each plane with the stored bytes in place instead of interleaving the codes back first."""
    per = 8 // bits
    if per == 1:
        return field[..., None, :, :]
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None, None]
    # a broadcast of the bytes against the shifts, not a stack of slices: XLA's CPU code fuses it
    return (field[..., None, :, :] >> shifts) & jnp.uint8((1 << bits) - 1)


def load_tiled(field: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Inverse of `store_tiled`: the stored field -> codes [..., R, C]."""
    return unpack(jnp.swapaxes(field, -1, -2), bits)
