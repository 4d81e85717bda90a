"""Teacher-forced attention that sees the KV cache exactly as a serving engine would have stored it.

In serving, a token is decoded against a paged cache whose first block (the attention sink) and
whose partially filled last block (the tail) are kept in high precision, while every other full
block has been quantized. Teacher forcing runs all positions in one forward, so each query must be
given its own view of the cache. For a query at position i (block b = i // block_size):

    key block 0 (sink)                      exact
    key blocks 1 .. b-1 (full, not sink)    dequantize(quantize(block)), kvarn_jax's scheme
    key block b (the query's own block)     exact, causal (j <= i)

"Exact" is what the cache's sink and ring give back (`kvarn_jax.cache.hp.served`: the scheme's
`hp` format, by default 16 bits), and quantized blocks are quantized from those values as the cache
holds them, in its storage frame (`cache_reads`). With a sink of S tokens (`_sink{S}`) the rest of
block 0 is a quantized block like the others (its sink positions excluded from its scales,
`hp.exclude_sink`).

This is exactly what `kvarn_jax.write` + `paged_decode_attention` serve: the block completed by the
query's own token is already quantized in its page, but reads take it from the high-precision ring
until the next token. `quantize_own_full_block=True` is an ablation in which the query at a block's
last slot (seq_len = (b+1)*block_size) reads its own, now full, block quantized; the difference is
confined to one position in every block (see the recorded results).

The attention itself is one masked SDPA over [exact K ; quantized K] (T + quantized tokens keys), so a
window costs one quantize/dequantize per layer, not one per query block.

Use with a transformers model:

    with serving_semantics(model, "kvarn_k4v2_g128", block_size=128):
        logits = model(input_ids).logits
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Sequence, Union

import jax.numpy as jnp
import torch
import torch.nn.functional as F

import kvarn_jax as kj
from kvarn_jax.config import KVQuantConfig
from kvarn_jax.integrations.dlpack import bhtd_to_tokens, check_bhtd, roundtrip_bhtd, to_jax, to_torch, tokens_to_bhtd

ATTN_IMPLEMENTATION = "kvarn_serving"
QUERY_CHUNK = 1024

Scheme = Union[str, KVQuantConfig, None]


@dataclasses.dataclass(frozen=True)
class LayerServing:
    """How one attention layer sees the cache during a teacher-forced forward.

    cfg: the layer's scheme, or None for exact attention (the fp32 reference).
    recorder: optional callable(layer_idx, q, k, v) receiving post-RoPE [B, H, T, D] tensors
      (used by the error report to capture real activations).
    """

    cfg: Optional[KVQuantConfig]
    block_size: int = 128
    quantize_own_full_block: bool = False
    recorder: Optional[Callable] = None


def serving_masks(seq_len: int, block_size: int, quantize_own_full_block: bool = False,
                  device: Union[str, torch.device] = "cpu", sink_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact_mask [T, T], quant_mask [T, Q]) booleans, True = the query (row) attends to that key.

    The quantized keys are tokens [start, start + Q) with start = block_size (a whole-block sink,
    sink_tokens 0) or 0 (a sink of sink_tokens tokens, which stay exact), i.e. full blocks up to
    n_full-1; Q = 0 when no such block exists. Every query sees each key exactly once, either exact
    or quantized, and only keys j <= i.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    i = torch.arange(seq_len, device=device)
    start = 0 if sink_tokens else block_size
    n_quant = max(block_size * (seq_len // block_size) - start, 0)
    # A key block jb is read quantized by query i when it is stored in a page (past the sink) and is
    # full as of `limit`: the query's own block start (own block exact) or i + 1 tokens written
    # (kvarn_jax's paged cache).
    limit = i + 1 if quantize_own_full_block else (i // block_size) * block_size
    jq = torch.arange(n_quant, device=device) + start
    quant = ((jq // block_size + 1)[None, :] * block_size <= limit[:, None]) & (jq >= sink_tokens)[None, :]
    j_block = i // block_size
    read_quantized = (i >= max(start, sink_tokens))[None, :] & ((j_block + 1)[None, :] * block_size <= limit[:, None])
    exact = (i[None, :] <= i[:, None]) & ~read_quantized
    return exact, quant


def cache_reads(key: torch.Tensor, value: torch.Tensor, cfg: KVQuantConfig, block_size: int, start: int,
                n_quant: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, k_hat, v_hat) float32 in the model's frame: k, v [B, Hk, T, D] as the cache's sink and
    ring serve every token (`hp.served`), and k_hat, v_hat [B, Hk, n_quant, D] the pages of tokens
    [start, start + n_quant) (whole blocks), quantized as the cache quantizes them (None when
    n_quant is 0): `ring_values`, then `page_reads`."""
    k, v, k_ring, v_ring = ring_values(key, value, cfg)
    if not n_quant:
        return k, v, None, None
    dtype = str(key.dtype).split(".")[-1]
    k_hat, v_hat = page_reads(k_ring[:, :, start:start + n_quant], v_ring[:, :, start:start + n_quant], cfg,
                              block_size, start, dtype)
    return k, v, k_hat, v_hat


