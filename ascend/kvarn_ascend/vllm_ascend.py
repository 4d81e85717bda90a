"""kvarn_jax's KV-cache schemes in vllm-ascend, through its quantization scheme registry.

vllm-ascend hard-codes its attention backend classes (`NPUPlatform.get_attn_backend_cls` ignores
`--attention-backend`); its hook for KV-cache quantization is the scheme registry
(`vllm_ascend/quantization/methods/registry.py`). With `--quantization ascend`, its ModelSlim config
(`quantization/modelslim_config.py`) gives every attention layer that the model's
`quant_model_description.json` marks (`fa_quant_type`, and a `...<layer>...fa_k.scale` key per
layer) the scheme class registered as `(fa_quant_type, "attention")`, built without arguments and
wrapped in `AscendKVCacheMethod`, whose `create_weights(layer)` vLLM calls once the layer's impl
exists. `KVarNAttentionScheme` (registered as "KVARN" by `register()`) then, like vllm-ascend's own
C8 method (`methods/kv_c8.py`):
- sets `layer.kv_cache_torch_dtype` to int8 when the scheme's pages fit in int8's bytes (else the
  model dtype): vLLM sizes and allocates the layer's KV cache as usual and the scheme's pages are
  carved out of that allocation (`AscendPagedKVCache.over_buffers`): no second cache per layer;
- swaps `layer.impl.__class__` for a subclass whose `forward` stores and attends with kvarn_ascend;
- allocates the high-precision sink/tail blocks (`max_num_seqs` slots) as buffers of the layer,
  before vLLM profiles memory, so that vLLM's KV budget accounts for them.
Each request keeps one sink/tail slot for its life: `RequestSlots` maps vLLM's request ids (read
from the model runner's batch, found on the call stack once per step) to slots.

Not covered (each refused with a ValueError naming the setting): prefix caching, speculative
decoding, KV transfer (prefill/decode disaggregation), MLA models, graph capture (use
--enforce-eager), vLLM's model runner V2. None of this has run on an NPU: it is tested on CPU
against a recording fake of torch_npu and a stand-in of vllm-ascend's registry, config lookup,
allocation and metadata (tests/test_ascend_vllm.py), and against the real registry module when
vllm-ascend is importable.
"""

from __future__ import annotations

import math
import re

import torch

from kvarn_jax.config import KVQuantConfig
from kvarn_jax.integrations.vllm_runner import find_model_runner

from .cache import AscendPagedKVCache, page_bytes

