"""KIVI layout: keys per channel over a tile of G tokens, values per token in groups of channels.

Keys' outlier channels get their own scale (the reason KIVI quantizes keys per channel); values
are quantized per token in groups of min(G, D) channels, as in the KIVI paper. Codes are stored
like KVarN's (`packing.store_tiled`): K [G*b/8, D], V [D*b/8, G].
"""

from __future__ import annotations

import jax.numpy as jnp

from ..packing import load_tiled, store_tiled
from .arith import JNP, Arith
from .rtn import rtn_dequant, rtn_stored


def fields(side: str, bits: int, group: int, head_dim: int, meta=jnp.float16):
    g, d = group, head_dim
    if side == "k":
        return {"codes": ((g * bits // 8, d), jnp.uint8), "scale": ((d,), meta), "zero": ((d,), meta)}
    cg = min(g, d)
    return {"codes": ((d * bits // 8, g), jnp.uint8), "scale": ((g, d // cg), meta), "zero": ((g, d // cg), meta)}


def quantize(x: jnp.ndarray, side: str, bits: int, group: int, ar: Arith = JNP, meta=jnp.float16,
             clip=None) -> dict:
    """x: tiles [..., G, D] -> fields (scales and zeros in `meta`; clip: None or the `rtn.clip_search`
    ratios)."""
    t = x.astype(jnp.float32)
    if side == "k":
        codes, scale, zero = rtn_stored(jnp.swapaxes(t, -1, -2), bits, meta, ar, clip)  # rows = channels
        return {"codes": store_tiled(codes, bits), "scale": scale, "zero": zero}
    d = t.shape[-1]
    cg = min(group, d)
    rows = t.reshape(*t.shape[:-1], d // cg, cg)
    codes, scale, zero = rtn_stored(rows, bits, meta, ar, clip)
    return {"codes": store_tiled(codes.reshape(t.shape), bits), "scale": scale, "zero": zero}


def dequantize(f: dict, side: str, bits: int, group: int) -> jnp.ndarray:
    c = load_tiled(f["codes"], bits)
    if side == "k":
        return jnp.swapaxes(rtn_dequant(c, f["scale"], f["zero"]), -1, -2)
    d = c.shape[-1]
    cg = min(group, d)
    rows = c.reshape(*c.shape[:-1], d // cg, cg)
    return rtn_dequant(rows, f["scale"], f["zero"]).reshape(c.shape)
