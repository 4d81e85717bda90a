"""The metadata builder: once per step, vLLM's batch as a `plan.StepPlan` that every layer shares.

Each request's block table starts with the `hp_blocks` blocks that hold its sink and tail rows
(`spec.KvarnAttentionSpec`); the plan gets the rest (the pages, by position) and a slot mapping
into them, and carries the first `hp_blocks` columns and which rows start their sequence for
`hp_pool`. Row r's high-precision slot is r: the sink and tail are staged per step, so a slot only
has to be unique within the step.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvarn_jax.integrations.vllm_runner import find_model_runner

from . import failures, torch_ops
from .checks import check_layer_order
from .hp_pool import HP_BLOCKS, HP_FRESH
from .plan import KvarnMetadata, StepPlan

try:  # vLLM is optional for the rest of the package (the torch entry points need none)
    from vllm.logger import init_logger
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
except ImportError as e:  # pragma: no cover
    raise ImportError("kvarn_vllm.metadata needs vLLM (pip install 'kvarn-jax[vllm]')") from e


logger = init_logger("vllm.kvarn_vllm")
REPORT_EVERY = 256
ALTERED_WORDS = {"nonfinite_tokens": "token(s) with NaN/Inf in K or V as zeros",
                 "saturated_tokens": "token(s) clipped to the cache dtype's range",
                 "metadata_saturated_tokens": "token(s) in blocks whose KVarN scales saturated"}



class _StepRows:
    """Request id -> its high-precision slot in the step just run: its row in the runner's batch
    (`hp_pool` stages row r's sink and tail in slot r)."""

    def __init__(self, runner):
        self.runner = runner

    @property
    def slot_of(self) -> dict:
        return {rid: i for i, rid in enumerate(self.runner.input_batch.req_ids) if rid is not None}


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER  # the JAX calls cannot be captured in vLLM's graphs

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_layer_order(vllm_config, layer_names)  # per-layer schemes: each layer got its own (engine start)
        self._init_reorder_batch_threshold(1)  # decodes first
        self.max_seqs = vllm_config.scheduler_config.max_num_seqs
        self.block_size = kv_cache_spec.block_size
        self.hp_blocks = getattr(kv_cache_spec, "hp_blocks", 0)
        runner = find_model_runner()
        failures.watch(runner, _StepRows(runner), device, self.max_seqs)  # altered K/V: the request finishes with an error
        self.steps = 0
        self.reported = dict.fromkeys(torch_ops.ALTERED, 0)

    def _report_altered(self) -> None:
        """Log the tokens the writes stored altered (NaN/Inf as zeros, saturated values) since the
        last report: every step on CPUs, where the counters are host memory, every
        REPORT_EVERY steps on GPUs, where reading them waits for the device."""
        self.steps += 1
        if self.device.type != "cpu" and self.steps % REPORT_EVERY:
            return
        now = torch_ops.altered_tokens()
        new = {k: now[k] - self.reported[k] for k in now if now[k] > self.reported[k]}
        if new:
            logger.warning("kvarn: the KV cache stored %s since the last report (kvarn_jax.storage's rule; "
                           "totals: kvarn_vllm.torch_ops.counters())",
                           ", ".join(f"{n} {ALTERED_WORDS[k]}" for k, n in new.items()))
        self.reported = now

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnMetadata:
        cm = common_attn_metadata
        r = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: r + 1].numpy().astype(np.int64)
        # vLLM's host copy of the lengths is exact without speculative decoding (which the bridge
        # refuses); reading the device tensor instead would wait for the GPU
        host_lens = getattr(cm, "seq_lens_cpu_upper_bound", None)
        seq_lens = (cm.seq_lens[:r].cpu() if host_lens is None else host_lens[:r]).numpy().astype(np.int64)
        q_lens = np.diff(qsl)
        ctx = seq_lens - q_lens                      # tokens already in the cache before this step
        num_decodes = int(np.argmax(q_lens != 1)) if np.any(q_lens != 1) else r
        fresh = ctx == 0
        torch_ops.count(seq_starts=int(fresh.sum()))
        self._report_altered()
        h = self.hp_blocks
        table = cm.block_table_tensor[:r]
        plan = StepPlan.build(
            block_size=self.block_size, max_seqs=self.max_seqs, query_start_loc=qsl, seq_lens=seq_lens,
            seq_ids=np.arange(r), block_table=table[:, h:], slot_mapping=self._slot_mapping(table[:, h:], qsl, ctx),
            num_decodes=num_decodes)
        plan.cache[HP_BLOCKS] = table[:, :h]
        plan.cache[HP_FRESH] = fresh
        return KvarnMetadata(plan)

    def _slot_mapping(self, pages: torch.Tensor, qsl: np.ndarray, ctx: np.ndarray) -> torch.Tensor:
        """Each token's slot in the pages (block id * block_size + offset): vLLM's own slot mapping
        counts the sink/tail blocks at the front of the table as the first positions' blocks."""
        q_len = np.diff(qsl)
        row = np.repeat(np.arange(q_len.shape[0]), q_len)
        pos = ctx[row] + np.arange(row.shape[0]) - np.repeat(qsl[:-1] - qsl[0], q_len)
        bs = self.block_size
        to = functools.partial(torch.as_tensor, dtype=torch.int64, device=pages.device)
        return pages[to(row), to(pos // bs)].to(torch.int64) * bs + to(pos % bs)
