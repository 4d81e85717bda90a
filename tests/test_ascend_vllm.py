"""The vllm-ascend route: kvarn_ascend's scheme selected through vllm-ascend's quantization scheme
registry by a quant description, swapping the layer's attention impl, with its pages in the KV cache
vLLM allocates for the layer and a stable sink/tail slot per request.

vllm-ascend does not import without torch_npu and CANN, so the pieces of it the route touches are
stood in for here, each written from its source (vllm-ascend 0.22, `vllm_ascend/quantization/
methods/registry.py`, `modelslim_config.py` (`get_quant_method`, `is_fa_quant_layer`,
`create_scheme_for_layer`), `method_adapters.py` (`AscendKVCacheMethod.create_weights`),
`worker/model_runner_v1.py` (the per-layer (k_cache, v_cache) of `kv_cache_torch_dtype`),
`attention/attention_v1.py` (`AscendMetadata`, the impl's `forward` signature)), and torch_npu by the
recording fake (tests/ascend_fake_npu.py). Where vllm-ascend's registry module can be loaded (vllm-ascend
installed, or KVARN_VLLM_ASCEND_SRC=<folder holding vllm_ascend/>) the registry test runs against it.
"""

import importlib.util
import os
import pathlib
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvarn_jax as kj
from kvarn_ascend import AscendPagedKVCache, KVarNAscendAttention, ops, token_positions
from kvarn_ascend import vllm_ascend as va
from kvarn_ascend.kvarn_torch import hadamard

import ascend_fake_npu
from helpers import allocate_tables

BS, HK, HQ, D, NB = 32, 2, 4, 64, 24
DTYPE = torch.bfloat16


@pytest.fixture
def fake_torch_npu(monkeypatch):
    return ascend_fake_npu.install(monkeypatch)


# ------------------------------------------------------------------------------------------ stand-ins
def fake_registry():
    """vllm_ascend.quantization.methods.registry: (quant_type, layer_type) -> class, duplicates refused."""
    mod = types.ModuleType("registry")
    table = {}

    def register_scheme(quant_type, layer_type):
        def deco(cls):
            if (quant_type, layer_type) in table:
                raise ValueError(f"Scheme already registered for {quant_type}/{layer_type}")
            table[(quant_type, layer_type)] = cls
            return cls
        return deco
    mod.register_scheme = register_scheme
    mod.get_scheme_class = lambda q, t: table.get((q, t))
    return mod


def real_registry():
    """The registry module of an installed vllm-ascend, or of KVARN_VLLM_ASCEND_SRC; None when neither."""
    src = os.environ.get("KVARN_VLLM_ASCEND_SRC")
    if src:
        path = pathlib.Path(src) / "vllm_ascend" / "quantization" / "methods" / "registry.py"
    else:
        try:
            spec = importlib.util.find_spec("vllm_ascend")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return None
        path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "quantization" / "methods" / "registry.py"
    if not path.exists():
        return None
    # the module has no imports of its own: loaded by path, without vllm_ascend's torch_npu-importing package
    spec = importlib.util.spec_from_file_location("vllm_ascend_registry_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def select_attention_scheme(description: dict, prefix: str, registry):
    """What vllm-ascend's ModelSlim config does for an attention layer: layers whose index appears in a
    `fa_k.scale` key are FA-quant layers when `fa_quant_type` is set, and get the registered class of
    (fa_quant_type, "attention"), built without arguments (modelslim_config.py)."""
    if not description.get("fa_quant_type"):
        return None
    layers = {int("".join(re.findall(r"\.(\d+)\.", k))) for k in description if "fa_k.scale" in k}
    ids = "".join(re.findall(r"\.(\d+)\.", prefix))
    if not (ids.isdigit() and int(ids) in layers):
        return None
    cls = registry.get_scheme_class(description["fa_quant_type"], "attention")
    if cls is None:
        raise NotImplementedError(f"no scheme for {description['fa_quant_type']}/attention")
    return cls()


class AscendAttentionBackendImpl:
    """Stands for vllm-ascend's impl: a kvarn layer must never reach its forward."""

    def __init__(self, scale):
        self.scale = scale

    def forward(self, *args, **kwargs):
        raise AssertionError("vllm-ascend's own attention forward ran for a kvarn layer")


class Layer(torch.nn.Module):
    def __init__(self, name, model_dtype):
        super().__init__()
        self.layer_name, self.num_heads, self.num_kv_heads, self.head_size = name, HQ, HK, D
        self.kv_cache_torch_dtype = model_dtype
        self.impl = AscendAttentionBackendImpl(D ** -0.5)


def engine_config(description, *, max_num_seqs=4, dtype=DTYPE, **changes):
    c = types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=dtype, enforce_eager=True, use_mla=False),
        cache_config=types.SimpleNamespace(block_size=BS, enable_prefix_caching=False),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        speculative_config=None, kv_transfer_config=None,
        quant_config=types.SimpleNamespace(quant_description=description))
    for path, value in changes.items():
        obj, attr = path.rsplit(".", 1) if "." in path else (None, path)
        setattr(getattr(c, obj) if obj else c, attr, value)
    return c


