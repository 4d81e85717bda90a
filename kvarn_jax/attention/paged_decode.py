"""`paged_decode_attention`: the public decode entry, choosing the Pallas kernel or the reference."""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from ..config import KVQuantConfig
from ..hadamard import SAFE_ABS, rotate, unrotate
from ..storage import QUANT_MAX
from ..schemes.arith import saturate
from ..impl import IMPLS, check_impl, resolve_impl  # noqa: F401  (IMPLS: the model and runner import it from here)
from ..validation import require_compiled_backend
from . import paged_decode_cpu, paged_decode_pallas, paged_decode_tpu
from .reference import attend, check_decode_args

KERNELS = ("gpu", "tpu")
_SUPPORTS = {"gpu": paged_decode_pallas.supports, "tpu": paged_decode_tpu.supports}


def decode_impl(cfg: KVQuantConfig, block_size: int, head_dim: int, impl: str = "auto", kernel: str | None = None,
                backend: str | None = None) -> tuple[str, str, str | None]:
    """(implementation, kernel, why the kernel cannot take the cache or None) that
    `paged_decode_attention(impl=impl, kernel=kernel)` uses for a cache of this scheme and geometry
    (`impl.resolve_impl`). kernel default: the platform's - "tpu" on TPUs, "gpu" elsewhere. For
    "native" (on CPUs, "auto" for KVarN caches) the reason is the CPU kernel's: that it does not
    take the scheme, or cannot be built here (then "auto" runs the reference and warns once)."""
    check_impl(impl)
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)} or None, got {kernel!r}")
    backend = backend or jax.default_backend()
    kernel = kernel or ("tpu" if backend == "tpu" else "gpu")
    why = _SUPPORTS[kernel](cfg, block_size, head_dim)
    native_why = "not asked"
    if impl == "native" or (impl == "auto" and backend == "cpu"):
        native_why = paged_decode_cpu.supports(cfg, block_size, head_dim)
        if native_why is None:
            native_why = paged_decode_cpu.available()
            if native_why is not None and impl == "auto":
                _warn_native_unavailable(native_why)
        if impl == "native":
            return "native", kernel, native_why
    return resolve_impl(impl, "decode", cfg, why, backend, native_why), kernel, why


@functools.lru_cache(maxsize=None)
def _warn_native_unavailable(why: str) -> None:
    warnings.warn(f"decode attention over KVarN caches runs the jnp reference (slower) on this CPU: {why}",
                  RuntimeWarning, stacklevel=3)


def paged_decode_attention(q, cache, block_tables, seq_lens, scale: float | None = None, *, seq_ids=None,
                           window: int | None = None, impl: str = "auto", interpret: bool | None = None,
                           num_splits: int | None = None, kernel: str | None = None, check_values: bool = True,
                           rotated_output: bool = False, new_kv=None):
    """Decode attention of one query token per sequence over a `PagedKVCache`.

    Same arguments and result as `paged_decode_attention_reference` (q [B, Hq, D] -> [B, Hq, D] in
    q.dtype), plus:
      impl: "pallas" (a fused kernel), "native" (the C++ CPU kernel for KVarN caches, built on first
        use with the machine's compiler: `paged_decode_cpu`), "reference" (pure jnp) or "auto": the
        platform's Pallas kernel on NVIDIA GPUs and TPUs, the native one on CPUs, when it supports the
        cache; the reference elsewhere: `decode_impl`.
      kernel: which Pallas kernel `impl="pallas"` runs: "gpu" (`paged_decode_pallas/`, Triton
        lowering) or "tpu" (`paged_decode_tpu.py`, Mosaic, scalar-prefetched block tables). Default:
        the platform's - "tpu" on TPUs, "gpu" elsewhere (on CPU both run only interpreted).
      interpret: run the Pallas kernel in interpret mode (default: True on CPU; how CI tests it).
      num_splits: GPU kernel: programs per (sequence, kv head) along the KV length (default: enough
        to fill the chip). The TPU kernel walks a sequence's blocks in one program.
      check_values: on concrete (not traced) arguments, check that q is finite and that block ids,
        lengths and sequence ids are in range, raising ValueError that names the argument. Those
        checks read the arrays back to the host, so an eager call waits for the device; a caller
        whose indices come from its own scheduler (the vLLM bridge) passes False to keep dispatch
        asynchronous. Shapes and dtypes are always checked. Under jit nothing is read back either
        way. Unchecked out-of-range indices are made harmless by every implementation: block ids
        and sequence ids are clamped into range, and no implementation reads past the block table
        (a bad row reads other pages of the cache: its output is wrong, no memory outside the cache
        is read, nothing is written, the other rows are unaffected; on the GPU kernel a length past
        the table's capacity re-reads its last block, so a huge one also takes that long).
      rotated_output: for a rotated (KVarN) cache, return the output in the stored frame (the
        model-frame output times H, head by head), not unrotated: for a caller whose next product's
        matrix holds the rotation (`hadamard.rotate_rows`), which saves a product and its clip per
        call. Other caches ignore it.
      new_kv: (k, v) [B, Hk, D], one more token per row that is not in the cache yet: the token at
        position seq_lens[b], as the cache will store it (`storage.storage_values`: the stored frame,
        the cache's value dtype). Each row attends to its seq_lens cached tokens and this one, as a
        write of the token followed by a decode with seq_lens + 1 would - so a caller that can only
        write the cache after the call (the vLLM bridge: torch owns the memory) needs one call per
        layer. The GPU kernel merges the token as one more split; the TPU kernel does not take it
        (ValueError). Not with window.
    `impl="pallas"` raises ValueError if the kernel cannot take the cache (e.g. a block size that is
    not a power of two); nothing falls back silently.
    """
    check_impl(impl)
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)} or None, got {kernel!r}")
    check_decode_args(q, cache, block_tables, seq_lens, seq_ids, window, values=bool(check_values), new_kv=new_kv)
    new_kv = None if new_kv is None else tuple(new_kv)
    backend = jax.default_backend()
    impl, kernel, why = decode_impl(cache.cfg, cache.block_size, cache.head_dim, impl, kernel, backend)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if impl == "reference":
        return attend(q, cache, block_tables, seq_lens, sm_scale, seq_ids, window, False, bool(rotated_output), new_kv)
    if impl == "native":
        if backend != "cpu":
            raise ValueError(f"impl='native' is the CPU kernel; this is the {backend} backend (use 'auto')")
        if why is not None:
            raise ValueError(f"impl='native' cannot run this cache: {why}; use impl='reference' or 'auto'")
        return _native(q, cache, block_tables, seq_lens, seq_ids, scale=sm_scale, window=window,
                       rotated_output=bool(rotated_output), new_kv=new_kv)
    if why is not None:
        raise ValueError(f"impl='pallas' cannot run this cache on the {kernel} kernel: {why}; "
                         "use impl='reference' or 'auto'")
    if kernel == "tpu" and num_splits is not None:
        raise ValueError("num_splits applies to the GPU kernel only (the TPU kernel walks a sequence in one program)")
    if kernel == "tpu" and new_kv is not None:
        raise ValueError("new_kv is taken by the GPU kernel and the reference, not by kernel='tpu' (it finishes each "
                         "row's softmax in one program); write the token first, or use impl='reference'")
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    require_compiled_backend(interpret, f"paged_decode_attention(impl='pallas', kernel={kernel!r})", kernel)
    return _pallas(q, cache, block_tables, seq_lens, seq_ids, scale=sm_scale, window=window,
                   interpret=interpret, num_splits=num_splits, kernel=kernel, rotated_output=bool(rotated_output),
                   new_kv=new_kv)


