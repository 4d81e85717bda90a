"""PyTorch <-> kvarn_jax through DLPack, in the [batch, heads, tokens, head_dim] layout PyTorch models use.

`jax.dlpack.from_dlpack(tensor)` and `torch.from_dlpack(array)` share memory (measured zero-copy on CPU
here and on the H200 both ways, docs/design.md §5). kvarn_jax wants [tokens, kv_heads, head_dim] with
consecutive tokens of a block in one tile, so [B, H, T, D] is permuted to [T, B*H, D] in torch first:
that permute is the one copy on the way in (folding the batch into the head axis is exact, because a
tile is always one head of one sequence). The dequantized result comes back to torch without a copy and
is permuted back as a view.
"""

from __future__ import annotations

import jax
import torch

import kvarn_jax as kj

_TORCH_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def to_jax(t: torch.Tensor) -> jax.Array:
    """A jax array sharing `t`'s memory (t must be contiguous; CPU or CUDA)."""
    if not t.is_contiguous():
        raise ValueError("to_jax needs a contiguous tensor (call .contiguous() first: that is a copy)")
    return jax.dlpack.from_dlpack(t.detach())


def to_torch(a: jax.Array) -> torch.Tensor:
    """A torch tensor sharing `a`'s memory."""
    return torch.from_dlpack(a)


def check_bhtd(x, name: str) -> None:
    """Raise ValueError naming `name` unless x is a floating torch tensor [batch, heads, tokens, head_dim]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in _TORCH_FLOATS:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def bhtd_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> contiguous [T, B*H, D] (one copy)."""
    b, h, t, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(t, b * h, d).contiguous()


def tokens_to_bhtd(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[T, B*H, D] -> [B, H, T, D] (a view)."""
    t, bh, d = x.shape
    return x.reshape(t, batch, bh // batch, d).permute(1, 2, 0, 3)


def quantize_bhtd(k: torch.Tensor, v: torch.Tensor, cfg) -> kj.QuantizedKV:
    """Quantize K/V given as [B, H, T, D] torch tensors (T a whole number of the scheme's tiles).

    The result's heads axis is B*H (batch-major). Raises ValueError for schemes needing a calibration.
    """
    cfg = kj.parse(cfg)
    if cfg.static:
        raise ValueError(f"scheme {cfg.name} needs per-head static scales from a Calibration; use a dynamic "
                         "scheme (e.g. int8, fp8, kvarn_k4v2_g128) here")
    check_bhtd(k, "k")
    check_bhtd(v, "v")
    return kj.quantize((to_jax(bhtd_to_tokens(k)), to_jax(bhtd_to_tokens(v))), cfg)


def dequantize_bhtd(q: kj.QuantizedKV, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `quantize_bhtd`: ([B, H, T, D], [B, H, T, D]) torch views of the dequantized jax arrays."""
    k_hat, v_hat = kj.dequantize(q)
    return tokens_to_bhtd(to_torch(k_hat), batch), tokens_to_bhtd(to_torch(v_hat), batch)


def roundtrip_bhtd(k: torch.Tensor, v: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache would return for these tokens once stored: dequantize(quantize(k, v))."""
    return dequantize_bhtd(quantize_bhtd(k, v, cfg), k.shape[0])


def served_bhtd(key: torch.Tensor, value: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, T, D] keys and values as a paged cache of their dtype keeps them in its high-precision
    sink and ring (`kvarn_jax.cache.hp.served`: the scheme's `_hp` format, by default 16 bits), in
    their dtype and the model's frame."""
    from kvarn_jax.cache import hp

    cfg = kj.parse(cfg)
    dtype = str(key.dtype).split(".")[-1]
    k, v = hp.served(cfg, to_jax(bhtd_to_tokens(key)), to_jax(bhtd_to_tokens(value)), dtype)
    return (tokens_to_bhtd(to_torch(k), key.shape[0]).to(key.dtype),
            tokens_to_bhtd(to_torch(v), key.shape[0]).to(value.dtype))