class Runner:
    """The model runner of one engine: load (scheme selection, create_weights, KV allocation), then steps.
    `self.input_batch.req_ids` and `self.requests` are what the scheme reads off the call stack."""

    def __init__(self, description, registry, monkeypatch, num_layers=2, **config):
        self.config = engine_config(description, **config)
        monkeypatch.setattr(va, "_current_vllm_config", lambda: self.config)
        self.layers = []
        for i in range(num_layers):
            layer = Layer(f"model.layers.{i}.self_attn.attn", self.config.model_config.dtype)
            scheme = select_attention_scheme(description, layer.layer_name, registry)
            scheme.create_weights(layer)  # AscendKVCacheMethod.create_weights
            self.layers.append(layer)
        # model_runner_v1: one k and one v tensor per layer, [num_blocks, block_size, Hk, D] of the layer's dtype
        self.kv = [tuple(torch.zeros(NB, BS, HK, D, dtype=layer.kv_cache_torch_dtype) for _ in "kv")
                   for layer in self.layers]
        self.input_batch = types.SimpleNamespace(req_ids=[])
        self.requests = {}

    def step(self, rows, q, ks, vs, slots, tables, pad=2):
        """rows: [(request id, tokens this step, seq_len after the step)] in batch order; ks, vs: each
        layer's key/value rows. Returns each layer's output rows and the step's metadata."""
        self.input_batch.req_ids = [r for r, _, _ in rows]
        n = sum(t for _, t, _ in rows)
        qsl = torch.tensor(np.concatenate([[0], np.cumsum([t for _, t, _ in rows])]), dtype=torch.int32)
        lens = torch.tensor([s for _, _, s in rows], dtype=torch.int32)
        md = types.SimpleNamespace(num_actual_tokens=n, query_start_loc=qsl, seq_lens=lens, seq_lens_cpu=lens,
                                   block_tables=tables, slot_mapping=torch.cat([slots, torch.full((pad,), -1)]),
                                   attn_state="ChunkedPrefill")
        padq = lambda x: torch.cat([x, x[:pad]])  # noqa: E731 - vLLM pads the token rows
        outs = []
        for layer, kv, k, v in zip(self.layers, self.kv, ks, vs):
            out = torch.full((n + pad, HQ, D), 9.0, dtype=q.dtype)
            layer.impl.forward(layer, padq(q), padq(k), padq(v), kv, md, output=out)
            assert bool((out[n:] == 0).all())
            outs.append(out[:n])
        return outs, md


# ------------------------------------------------------------------------------------------ positions, forward
def test_token_positions_follow_vllm_seq_lens():
    qsl = torch.tensor([0, 1, 4, 4, 6])
    lens = torch.tensor([7, 3, 9, 2])
    assert token_positions(qsl, lens).tolist() == [6, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="query_start_loc"):
        token_positions(torch.tensor([0, 1]), lens)
    with pytest.raises(ValueError, match="at most seq_lens"):
        token_positions(torch.tensor([0, 1, 5, 6, 7]), lens)