@functools.partial(jax.jit, static_argnames=("scale", "window", "interpret", "num_splits", "kernel", "rotated_output"))
def _pallas(q, cache, block_tables, seq_lens, seq_ids, *, scale, window, interpret, num_splits, kernel,
            rotated_output=False, new_kv=None):
    # rotate once before and un-rotate once after: the kernels work in the stored frame
    # (the bounds skip a per-row overflow test: queries beyond QUANT_MAX are clipped to it, and the
    # output is a weighted mean of stored values, which are far below SAFE_ABS)
    one_token = q.shape[0] == 1  # batch 1: the rotations as reductions (`hadamard.rotate`)
    # a bf16 query enters the rotation as it is (one bf16 product of its signs, `hadamard.rotate`);
    # others in fp32 with the fp32 matrix
    q_in = q if q.dtype == jnp.bfloat16 else q.astype(jnp.float32)
    qr = rotate(q_in, jnp.float32, max_abs=QUANT_MAX, one_token=one_token) if cache.cfg.rotated else q
    if kernel == "tpu":
        if seq_ids is None:  # built here, not eagerly: an eager op would be one more dispatch per call
            seq_ids = jnp.arange(q.shape[0], dtype=jnp.int32)
        o = paged_decode_tpu.paged_decode_tpu(qr, cache, block_tables, seq_lens, seq_ids, scale=scale,
                                              window=window, interpret=interpret)
    else:  # seq_ids None: the GPU kernel reads sequence b's sink and tail from row b
        o = paged_decode_pallas.paged_decode_pallas(qr, cache, block_tables, seq_lens, seq_ids, scale=scale,
                                                    window=window, interpret=interpret,
                                                    launch=paged_decode_pallas.Launch(num_splits=num_splits),
                                                    new_kv=new_kv)
    if cache.cfg.rotated and not rotated_output:
        o = unrotate(o, max_abs=SAFE_ABS, one_token=one_token)
    return saturate(o, q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "rotated_output"))
def _native(q, cache, block_tables, seq_lens, seq_ids, *, scale, window, rotated_output=False, new_kv=None):
    # the reference's frame handling around the kernel (`reference.attend`): q rotated in fp32, the
    # output unrotated unless asked for in the stored frame
    qr = rotate(q.astype(jnp.float32), max_abs=QUANT_MAX)
    o = paged_decode_cpu.paged_decode_cpu(qr, cache, block_tables, seq_lens, seq_ids, scale=scale, window=window,
                                          new_kv=new_kv)
    if not rotated_output:
        o = unrotate(o, max_abs=SAFE_ABS)
    return saturate(o, q.dtype)
