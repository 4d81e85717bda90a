"""Requests whose keys/values the cache stored altered finish with an error, their neighbours untouched.

The write stores a token with a NaN/Inf in K or V as zeros, clips values beyond the cache's range,
and counts every such token per high-precision slot - the sequence that wrote it
(`torch_ops.take_altered_slots`). The request behind that slot can no longer be trusted: its own
attention read the replaced values. So, after each step:

- in the worker, `watch` wraps the model runner's methods that return the step's
  `ModelRunnerOutput`: it takes the per-slot counts, maps slots to request ids (the metadata
  builder's `SlotTable`), drops the token those requests sampled in this step and names them in the
  output (attribute `FAILED`, with the reason);
- in the engine core, `KvarnScheduler` (vLLM's scheduler, which the plugin's config hook selects)
  finishes them through vLLM's own error path: `finish_reason="error"`, their blocks freed, an
  error logged with the request id and what was stored.

The other requests of the batch are computed as before: a sequence's attention reads only its own
blocks and slots, so a replaced token never reaches them.
"""

from __future__ import annotations

import copy

import numpy as np

from . import torch_ops

try:
    from vllm.logger import init_logger
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
except ImportError as e:  # pragma: no cover
    raise ImportError("kvarn_vllm.failures needs vLLM (pip install 'kvarn-jax[vllm]')") from e

logger = init_logger("vllm.kvarn_vllm")
FAILED = "kvarn_failed_requests"  # ModelRunnerOutput attribute: {request id: reason}
SCHEDULERS = {False: "kvarn_vllm.failures.KvarnScheduler", True: "kvarn_vllm.failures.KvarnAsyncScheduler"}
WORDS = ("token(s) with NaN/Inf in K or V (stored as zeros)", "token(s) with values beyond the cache's range "
         "(stored clipped)", "token(s) in quantized blocks whose KVarN scales saturated")


def reason(counts) -> str:
    """What a slot's counts [3] (`torch_ops.ALTERED` order) say, in words."""
    return ", ".join(f"{int(n)} {w}" for n, w in zip(counts, WORDS) if n)


def failed_requests(slot_of: dict, counts: np.ndarray) -> dict:
    """{request id: reason} of the requests whose slot has altered tokens (counts [max_seqs, 3])."""
    return {rid: reason(counts[s]) for rid, s in slot_of.items() if 0 <= s < counts.shape[0] and counts[s].any()}


def mark(output, failed: dict):
    """The step's output with the failed requests' sampled tokens dropped and `FAILED` set (a copy:
    vLLM shares some outputs, e.g. its empty one)."""
    if not failed or not isinstance(output, ModelRunnerOutput):
        return output
    out = copy.copy(output)
    tokens = list(out.sampled_token_ids)
    for rid in failed:
        i = out.req_id_to_index.get(rid)
        if i is not None and i < len(tokens):
            tokens[i] = []
    out.sampled_token_ids = tokens
    setattr(out, FAILED, dict(failed))
    return out


def watch(runner, table, device, max_seqs: int) -> None:
    """Wrap `runner`'s output methods (once) so that each step's output names the requests whose
    slots stored altered tokens. table: its `slot_of` maps request id -> slot (the metadata builder's)."""
    if runner is None or getattr(runner, "_kvarn_watched", False):
        return

    def check(output):
        if isinstance(output, ModelRunnerOutput):
            counts = torch_ops.take_altered_slots(device, max_seqs)
            if counts.any():
                return mark(output, failed_requests(table.slot_of, counts))
        elif output is not None and hasattr(output, "get_output"):  # async scheduling: checked when resolved
            get = output.get_output
            output.get_output = lambda: check(get())
        return output

    for name in ("execute_model", "sample_tokens"):
        method = getattr(runner, name, None)
        if method is not None:
            setattr(runner, name, lambda *a, _m=method, **k: check(_m(*a, **k)))
    runner._kvarn_watched = True


class _Failing:
    """Finishes the requests a step's output names (`FAILED`) with vLLM's error status."""

    def update_from_output(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, FAILED, None)
        if failed:
            for rid, why in failed.items():
                logger.error("kvarn: request %s finished with an error: its KV cache stored %s", rid, why)
            # finished with RequestStatus.FINISHED_ERROR (finish_reason "error") at the end of this update
            self.encoder_cache_mismatch_reqs.update(failed)
        return super().update_from_output(scheduler_output, model_runner_output)


class KvarnScheduler(_Failing, Scheduler):
    pass


class KvarnAsyncScheduler(_Failing, AsyncScheduler):
    pass


def failing_scheduler(cls) -> bool:
    """Whether a scheduler_cls setting (a class or its qualified name) fails requests as kvarn needs."""
    if isinstance(cls, str):
        if cls in SCHEDULERS.values():
            return True
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            cls = resolve_obj_by_qualname(cls)
        except (ImportError, AttributeError, ValueError):
            return False
    return isinstance(cls, type) and issubclass(cls, _Failing)

