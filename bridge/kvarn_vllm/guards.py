"""Refuse MLA models when kvarn is asked for.

On the CPU platform, MLA layers never reach `CPU_ATTN` (vLLM picks CPU_MLA / AMX_MLA for them), so
the kvarn backend would silently not run. These stand-ins for vLLM's CPU MLA backends are vLLM's own
classes unless the engine asked for kvarn, in which case building the first MLA layer raises.
"""

from __future__ import annotations

from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

from . import runtime

MESSAGE = ("kvarn: MLA (latent attention) models are not supported by the kvarn-jax vLLM bridge: their cache "
           "holds one compressed latent per token, not per-head K and V; unset kvarn_kv_cache_dtype")


def refuse_if_kvarn() -> None:
    if runtime.current() is not None:
        raise ValueError(MESSAGE)


class GuardedCPUMLABackend(CPUMLABackend):
    @staticmethod
    def get_impl_cls():
        refuse_if_kvarn()
        return CPUMLABackend.get_impl_cls()


try:
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
except ImportError:  # pragma: no cover - builds without the AMX backend
    AMXMLABackend = None
else:
    class GuardedAMXMLABackend(AMXMLABackend):
        @staticmethod
        def get_impl_cls():
            refuse_if_kvarn()
            return AMXMLABackend.get_impl_cls()