def ring_values(key: torch.Tensor, value: torch.Tensor, cfg: KVQuantConfig
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, k_ring, v_ring) for tokens key, value [B, Hk, T, D] of a model's dtype: k, v as the
    cache's sink and ring serve them (float32, the model's frame) and k_ring, v_ring what a page of
    their block is quantized from: the values the ring holds (`hp.held`, float32 in the storage
    frame), or for passthrough schemes, which keep none, key and value themselves.

    The cache quantizes a block from the values its ring holds, in the storage frame (rotated for
    KVarN). So does `page_reads`: rotating served values back and again first changes them by
    float32 rounding, and a quantizer's discrete choices (a code, a clip candidate) are not
    continuous in its input; near a tie such noise changes a whole row of a page and every later
    output that reads it."""
    from kvarn_jax.cache import hp
    from kvarn_jax.hadamard import unrotate

    if cfg.is_passthrough:  # nothing in high precision: a token is read as computed until its page is
        return key.float(), value.float(), key, value
    b = key.shape[0]
    dtype = str(key.dtype).split(".")[-1]
    held = hp.held(cfg, to_jax(bhtd_to_tokens(key)), to_jax(bhtd_to_tokens(value)), dtype)  # [T, B*Hk, D]
    served = [unrotate(x, jnp.float32) if cfg.rotated else x for x in held]
    k, v = (tokens_to_bhtd(to_torch(x), b) for x in served)
    k_ring, v_ring = (tokens_to_bhtd(to_torch(x), b) for x in held)
    return k, v, k_ring, v_ring


def page_reads(k_ring: torch.Tensor, v_ring: torch.Tensor, cfg: KVQuantConfig, block_size: int,
               first_position: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_hat, v_hat) float32 [B, Hk, T, D] in the model's frame: the pages of whole blocks whose
    tokens, from position `first_position` of their sequences on, the ring holds as k_ring, v_ring
    [B, Hk, T, D] (`ring_values`) in a `dtype` cache. A page of a sequence's first block leaves a
    shorter sink out of its scales (`hp.exclude_sink`)."""
    from kvarn_jax.cache import hp

    if cfg.is_passthrough:
        k_hat, v_hat = roundtrip_bhtd(k_ring.contiguous(), v_ring.contiguous(), cfg)
        return k_hat.float(), v_hat.float()
    b = k_ring.shape[0]
    blocks = []
    for x in (k_ring, v_ring):   # [T, B*Hk, D] -> [blocks, B*Hk, block_size, D], the layout exclude_sink takes
        x = to_jax(bhtd_to_tokens(x))
        t, bh, d = x.shape
        blk = x.reshape(t // block_size, block_size, bh, d).transpose(0, 2, 1, 3)
        blk = hp.exclude_sink(cfg, blk, first_position + block_size * jnp.arange(t // block_size))
        # the page input is in the cache's dtype (`paged._page_input`)
        blocks.append(blk.transpose(0, 2, 1, 3).reshape(t, bh, d).astype(dtype))
    k_hat, v_hat = kj.dequantize(kj.quantize(tuple(blocks), cfg, rotated=True))
    return tokens_to_bhtd(to_torch(k_hat), b).float(), tokens_to_bhtd(to_torch(v_hat), b).float()


def serving_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cfg: Scheme, *,
                      block_size: int = 128, scaling: Optional[float] = None,
                      quantize_own_full_block: bool = False,
                      attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of a whole window with serving semantics (module docstring).

    query [B, Hq, T, D], key/value [B, Hk, T, D] (post-RoPE, positions 0..T-1 of each sequence; Hq a
    multiple of Hk); cfg: scheme (string or KVQuantConfig) or None for exact attention;
    attention_mask: optional boolean [B, 1, T, T] (True = attend; e.g. padding) ANDed in.
    Returns [B, Hq, T, D] in query's dtype; softmax in fp32.
    """
    check_bhtd(query, "query")
    check_bhtd(key, "key")
    check_bhtd(value, "value")
    b, hq, t, d = query.shape
    if key.shape != value.shape or key.shape[0] != b or key.shape[2] != t or key.shape[3] != d:
        raise ValueError(f"key/value must be [B, Hk, T, D] matching query {tuple(query.shape)}, got key "
                         f"{tuple(key.shape)} and value {tuple(value.shape)} (teacher forcing: no past cache)")
    if hq % key.shape[1]:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {key.shape[1]}")
    cfg = kj.parse(cfg) if cfg is not None else None
    if cfg is not None:
        cfg.check_head_dim(d, "head_dim (query.shape[3])")
        cfg.check_block_size(block_size)
    scaling = d ** -0.5 if scaling is None else scaling

    sink = cfg.sink_tokens if cfg is not None else 0
    exact_mask, quant_mask = serving_masks(t, block_size, quantize_own_full_block, query.device, sink)
    keys, values, mask = key, value, exact_mask
    n_quant = quant_mask.shape[1]
    start = 0 if sink else block_size   # the first quantized key position (as `serving_masks`)
    if cfg is not None:
        keys, values, k_hat, v_hat = cache_reads(key, value, cfg, block_size, start, n_quant)
        if n_quant:
            keys, values = torch.cat([keys, k_hat], dim=2), torch.cat([values, v_hat], dim=2)
            mask = torch.cat([exact_mask, quant_mask], dim=1)
    else:
        mask = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()  # exact reference: causal
    mask = mask[None, None]
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool or attention_mask.shape[-2:] != (t, t):
            raise ValueError(f"attention_mask must be a boolean [B, 1, T, T] mask, got {attention_mask.dtype} "
                             f"{tuple(attention_mask.shape)}")
        extra = attention_mask
        if keys.shape[2] > t:
            extra = torch.cat([attention_mask, attention_mask[..., start:start + n_quant]], dim=-1)
        mask = mask & extra
    # Queries in chunks: the scores of one chunk are [B, Hq, QUERY_CHUNK, keys], so an 8K-token
    # window needs ~0.6 GB per chunk instead of ~5 GB for all queries at once.
    q, keys, values = query.float(), keys.float(), values.float()
    out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:a + QUERY_CHUNK], keys, values,
                                                     attn_mask=mask[..., a:a + QUERY_CHUNK, :], scale=scaling,
                                                     enable_gqa=hq != key.shape[1])
                     for a in range(0, t, QUERY_CHUNK)], dim=2)
    return out.to(query.dtype)


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as attn_implementation="kvarn_serving" (transformers AttentionInterface)."""
    spec = getattr(module, "kvarn_serving", None)
    if not isinstance(spec, LayerServing):
        raise ValueError("attn_implementation='kvarn_serving' needs the model to be wrapped in "
                         "kvarn_jax.evaluation.serving_attention.serving_semantics(model, scheme)")
    if module.training and dropout:
        raise ValueError("serving-semantics attention is for evaluation: call model.eval() first")
    if spec.recorder is not None:
        spec.recorder(module.layer_idx, query, key, value)
    out = serving_attention(query, key, value, spec.cfg, block_size=spec.block_size, scaling=scaling,
                            quantize_own_full_block=spec.quantize_own_full_block, attention_mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_forward)
    # Boolean 4D masks (or None when purely causal), so padding reaches the function.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def attention_modules(model) -> list:
    """The model's attention modules, ordered by `layer_idx` (one per decoder layer)."""
    mods = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and hasattr(m, "k_proj") and hasattr(m, "v_proj"):
            mods[idx] = m
    if not mods or sorted(mods) != list(range(len(mods))):
        raise ValueError("model has no attention modules with k_proj/v_proj and consecutive layer_idx "
                         "(a Llama/Qwen2-family decoder is needed)")
    return [mods[i] for i in range(len(mods))]


def per_layer_schemes(schemes: Union[Scheme, Sequence[Scheme]], num_layers: int) -> list[Optional[KVQuantConfig]]:
    """One scheme (or None) for every layer, from a single scheme or a per-layer list."""
    if schemes is None or isinstance(schemes, (str, KVQuantConfig)):
        schemes = [schemes] * num_layers
    schemes = list(schemes)
    if len(schemes) != num_layers:
        raise ValueError(f"schemes has {len(schemes)} entries but the model has {num_layers} layers")
    return [kj.parse(s) if s is not None else None for s in schemes]


@contextlib.contextmanager
def serving_semantics(model, schemes: Union[Scheme, Sequence[Scheme]], *, block_size: int = 128,
                      quantize_own_full_block: bool = False, recorder: Optional[Callable] = None):
    """Within the block, `model(...)` attends with serving semantics under `schemes`.

    schemes: one scheme for all layers, a per-layer list (e.g. from `layer_config.load_layer_config`), or None
    (exact attention through the same code path). The model must run without a cache (teacher forcing:
    pass use_cache=False). The previous attention implementation is restored on exit.
    """
    mods = attention_modules(model)
    cfgs = per_layer_schemes(schemes, len(mods))
    head_dim = mods[0].head_dim
    for i, cfg in enumerate(cfgs):
        if cfg is not None:
            cfg.check_head_dim(head_dim, f"head_dim of layer {i}")
            cfg.check_block_size(block_size)
            if cfg.static:
                raise ValueError(f"layer {i}: scheme {cfg.name} needs a calibration; use a dynamic scheme")
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        for m, cfg in zip(mods, cfgs):
            m.kvarn_serving = LayerServing(cfg, block_size, quantize_own_full_block, recorder)
        yield model
    finally:
        for m in mods:
            if hasattr(m, "kvarn_serving"):
                del m.kvarn_serving
        model.set_attn_implementation(previous)