def _oracle_prefill(cache, q, table, seq_len, seq_id):
    """float64: the chunk's queries over dense_kv at seq_len, causally (rotation by the exact H)."""
    k, v = cache.dense_kv(table[None], torch.tensor([seq_len]), torch.tensor([seq_id]))
    k, v = k[0, :, :seq_len].double(), v[0, :, :seq_len].double()
    n = q.shape[0]
    qq = q.double()
    h = hadamard(D, torch.float64)
    if cache.cfg.rotated:
        qq = qq @ h
    qg = qq.reshape(n, HK, HQ // HK, D)
    s = torch.einsum("nhgd,hld->hgnl", qg, k) / np.sqrt(D)
    qpos = seq_len - n + torch.arange(n)
    s = s.masked_fill(torch.arange(seq_len)[None, :] > qpos[:, None], -np.inf)
    o = torch.einsum("hgnl,hld->nhgd", torch.softmax(s, -1), v).reshape(n, HQ, D)
    return o @ h if cache.cfg.rotated else o


@pytest.mark.parametrize("scheme", ["int8", "kvarn_k4v2_g32", "bf16"])
def test_mixed_step_decodes_and_prefills(rng, scheme):
    """One step with decodes and prefill chunks (with and without cached context): decode rows equal
    cache.decode, prefill rows the float64 oracle over dense_kv, and a chunk's last token what a decode
    at its position gives."""
    lens0 = [40, 70, 0, 33]     # cached before the step
    add = [1, 5, 37, 1]         # this step's tokens
    lens = [a + b for a, b in zip(lens0, add)]
    tables = torch.from_numpy(allocate_tables(rng, lens, BS, NB))
    attn = KVarNAscendAttention(scheme, num_heads=HQ, num_kv_heads=HK, head_size=D, num_blocks=NB, block_size=BS,
                                max_seqs=4, dtype=DTYPE, backend="cpu", device="cpu")
    kv = [tuple(torch.from_numpy(rng.standard_normal((n, HK, D)).astype(np.float32)).to(DTYPE) for _ in "kv")
          for n in lens]
    pos = lambda i, a, b: torch.arange(a, b)  # noqa: E731
    slot = lambda i, p: tables[i, p // BS] * BS + p % BS  # noqa: E731
    for i, n in enumerate(lens0):
        if n:
            p = pos(i, 0, n)
            attn.cache.write(kv[i][0][:n], kv[i][1][:n], slot(i, p).int(), seq_ids=torch.full((n,), i),
                             positions=p)
    rows = [torch.arange(lens0[i], lens[i]) for i in range(4)]
    key = torch.cat([kv[i][0][r] for i, r in enumerate(rows)])
    val = torch.cat([kv[i][1][r] for i, r in enumerate(rows)])
    slots = torch.cat([slot(i, r) for i, r in enumerate(rows)]).int()
    q = torch.from_numpy(rng.standard_normal((key.shape[0], HQ, D)).astype(np.float32)).to(DTYPE)
    qsl = torch.tensor([0] + list(np.cumsum(add)))
    out = attn.forward(torch.cat([q, q[:2]]), torch.cat([key, key[:2]]), torch.cat([val, val[:2]]),
                       slot_mapping=torch.cat([slots, slots[:2]]), query_start_loc=qsl, seq_lens=torch.tensor(lens),
                       block_tables=tables, seq_ids=torch.arange(4))
    assert bool((out[-2:] == 0).all())  # padding rows untouched (zeros_like)
    dec = [0, 3]
    want = attn.cache.decode(q[qsl[dec]], tables[dec], torch.tensor(lens)[dec], seq_ids=torch.tensor(dec))
    assert torch.equal(out[qsl[dec]], want)
    for r in (1, 2):
        a, b = int(qsl[r]), int(qsl[r + 1])
        ref = _oracle_prefill(attn.cache, q[a:b], tables[r], lens[r], r)
        assert ops.max_violation(out[a:b], ref.float(), DTYPE) <= 2
        last = attn.cache.decode(q[b - 1:b], tables[r:r + 1], torch.tensor([lens[r]]), seq_ids=torch.tensor([r]))
        assert ops.max_violation(out[b - 1:b], last.float(), DTYPE) <= 2
    with pytest.raises(ValueError, match="seq_ids must be a tensor with one entry per request"):
        attn.forward(q, key, val, slot_mapping=slots, query_start_loc=qsl, seq_lens=torch.tensor(lens),
                     block_tables=tables, seq_ids=torch.arange(3))


# ------------------------------------------------------------------------------------------ pages in vLLM's buffers
@pytest.mark.parametrize("scheme,want", [("int8", DTYPE), ("int4", torch.int8), ("int8_static", torch.int8),
                                         ("int4_static", torch.int8), ("bf16", DTYPE),
                                         ("kvarn_k4v2_g32", torch.int8), ("kvarn_k8v8_g32", DTYPE),
                                         ("kivi_k2v2_g32", torch.int8)])
def test_storage_dtype_is_the_smallest_that_holds_the_pages(scheme, want):
    assert va.storage_dtype(scheme, BS, HK, D, DTYPE) == want
    cap = BS * HK * D * want.itemsize
    need = max(va.page_bytes(scheme, BS, HK, D, DTYPE).values())
    assert need <= cap and (want != DTYPE or need > BS * HK * D)


def test_over_buffers_views_the_callers_memory_and_refuses_small_buffers():
    k = torch.zeros(NB, BS, HK, D, dtype=torch.int8)
    v = torch.zeros_like(k)
    c = AscendPagedKVCache.over_buffers("int4", {"k": k, "v": v}, hp=None, block_size=BS, num_kv_heads=HK,
                                        head_dim=D, max_seqs=2, dtype=DTYPE, backend="cpu")
    for side, buf in (("k", k), ("v", v)):
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        for name, t in c.pages[side].items():
            assert t.is_contiguous() and t.shape[0] == NB
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi, (side, name)
    c.pages["k"]["scale"].fill_(3.0)
    assert bool(k.any())  # writes land in the caller's tensor
    with pytest.raises(ValueError, match="bytes per block, fewer than"):
        AscendPagedKVCache.over_buffers("int8", {"k": k, "v": v}, hp=None, block_size=BS, num_kv_heads=HK,
                                        head_dim=D, max_seqs=2, dtype=DTYPE, backend="cpu")
    with pytest.raises(ValueError, match="contiguous tensor"):
        AscendPagedKVCache.over_buffers("int4", {"k": k, "v": v[:, :, :, :32]}, hp=None, block_size=BS,
                                        num_kv_heads=HK, head_dim=D, max_seqs=2, dtype=DTYPE, backend="cpu")


# ------------------------------------------------------------------------------------------ the registry route
def test_register_and_quant_description():
    reg = fake_registry()
    assert va.register(reg) and va.register(reg)  # twice: a no-op
    assert reg.get_scheme_class(va.QUANT_TYPE, "attention") is va.KVarNAttentionScheme
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    desc = va.quant_description(names, "kvarn_k4v2_g128", 2)
    assert desc["model.layers.0.self_attn.q_proj.weight"] == "FLOAT" and desc["fa_quant_type"] == "KVARN"
    assert desc["kvarn_kv_cache_dtype"] == "kvarn_k4v2_g128" and "model.layers.1.self_attn.fa_k.scale" in desc
    with pytest.raises(ValueError, match="calibration"):
        va.quant_description(names, "int8_static", 2)
    assert va.register(None) is False  # vllm-ascend is not installed here: nothing registered, no error


def test_real_vllm_ascend_registry_takes_the_scheme():
    reg = real_registry()
    if reg is None:
        pytest.skip("vllm-ascend's registry is not available (install vllm-ascend or set KVARN_VLLM_ASCEND_SRC)")
    assert va.register(reg) and va.register(reg)
    assert reg.get_scheme_class(va.QUANT_TYPE, "attention") is va.KVarNAttentionScheme
    with pytest.raises(ValueError, match="already registered"):  # its duplicate check is what register avoids
        reg.register_scheme(va.QUANT_TYPE, "attention")(type("Other", (), {}))


@pytest.mark.parametrize("scheme", ["int4", "int8", "kvarn_k4v2_g32", "int8_static"])
def test_vllm_ascend_route_serves_like_the_standalone_cache(fake_torch_npu, rng, monkeypatch, tmp_path, scheme):
    """Load (scheme selected by the description, impl swapped, KV dtype set, sink/tail buffers), then steps
    with prefills, decodes, reordered rows, a finished request whose slot a new one takes: every layer's
    output equals a standalone cache's (own memory, CPU semantics, fixed slots) on the same tokens."""
    lens = {"a": 45, "b": 76, "c": 40}
    num_layers = 2
    cal_path = None
    toks = {r: [tuple(torch.from_numpy(rng.standard_normal((n, HK, D)).astype(np.float32)).to(DTYPE)
                      for _ in "kv") for _ in range(num_layers)] for r, n in lens.items()}
    if scheme.endswith("_static"):
        k = np.stack([np.concatenate([toks[r][i][0].float().numpy() for r in lens]) for i in range(num_layers)])
        v = np.stack([np.concatenate([toks[r][i][1].float().numpy() for r in lens]) for i in range(num_layers)])
        cal = kj.calibrate([(jnp.asarray(k), jnp.asarray(v))], scheme)
        cal_path = tmp_path / "cal.npz"
        cal.save(cal_path)
    reg = fake_registry()
    va.register(reg)
    desc = va.quant_description(["model.layers.0.self_attn.q_proj.weight"], scheme, num_layers, calibration=cal_path)
    runner = Runner(desc, reg, monkeypatch, num_layers=num_layers, max_num_seqs=2)
    for layer in runner.layers:
        assert type(layer.impl).__name__ == "KVarNAscendAttentionBackendImpl"
        assert layer.kv_cache_torch_dtype == va.storage_dtype(scheme, BS, HK, D, DTYPE)
        assert tuple(layer.kvarn_hp_k.shape) == (2 * 2, BS, HK, D)  # max_num_seqs x (sink + tail)
    ref = [KVarNAscendAttention(scheme, num_heads=HQ, num_kv_heads=HK, head_size=D, num_blocks=NB, block_size=BS,
                                max_seqs=3, dtype=DTYPE, backend="cpu", device="cpu",
                                calibration=None if cal_path is None else kj.Calibration.load(cal_path).layer(i))
           for i in range(num_layers)]
    ref_id = {"a": 0, "b": 1, "c": 2}
    rows_ab = torch.from_numpy(allocate_tables(rng, [lens["a"], lens["b"]], BS, NB))
    tables = {"a": rows_ab[0], "b": rows_ab[1], "c": rows_ab[0]}  # "c" gets the blocks "a" freed
    done = dict.fromkeys(lens, 0)
    # (request, tokens) per step, in batch order; "a" finishes after step 3 and "c" arrives in step 4
    plan = [[("a", 30), ("b", 70)], [("b", 1), ("a", 1)], [("a", 14), ("b", 1)], [("c", 33), ("b", 1)],
            [("b", 1), ("c", 1)], [("c", 6), ("b", 2)]]
    for step in plan:
        runner.requests = {r: object() for r, _ in step}
        rows, q, ks, vs, slots = [], [], [[] for _ in range(num_layers)], [[] for _ in range(num_layers)], []
        for r, t in step:
            p = torch.arange(done[r], done[r] + t)
            done[r] += t
            rows.append((r, t, done[r]))
            slots.append(tables[r][p // BS] * BS + p % BS)
            q.append(torch.from_numpy(rng.standard_normal((t, HQ, D)).astype(np.float32)).to(DTYPE))
            for i in range(num_layers):
                ks[i].append(toks[r][i][0][p])
                vs[i].append(toks[r][i][1][p])
        bt = torch.stack([tables[r] for r, _ in step]).int()
        q, slots = torch.cat(q), torch.cat(slots).int()
        got, md = runner.step(rows, q, [torch.cat(x) for x in ks], [torch.cat(x) for x in vs], slots, bt)
        for i in range(num_layers):
            want = ref[i].forward(q, torch.cat(ks[i]), torch.cat(vs[i]), slot_mapping=slots,
                                  query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, block_tables=bt,
                                  seq_ids=torch.tensor([ref_id[r] for r, _, _ in rows]))
            assert torch.equal(got[i], want), (step, i)
    tables_ = {id(layer.impl._kvarn.slots) for layer in runner.layers}
    assert len(tables_) == 1  # one slot table per engine, shared by its layers
    assert runner.layers[0].impl._kvarn.slots.slot_of == {"c": 0, "b": 1}  # "a"'s slot went to "c"
    assert {"npu_fused_infer_attention_score", "npu_scatter_pa_kv_cache"} <= set(fake_torch_npu.names())
    # no second cache: the bound pages live in vLLM's tensors, the sink/tail in the layer's buffers
    for layer, (kc, vc) in zip(runner.layers, runner.kv):
        cache = layer.impl._kvarn.attn.cache
        for side, buf in (("k", kc), ("v", vc)):
            for t in cache.pages[side].values():
                assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert cache.hp["k"] is layer.kvarn_hp_k and cache.hp["v"] is layer.kvarn_hp_v


SCHEME_BAD = [
    (dict(), {"cache_config.enable_prefix_caching": True}, "--no-enable-prefix-caching"),
    (dict(), {"model_config.enforce_eager": False}, "--enforce-eager"),
    (dict(), {"speculative_config": object()}, "speculative decoding"),
    (dict(), {"kv_transfer_config": object()}, "KV transfer"),
    (dict(), {"model_config.use_mla": True}, "MLA"),
    ({"kvarn_kv_cache_dtype": None}, {}, "no 'kvarn_kv_cache_dtype'"),
    ({"kvarn_kv_cache_dtype": "int8_static"}, {}, "set 'kvarn_calibration'"),
    ({"kvarn_calibration": "/x.npz"}, {}, "computes its scales dynamically"),
    ({"kvarn_kv_cache_dtype": "fp8"}, {}, "cannot be held by the Ascend cache"),
]


@pytest.mark.parametrize("change,config,fragment", SCHEME_BAD, ids=[b[2] for b in SCHEME_BAD])
def test_scheme_refuses_what_it_does_not_cover(monkeypatch, change, config, fragment):
    desc = va.quant_description(["w.weight"], "int4", 1)
    desc.update(change)
    desc = {k: v for k, v in desc.items() if v is not None}
    reg = fake_registry()
    va.register(reg)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        Runner(desc, reg, monkeypatch, num_layers=1, **config)


def test_more_live_requests_than_slots_is_an_error_naming_the_flag():
    slots = va.RequestSlots(2)
    assert slots.assign(["a", "b"], {"a", "b"}).tolist() == [0, 1]
    assert slots.assign(["c", "b"], {"b", "c"}).tolist() == [0, 1]  # "a" left: its slot is free again
    with pytest.raises(RuntimeError, match="--max-num-seqs"):
        slots.assign(["b", "c", "d"], {"b", "c", "d"})


def test_forward_without_metadata_is_a_profile_run(monkeypatch, fake_torch_npu):
    reg = fake_registry()
    va.register(reg)
    runner = Runner(va.quant_description(["w.weight"], "int4", 1), reg, monkeypatch, num_layers=1)
    layer = runner.layers[0]
    out = torch.full((3, HQ, D), 5.0, dtype=DTYPE)
    assert layer.impl.forward(layer, out, out, out, runner.kv[0], None, output=out) is out
    assert not bool(out.any()) and not fake_torch_npu.calls