QUANT_TYPE = "KVARN"
SCHEME_KEY = "kvarn_kv_cache_dtype"
CALIBRATION_KEY = "kvarn_calibration"
_MODEL_DTYPES = (torch.float16, torch.bfloat16)


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
    """One attention layer's quantized KV cache and its forward for a serving step.

    `forward` stores the step's key/value (quantize-on-write), then attends: requests with one query
    token through `cache.decode` (the fused attention), longer ones (prefill chunks) through
    `cache.prefill`. Build it with its own memory (`KVarNAscendAttention(...)`) or over a serving
    engine's KV tensors (`over_buffers`)."""

    def __init__(self, scheme, *, num_heads: int, num_kv_heads: int, head_size: int, num_blocks: int,
                 block_size: int, max_seqs: int, dtype=torch.bfloat16, scale: float | None = None,
                 calibration=None, tail_blocks: int = 1, backend: str = "auto", device=None):
        cache = AscendPagedKVCache.create(
            scheme, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_size,
            max_seqs=max_seqs, dtype=dtype, tail_blocks=tail_blocks, calibration=calibration, backend=backend,
            device=device)
        self._init(cache, num_heads, scale)

    @classmethod
    def over_buffers(cls, scheme, buffers: dict, *, hp, num_heads: int, num_kv_heads: int, head_size: int,
                     block_size: int, max_seqs: int, dtype=torch.bfloat16, scale: float | None = None,
                     calibration=None, tail_blocks: int = 1, backend: str = "auto") -> "KVarNAscendAttention":
        """Pages in `buffers` {"k", "v"} (e.g. vLLM's KV cache tensors of the layer), sink/tail in `hp`."""
        cache = AscendPagedKVCache.over_buffers(
            scheme, buffers, hp=hp, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_size,
            max_seqs=max_seqs, dtype=dtype, tail_blocks=tail_blocks, calibration=calibration, backend=backend)
        self = cls.__new__(cls)
        self._init(cache, num_heads, scale)
        return self

    def _init(self, cache, num_heads, scale):
        hk = cache.num_kv_heads
        if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0 or num_heads % hk:
            raise ValueError(f"num_heads={num_heads!r} must be a positive multiple of num_kv_heads={hk}")
        self.cache = cache
        self.num_heads = num_heads
        self.scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else float(scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, *,
                slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, seq_ids: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hk, D] (None: nothing to store), slot_mapping [T] (rows past
        query_start_loc[-1] are padding), query_start_loc [B+1], seq_lens [B] (including this step's tokens),
        block_tables [B, M], seq_ids [B] (each request's stable sink/tail slot in [0, max_seqs)). Returns
        output [T, Hq, D] (written in place when given); padding rows are left untouched."""
        n = query.shape[0]
        qsl, lens = query_start_loc.cpu().long(), seq_lens.cpu().long()
        b = lens.shape[0]
        if not isinstance(seq_ids, torch.Tensor) or seq_ids.ndim != 1 or seq_ids.shape[0] != b:
            raise ValueError(f"seq_ids must be a tensor with one entry per request ({b}), got "
                             f"{getattr(seq_ids, 'shape', seq_ids)}")
        if block_tables.ndim != 2 or block_tables.shape[0] != b:
            raise ValueError(f"block_tables must be [{b}, max_blocks], got {tuple(block_tables.shape)}")
        pos = token_positions(qsl, lens)
        t = pos.shape[0]
        if t > n or slot_mapping.shape[0] != n or (key is not None and (key.shape[0] != n or value.shape[0] != n)):
            raise ValueError(f"query/key/value/slot_mapping must have the same number of rows (>= {t} scheduled "
                             f"tokens), got {n}, {None if key is None else key.shape[0]}, "
                             f"{None if value is None else value.shape[0]}, {slot_mapping.shape[0]}")
        sid = seq_ids.cpu().long()
        if key is not None:
            dev = key.device
            slots = slot_mapping.clone()
            slots[t:] = -1
            q_lens = qsl[1:] - qsl[:-1]
            tok_sid = torch.cat([torch.repeat_interleave(sid, q_lens), torch.zeros(n - t, dtype=torch.long)])
            tok_pos = torch.cat([pos, torch.zeros(n - t, dtype=torch.long)])
            self.cache.write(key, value, slots, seq_ids=tok_sid.to(dev), positions=tok_pos.to(dev))
        if output is None:
            output = torch.zeros_like(query)
        starts, q_lens = qsl[:-1] - qsl[0], qsl[1:] - qsl[:-1]
        dec = (q_lens == 1).nonzero().squeeze(1)
        if dec.numel():
            rows = starts[dec].to(query.device)
            d_dev = dec.to(block_tables.device)
            output[rows] = self.cache.decode(query[rows].contiguous(), block_tables[d_dev], lens[dec],
                                             seq_ids=sid[dec], scale=self.scale)
        for r in (q_lens > 1).nonzero().squeeze(1).tolist():
            a, m = int(starts[r]), int(q_lens[r])
            output[a:a + m] = self.cache.prefill(query[a:a + m], block_tables[r], int(lens[r]), seq_id=int(sid[r]),
                                                 scale=self.scale)
        return output


# ------------------------------------------------------------------------------------------ request slots
class RequestSlots:
    """vLLM request id -> sink/tail slot in [0, max_seqs), held while the model runner keeps the request.

    A request keeps its slot through batch reordering and preemption (a preempted request restarts at
    position 0, whose write refreshes the slot's sink); a slot is freed when its request leaves the
    runner's `requests`."""

    def __init__(self, max_seqs: int):
        self.max_seqs = max_seqs
        self.slot_of: dict = {}

    def assign(self, req_ids, live) -> torch.Tensor:
        for rid in [r for r in self.slot_of if r not in live]:
            del self.slot_of[rid]
        taken = set(self.slot_of.values())
        free = (s for s in range(self.max_seqs) if s not in taken)
        out = []
        for rid in req_ids:
            if rid not in self.slot_of:
                slot = next(free, None)
                if slot is None:
                    raise RuntimeError(f"kvarn: more than max_num_seqs={self.max_seqs} live requests hold KV cache "
                                       "(one sink/tail slot each): raise --max-num-seqs")
                self.slot_of[rid] = slot
            out.append(self.slot_of[rid])
        return torch.tensor(out, dtype=torch.int32)



# ------------------------------------------------------------------------------------------ the scheme
def storage_dtype(scheme, block_size: int, num_kv_heads: int, head_dim: int, model_dtype) -> torch.dtype:
    """The dtype the layer's vLLM KV cache is allocated in: int8 when a block's pages fit in its bytes
    (int4, int*_static, most kvarn/kivi schemes), else the model dtype (int8 with its float32 per-token
    scale and offset, kvarn_k8v8, fp16/bf16)."""
    need = max(page_bytes(scheme, block_size, num_kv_heads, head_dim, model_dtype).values())
    return torch.int8 if need <= block_size * num_kv_heads * head_dim else model_dtype


def layer_index(layer_name: str) -> int:
    found = re.findall(r"\.(\d+)\.", layer_name + ".")
    if len(found) != 1:
        raise ValueError(f"kvarn: cannot tell the layer index of attention layer {layer_name!r}")
    return int(found[0])


class _LayerState:
    """What a kvarn layer keeps besides vLLM's KV tensors: the scheme, its sink/tail buffers, the
    calibration, and the cache bound to vLLM's tensors (rebound if vLLM reallocates them)."""

    def __init__(self, cfg, layer, block_size, max_seqs, dtype, calibration, slots):
        self.cfg, self.layer, self.block_size, self.max_seqs, self.dtype = cfg, layer, block_size, max_seqs, dtype
        self.calibration, self.slots = calibration, slots
        self.attn, self._bound_to = None, None

    def bind(self, kv_cache) -> KVarNAscendAttention:
        if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() > 0 and kv_cache.shape[0] == 2 \
                or isinstance(kv_cache, (list, tuple)) and len(kv_cache) >= 2:
            k, v = kv_cache[0], kv_cache[1]
        else:
            raise ValueError("kvarn: the layer's kv_cache must be (k_cache, v_cache)")
        key = (k.data_ptr(), v.data_ptr(), k.shape[0])
        if key != self._bound_to:
            layer = self.layer
            hp = None if self.cfg.is_passthrough else {"k": layer.kvarn_hp_k, "v": layer.kvarn_hp_v}
            self.attn = KVarNAscendAttention.over_buffers(
                self.cfg, {"k": k, "v": v}, hp=hp, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size, block_size=self.block_size, max_seqs=self.max_seqs, dtype=self.dtype,
                scale=layer.impl.scale, calibration=self.calibration)
            self._bound_to = key
        return self.attn

    def seq_ids(self, attn_metadata, num_reqs: int) -> torch.Tensor:
        """The rows' sink/tail slots, computed once per step (the layers of a step share the metadata)."""
        cached = getattr(attn_metadata, "kvarn_seq_ids", None)
        if cached is not None:
            return cached
        runner = find_model_runner()
        if runner is None:
            raise RuntimeError("kvarn: the model runner (with input_batch and requests) was not found on the call "
                               "stack; vLLM's model runner V2 is not supported (unset VLLM_USE_V2_MODEL_RUNNER)")
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        if len(req_ids) != num_reqs:
            raise RuntimeError(f"kvarn: the runner has {len(req_ids)} batch rows, the metadata {num_reqs}")
        ids = self.slots.assign(req_ids, runner.requests)
        attn_metadata.kvarn_seq_ids = ids
        return ids


class _KVarNImpl:
    """Put in front of the layer's vllm-ascend impl class (AscendAttentionBackendImpl) by the scheme."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        if output is None:
            raise ValueError("kvarn: vLLM must pass the attention output buffer")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling and dummy runs: no cache, no requests
            return output.fill_(0)
        state = self._kvarn
        attn = state.bind(kv_cache)
        n = int(attn_metadata.num_actual_tokens)
        lens = getattr(attn_metadata, "seq_lens_cpu", None)
        lens = (attn_metadata.seq_lens if lens is None else lens).cpu()
        b = lens.shape[0]
        attn.forward(query[:n], None if key is None else key[:n], None if value is None else value[:n],
                     slot_mapping=attn_metadata.slot_mapping[:n], query_start_loc=attn_metadata.query_start_loc[:b + 1],
                     seq_lens=lens, block_tables=attn_metadata.block_tables[:b],
                     seq_ids=state.seq_ids(attn_metadata, b), output=output[:n])
        output[n:] = 0
        return output


_IMPL_CLASSES: dict = {}


def impl_class(base: type) -> type:
    """`base` with kvarn's forward (one class per base, so that layers share it)."""
    if issubclass(base, _KVarNImpl):
        return base
    if base not in _IMPL_CLASSES:
        _IMPL_CLASSES[base] = type(f"KVarN{base.__name__}", (_KVarNImpl, base), {})
    return _IMPL_CLASSES[base]


_ENGINE_SLOTS: dict = {}  # id(vllm_config) -> (the config, kept alive for its id; its RequestSlots)


def _current_vllm_config():
    from vllm.config import get_current_vllm_config
    return get_current_vllm_config()


class KVarNAttentionScheme:
    """vllm-ascend attention-layer scheme (registered as `(QUANT_TYPE, "attention")`): a kvarn_jax
    KV-cache scheme for every layer the quant description marks. The description's `kvarn_kv_cache_dtype`
    names the scheme; `kvarn_calibration` a kvarn_jax.Calibration file (static schemes). vllm-ascend
    builds it without arguments, inside vLLM's config context."""

    def __init__(self, quant_description: dict | None = None, vllm_config=None):
        self.vllm_config = _current_vllm_config() if vllm_config is None else vllm_config
        if quant_description is None:
            quant_description = getattr(self.vllm_config.quant_config, "quant_description", None) or {}
        if SCHEME_KEY not in quant_description:
            raise ValueError(f"kvarn: the quant description selects {QUANT_TYPE} (fa_quant_type) but has no "
                             f"{SCHEME_KEY!r} naming the kvarn_jax scheme (e.g. 'kvarn_k4v2_g128')")
        self.cfg = KVQuantConfig.parse(quant_description[SCHEME_KEY])
        self.calibration_path = quant_description.get(CALIBRATION_KEY)
        if self.cfg.static and not self.calibration_path:
            raise ValueError(f"kvarn: {self.cfg.name} has fixed scales: set {CALIBRATION_KEY!r} in the quant "
                             "description to a file written by kvarn_jax.Calibration.save")
        if self.calibration_path and not self.cfg.static:
            raise ValueError(f"kvarn: {CALIBRATION_KEY!r} was given but {self.cfg.name} computes its scales "
                             "dynamically")
        self._check_engine(self.vllm_config)
        # vllm-ascend builds one scheme per layer: the layers of an engine share one slot table
        key = id(self.vllm_config)
        if key not in _ENGINE_SLOTS:
            _ENGINE_SLOTS[key] = (self.vllm_config, RequestSlots(self.vllm_config.scheduler_config.max_num_seqs))
        self.slots = _ENGINE_SLOTS[key][1]

    @staticmethod
    def _check_engine(c):
        mc, cc = c.model_config, c.cache_config
        refused = [
            (getattr(cc, "enable_prefix_caching", False), "prefix caching (a cached prefix has no sink/tail for the "
                                                          "new request): start vLLM with --no-enable-prefix-caching"),
            (getattr(c, "speculative_config", None) is not None, "speculative decoding"),
            (getattr(c, "kv_transfer_config", None) is not None, "KV transfer (prefill/decode disaggregation), whose "
                                                                 "KV layout vllm-ascend sets itself"),
            (getattr(mc, "use_mla", False), "MLA models (kvarn quantizes per-head K/V caches)"),
            (not getattr(mc, "enforce_eager", False), "graph capture (kvarn keeps host-side bookkeeping each step): "
                                                      "start vLLM with --enforce-eager"),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"kvarn on vllm-ascend does not support {what}")

    def create_weights(self, layer: torch.nn.Module) -> None:
        c = self.vllm_config
        dtype = c.model_config.dtype
        if dtype not in _MODEL_DTYPES:
            raise ValueError(f"kvarn: the model dtype must be float16 or bfloat16 (the fused attention's), got {dtype}")
        bs, hk, d = c.cache_config.block_size, layer.num_kv_heads, layer.head_size
        calibration = None
        if self.calibration_path:
            from kvarn_jax import Calibration
            calibration = Calibration.load(self.calibration_path).layer(layer_index(layer.layer_name))
        max_seqs = c.scheduler_config.max_num_seqs
        # the sizes are checked here, at model load, rather than at the first forward
        probe = AscendPagedKVCache.create(self.cfg, num_blocks=1, block_size=bs, num_kv_heads=hk, head_dim=d,
                                          max_seqs=1, dtype=dtype, calibration=calibration, backend="cpu")
        del probe
        layer.kv_cache_torch_dtype = storage_dtype(self.cfg, bs, hk, d, dtype)
        if not self.cfg.is_passthrough:
            hp_shape = (max_seqs * 2, bs, hk, d)  # one sink and one tail block per slot
            layer.register_buffer("kvarn_hp_k", torch.zeros(hp_shape, dtype=dtype), persistent=False)
            layer.register_buffer("kvarn_hp_v", torch.zeros(hp_shape, dtype=dtype), persistent=False)
        impl = layer.impl
        impl.__class__ = impl_class(type(impl))
        impl._kvarn = _LayerState(self.cfg, layer, bs, max_seqs, dtype, calibration, self.slots)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return

    def apply(self, layer, query, key, value, kv_cache, attn_metadata, attn_type, scale, output):
        raise RuntimeError("kvarn: KVarNAttentionScheme.apply is never called; the layer's attention impl "
                           "stores and attends")


def register(registry=None) -> bool:
    """Register KVarNAttentionScheme in vllm-ascend's scheme registry (as `QUANT_TYPE`, "attention").
    registry: the module `vllm_ascend.quantization.methods.registry` (default: imported). Returns False,
    registering nothing, when vllm-ascend is not installed; registering twice is a no-op."""
    if registry is None:
        try:
            from vllm_ascend.quantization.methods import registry
        except ImportError:
            return False
    if registry.get_scheme_class(QUANT_TYPE, "attention") is not KVarNAttentionScheme:
        registry.register_scheme(QUANT_TYPE, "attention")(KVarNAttentionScheme)
    return True


def quant_description(weight_names, scheme, num_layers: int, *, calibration: str | None = None,
                      attention_prefix: str = "model.layers.{}.self_attn") -> dict:
    """A `quant_model_description.json` for an unquantized checkpoint whose attention layers get `scheme`:
    every checkpoint tensor "FLOAT" (vllm-ascend looks each linear layer up), `fa_quant_type` QUANT_TYPE,
    one `fa_k.scale` marker per attention layer (how vllm-ascend finds the layers), the scheme and its
    calibration file. weight_names: the checkpoint's tensor names (e.g. safetensors' keys)."""
    cfg = KVQuantConfig.parse(scheme)
    if cfg.static and calibration is None:
        raise ValueError(f"{cfg.name} has fixed scales: pass calibration (a kvarn_jax.Calibration file)")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    desc = {name: "FLOAT" for name in weight_names}
    desc.update({"fa_quant_type": QUANT_TYPE, SCHEME_KEY: cfg.name})
    if calibration is not None:
        desc[CALIBRATION_KEY] = str(calibration)
    for i in range(num_layers):
        desc[f"{attention_prefix.format(i)}.fa_k.scale"] = QUANT_TYPE
    return desc


__all__ = ["KVarNAscendAttention", "KVarNAttentionScheme", "RequestSlots", "QUANT_TYPE", "register",
           "quant_description", "storage_dtype", "token_positions", "impl_class"]
