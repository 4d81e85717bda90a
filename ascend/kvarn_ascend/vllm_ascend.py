"""The torch-level API a vllm-ascend attention implementation calls to store and decode with a
kvarn_jax scheme on the NPU.

Why an API and not a registered backend: vllm-ascend's `NPUPlatform.get_attn_backend_cls` returns
hard-coded class paths and ignores `--attention-backend`, so vLLM's backend registry cannot select an
out-of-tree backend on the NPU. vllm-ascend's own hook for KV-cache quantization is its scheme
registry (`vllm_ascend.quantization.methods.registry.register_scheme(quant_type, "attention")`; the
C8 method swaps the layer's `impl.__class__` in `create_weights`), which it consults only for layers
a ModelSlim quantization description marks (`fa_quant_type` plus per-layer `fa_k.scale` entries).
An integration without a fork is therefore: register a scheme class under a new quant type whose
`create_weights` swaps the impl for a subclass of `AscendAttentionBackendImpl` whose `forward`
calls `KVarNAscendAttention.forward` below. That glue needs vllm-ascend to run and is not built
here; everything it would call is.
"""

from __future__ import annotations

import math

import torch

from .cache import AscendPagedKVCache


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Position of every scheduled token. vLLM's convention: seq_lens[r] counts request r's tokens
    including this step's q_r = query_start_loc[r+1] - query_start_loc[r], so they sit at positions
    seq_lens[r] - q_r ... seq_lens[r] - 1."""
    qsl, lens = query_start_loc.long(), seq_lens.long()
    if qsl.ndim != 1 or lens.ndim != 1 or qsl.shape[0] != lens.shape[0] + 1:
        raise ValueError(f"query_start_loc must have len(seq_lens) + 1 = {lens.shape[0] + 1} entries, "
                         f"got {tuple(qsl.shape)}")
    q = qsl[1:] - qsl[:-1]
    if bool((q < 0).any()) or bool((q > lens).any()):
        raise ValueError("query_start_loc must be non-decreasing with at most seq_lens[r] tokens per request")
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), q)
    return lens[req] - q[req] + (torch.arange(req.shape[0], device=lens.device) - qsl[:-1][req])


class KVarNAscendAttention:
    """One attention layer's quantized KV cache and its forward for decode steps.

    `forward` stores the step's key/value (quantize-on-write) and returns decode attention for every
    request; `cache.dense_kv` gives the dequantized K/V a prefill with cached context needs (vllm-ascend
    runs prefill attention itself, on the float K/V of the chunk, as its C8 path does).
    """

    def __init__(self, scheme, *, num_heads: int, num_kv_heads: int, head_size: int, num_blocks: int,
                 block_size: int, max_seqs: int, dtype=torch.bfloat16, scale: float | None = None,
                 calibration=None, tail_blocks: int = 1, backend: str = "auto", device=None):
        if not isinstance(num_heads, int) or num_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads!r} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
        self.cache = AscendPagedKVCache.create(
            scheme, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_size,
            max_seqs=max_seqs, dtype=dtype, tail_blocks=tail_blocks, calibration=calibration, backend=backend,
            device=device)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, slot_mapping: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                seq_ids: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hk, D], slot_mapping [T] (rows past query_start_loc[-1] are
        padding), query_start_loc [B+1], seq_lens [B] (including this step's tokens), block_tables [B, M],
        seq_ids [B] (each request's stable serving slot in [0, max_seqs)). Every request must have exactly
        one query token (a decode step). Returns output [T, Hq, D] (written in place when given); padding
        rows are left untouched."""
        n = query.shape[0]
        b = seq_lens.shape[0]
        if seq_ids.ndim != 1 or seq_ids.shape[0] != b:
            raise ValueError(f"seq_ids must have one entry per request ({b}), got {tuple(seq_ids.shape)}")
        pos = token_positions(query_start_loc.cpu(), seq_lens.cpu())
        t = pos.shape[0]
        if t > n or key.shape[0] != n or value.shape[0] != n or slot_mapping.shape[0] != n:
            raise ValueError(f"query/key/value/slot_mapping must have the same number of rows (>= {t} scheduled "
                             f"tokens), got {n}, {key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}")
        q_lens = query_start_loc[1:].cpu() - query_start_loc[:-1].cpu()
        if bool((q_lens != 1).any()):
            raise ValueError("forward covers decode steps (one query token per request); this batch has requests "
                             f"with {sorted(set(q_lens.tolist()))} tokens. Store them with cache.write(...) and run "
                             "their attention on the chunk's float K/V plus cache.dense_kv(...) for the cached context")
        pad = n - t
        dev = key.device
        slots = slot_mapping.clone()
        if pad:
            slots[t:] = -1
        seq_all = torch.cat([seq_ids.cpu().long(), torch.zeros(pad, dtype=torch.long)]).to(dev)
        pos_all = torch.cat([pos, torch.zeros(pad, dtype=torch.long)]).to(dev)
        self.cache.write(key, value, slots, seq_ids=seq_all, positions=pos_all)
        out = self.cache.decode(query[:b], block_tables, seq_lens, seq_ids=seq_ids, scale=self.scale)
        if output is None:
            output = torch.zeros_like(query)
        output[:b] = out
        return output
