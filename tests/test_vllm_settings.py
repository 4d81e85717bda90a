"""The vLLM bridge's configuration rules and plugin checks, without vLLM: where the scheme comes
from (additional-config, environment, a registered --kv-cache-dtype), conflicts, the names
registered on vLLM >= 0.33, the supported version range, and what the config hook refuses before
any worker starts (`checks.check_config`, on stand-ins for vLLM's config objects)."""

import types

import pytest

import kvarn_jax as kj
from kvarn_vllm import plugin
from kvarn_vllm.settings import BridgeSettings, resolve, scheme_from_vllm_name, vllm_names


def _config(additional=None, cache_dtype="auto"):
    return types.SimpleNamespace(additional_config=additional or {},
                                 cache_config=types.SimpleNamespace(cache_dtype=cache_dtype))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("KVARN_KV_CACHE_DTYPE", "KVARN_LAYER_CONFIG", "KVARN_CALIBRATION", "KVARN_DECODE_IMPL"):
        monkeypatch.delenv(key, raising=False)


def test_no_kvarn_means_stock_vllm():
    assert resolve(_config()) is None
    assert resolve(_config(cache_dtype="fp8")) is None  # vLLM's own fp8 stays vLLM's


def test_scheme_from_additional_config_or_environment(monkeypatch):
    s = resolve(_config({"kvarn_kv_cache_dtype": "kvarn"}))
    assert s.cfg == kj.parse("kvarn_k4v2_g128") and s.decode_impl == "auto" and s.calibration is None
    monkeypatch.setenv("KVARN_KV_CACHE_DTYPE", "int4_g32")
    monkeypatch.setenv("KVARN_DECODE_IMPL", "reference")
    s = resolve(_config())
    assert s.cfg == kj.parse("int4_g32") and s.decode_impl == "reference"
    # the same value from both sources is fine; different values are an error naming both
    assert resolve(_config({"kvarn_kv_cache_dtype": "int4_g32"})).cfg == kj.parse("int4_g32")
    with pytest.raises(ValueError, match="KVARN_KV_CACHE_DTYPE"):
        resolve(_config({"kvarn_kv_cache_dtype": "int8"}))


def test_scheme_from_a_registered_kv_cache_dtype():
    assert resolve(_config(cache_dtype="kvarn_k4v4_g64")).cfg == kj.parse("kvarn_k4v4_g64")
    assert resolve(_config(cache_dtype="kvarn_fp8")).cfg == kj.parse("fp8")
    assert resolve(_config({"kvarn_kv_cache_dtype": "kvarn_k4v4_g64"}, "kvarn_k4v4_g64")) is not None
    with pytest.raises(ValueError, match="disagree"):
        resolve(_config({"kvarn_kv_cache_dtype": "int8"}, "kvarn_k4v4_g64"))


@pytest.mark.parametrize("bad, match", [
    ({"kvarn_kv_cache_dtype": "kvarn_k3v2_g128"}, "key bits"),
    ({"kvarn_kv_cache_dtype": "int8", "kvarn_decode_impl": "triton"}, "kvarn_decode_impl"),
    ({"kvarn_kv_cache_dtype": "int8_static"}, "kvarn_calibration"),
    ({"kvarn_kv_cache_dtype": "int8", "kvarn_calibration": "x.npz"}, "dynamically"),
    ({"kvarn_calibration": "x.npz"}, "no kvarn scheme"),
    ({"kvarn_kv_cache_dtype": "kvarn_k4v2_g128_sink4"}, "4-token sink"),
    ({"kvarn_kv_cache_dtype": "kivi_k2v2_g32_hpint8"}, "int8 sink and tail"),
])
def test_bad_settings_are_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        resolve(_config(bad))


def test_registered_names_cover_the_grammar_without_taking_vllms():
    builtin = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head"]
    names = vllm_names(builtin)
    assert len(names) == len(set(names))
    assert not set(names) & set(builtin)
    assert {"kvarn_k4v2_g128", "kvarn_k2v8_g32", "kivi_k2v4_g64", "int4", "int_k8v4_g64", "int8_static",
            "kvarn_fp8", "fp8_static", "fp16", "bf16", "kvarn_k4v2_g128_clip", "int4_clip", "kvarn_k4v2_g128_clipv"} <= set(names)
    for n in names:  # every registered name maps back to the scheme it stands for
        cfg = scheme_from_vllm_name(n)
        assert cfg is not None and kj.parse(cfg.name) == cfg
    assert scheme_from_vllm_name("fp8") is None and scheme_from_vllm_name("auto") is None


def test_settings_are_checked_on_construction():
    with pytest.raises(ValueError, match="calibration"):
        BridgeSettings(kj.parse("fp8_static"))
    assert BridgeSettings(kj.parse("fp8_static"), calibration="c.npz").calibration == "c.npz"


def test_version_range(monkeypatch):
    assert plugin.check_version((0, 32)) is None and plugin.check_version((0, 34)) is None
    assert "outside" in plugin.check_version((0, 31)) and "outside" in plugin.check_version((0, 35))
    assert "could not be determined" in plugin.check_version(None)
    # asking for kvarn on an unsupported vLLM fails at start, naming the version
    monkeypatch.setattr(plugin, "installed_version", lambda: (0, 29))
    monkeypatch.setitem(plugin._DONE, "registered", False)
    monkeypatch.setenv("KVARN_KV_CACHE_DTYPE", "int8")
    with pytest.raises(RuntimeError, match="0.29"):
        plugin.register()
    # without kvarn asked for, the plugin stays inactive and vLLM runs as usual
    monkeypatch.delenv("KVARN_KV_CACHE_DTYPE")
    plugin.register()
    assert plugin._DONE["registered"] and plugin.registered_dtype_names() == []


# ------------------------------------------------------------------------------ per-layer schemes
def _layer_file(path, layers):
    from kvarn_jax.layer_config import write_layer_config
    write_layer_config(path, layers, model={"num_layers": len(layers)})
    return str(path)


def _engine_config(additional, num_layers, pp=1):
    """A config with a model of num_layers layers (vLLM's ModelConfig.get_num_layers)."""
    cfg = _config(additional)
    cfg.model_config = types.SimpleNamespace(get_num_layers=lambda parallel_config: num_layers)
    cfg.parallel_config = types.SimpleNamespace(pipeline_parallel_size=pp)
    return cfg


def test_layer_config_from_additional_config_or_environment(tmp_path, monkeypatch):
    path = _layer_file(tmp_path / "layers.json", ["kvarn_k4v2_g128", "int8", "kvarn_k4v4_g128", "int8"])
    s = resolve(_engine_config({"kvarn_layer_config": path}, 4))
    assert s.cfg is None and s.layer_config == path
    assert [s.scheme(i) for i in range(4)] == [kj.parse(n) for n in ("kvarn_k4v2_g128", "int8", "kvarn_k4v4_g128",
                                                                        "int8")]
    assert s.schemes == [kj.parse("kvarn_k4v2_g128"), kj.parse("int8"), kj.parse("kvarn_k4v4_g128")]
    with pytest.raises(ValueError, match="builds attention layer 4 but kvarn_layer_config .* has 4 layers"):
        s.scheme(4)
    monkeypatch.setenv("KVARN_LAYER_CONFIG", path)
    assert resolve(_engine_config({}, 4)) == s
    # a single scheme answers every layer, as before
    monkeypatch.delenv("KVARN_LAYER_CONFIG")
    one = resolve(_config({"kvarn_kv_cache_dtype": "int4"}))
    assert one.layers is None and one.scheme(17) == kj.parse("int4") and one.schemes == [kj.parse("int4")]


def test_layer_config_errors(tmp_path, monkeypatch):
    path = _layer_file(tmp_path / "layers.json", ["int8", "int4"])
    with pytest.raises(ValueError, match=r"kvarn_layer_config: layer config .*layers\.json' has 2 layers but the "
                                         r"model has num_layers=30"):
        resolve(_engine_config({"kvarn_layer_config": path}, 30))
    # with a scheme as well: refused, not one of them silently ignored
    with pytest.raises(ValueError, match="both set"):
        resolve(_engine_config({"kvarn_layer_config": path, "kvarn_kv_cache_dtype": "int8"}, 2))
    with pytest.raises(ValueError, match="--kv-cache-dtype kvarn_int8 are both set"):
        cfg = _engine_config({"kvarn_layer_config": path}, 2)
        cfg.cache_config.cache_dtype = "kvarn_int8"
        resolve(cfg)
    with pytest.raises(ValueError, match="dynamically"):
        resolve(_engine_config({"kvarn_layer_config": path, "kvarn_calibration": "c.npz"}, 2))
    with pytest.raises(ValueError, match="no such file"):
        resolve(_engine_config({"kvarn_layer_config": str(tmp_path / "none.json")}, 2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        resolve(_engine_config({"kvarn_layer_config": path}, 2, pp=2))
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="kvarn_layer_config: .*format"):
        resolve(_engine_config({"kvarn_layer_config": str(tmp_path / "bad.json")}, 2))
    monkeypatch.setenv("KVARN_LAYER_CONFIG", str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="set twice"):
        resolve(_engine_config({"kvarn_layer_config": path}, 2))
    with pytest.raises(ValueError, match="exactly one"):
        BridgeSettings(kj.parse("int8"), layers=(kj.parse("int8"),))


def test_shared_page_is_the_largest_layers_need():
    """Every layer declares one page size (vLLM's customize_spec does not say which layer it sizes):
    the largest layer's need; a request holds as many blocks for its sink and tail as the layer that
    needs the most of them."""
    from kvarn_vllm.layout import PageLayout, hp_blocks_per_seq, shared_page_bytes

    kw = dict(block_size=128, num_kv_heads=3, head_dim=64, dtype="float32", max_seqs=8)
    small, big, fp16 = PageLayout("kvarn_k4v2_g128", **kw), PageLayout("int8", **kw), PageLayout("fp16", **kw)
    assert small.format_page_bytes < big.format_page_bytes
    assert shared_page_bytes([small, big, small]) == big.vllm_page_bytes()
    # a float32 model keeps its sink and tail in float16: (sink, tail) x (K, V) x 128 tokens x 3 heads x 64 x 2 B
    assert small.hp_seq_bytes == big.hp_seq_bytes == 2 * 2 * 128 * 3 * 64 * 2 and fp16.hp_seq_bytes == 0
    assert small.hp_blocks_per_seq == -(-small.hp_seq_bytes // small.format_page_bytes) == 8
    assert hp_blocks_per_seq([small, big, fp16]) == small.hp_blocks_per_seq > big.hp_blocks_per_seq
    assert hp_blocks_per_seq([fp16]) == 0


# ------------------------------------------------------------------------------ the config hook's refusals
def _full_config(additional=None, **change):
    """A stand-in for a VllmConfig with what `checks.check_config` reads; `change` replaces parts
    ('cache.enable_prefix_caching': True, 'model.use_mla': True, ...)."""
    ns = types.SimpleNamespace
    hf = ns(sliding_window=None, use_sliding_window=True)
    model = ns(dtype="torch.bfloat16", is_hybrid=False, is_encoder_decoder=False, use_mla=False, hf_text_config=hf,
               get_head_size=lambda: 64, get_num_kv_heads=lambda par: 3, get_num_layers=lambda par: 30,
               get_sliding_window=lambda: hf.sliding_window)
    cfg = ns(additional_config=additional if additional is not None else {"kvarn_kv_cache_dtype": "kvarn_k4v2_g128"},
             cache_config=ns(cache_dtype="auto", enable_prefix_caching=False, block_size=128, kv_cache_memory_bytes=2 ** 30),
             model_config=model, speculative_config=None, kv_transfer_config=None,
             parallel_config=ns(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1),
             scheduler_config=ns(max_num_seqs=8, scheduler_cls=None, async_scheduling=False),
             compilation_config=ns(cudagraph_mode=None, splitting_ops=None, use_inductor_graph_partition=False))
    for key, value in change.items():
        obj = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, {"cache": "cache_config", "model": "model_config", "par": "parallel_config",
                                "sched": "scheduler_config", "comp": "compilation_config", "hf": "model_config"}.get(part, part))
            if part == "hf":
                obj = obj.hf_text_config
        setattr(obj, parts[-1], value)
    return cfg


@pytest.mark.parametrize("change, match", [
    ({"cache.enable_prefix_caching": True}, "prefix caching.*--no-enable-prefix-caching"),
    ({"speculative_config": object()}, "speculative decoding"),
    ({"model.use_mla": True}, "MLA"),
    ({"model.is_hybrid": True}, "hybrid"),
    ({"model.is_encoder_decoder": True}, "encoder-decoder"),
    ({"par.decode_context_parallel_size": 2}, "context parallelism"),
    ({"kv_transfer_config": object()}, "KV transfer"),
    ({"model.dtype": "torch.float64"}, "model dtype"),
    ({"hf.sliding_window": 4096}, "sliding-window"),
    ({"hf.attn_logit_softcapping": 50.0}, "soft-capping"),
    ({"model.get_head_size": lambda: 96}, "head_size=96"),
    ({"cache.block_size": 48}, "block_size"),
    ({"comp.cudagraph_mode": types.SimpleNamespace(name="FULL")}, "cudagraph_mode=FULL"),
    ({"comp.cudagraph_mode": types.SimpleNamespace(name="PIECEWISE"), "comp.splitting_ops": ["vllm::other"]},
     "splitting_ops"),
    ({"sched.scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"}, "custom scheduler_cls"),
])
def test_the_config_hook_refuses_what_the_bridge_cannot_serve(change, match):
    from kvarn_vllm import checks, runtime

    checks.check_config(_full_config())  # the supported case passes
    cfg = _full_config(**change)
    with pytest.raises(ValueError, match=match) as err:
        checks.check_config(cfg)
    assert str(err.value).startswith("kvarn:")
    # an engine that did not ask for kvarn is never refused
    checks.check_config(_full_config({}, **change))
    assert runtime.settings_for(_full_config({})) is None


def test_the_cpu_prefill_needs_a_head_size_vllms_cpu_attention_takes():
    """A quantized cache's CPU prefill runs vLLM's CPU attention op: a head size it does not take is
    refused at start, not at the first prompt; passthrough caches and GPUs do not use the op."""
    from kvarn_vllm import checks

    cpu = types.SimpleNamespace(device_type="cpu")
    for scheme, head in (("int8", 72), ("kvarn_k4v2_g128", 16)):
        cfg = _full_config({"kvarn_kv_cache_dtype": scheme}, **{"model.get_head_size": lambda h=head: h})
        checks.check_config(cfg)  # no device config (a GPU): allowed
        cfg.device_config = cpu
        with pytest.raises(ValueError, match=f"head_size={head} with {scheme} on the CPU.*vLLM's CPU attention"):
            checks.check_config(cfg)
    cfg = _full_config({"kvarn_kv_cache_dtype": "fp16"}, **{"model.get_head_size": lambda: 72})
    cfg.device_config = cpu
    checks.check_config(cfg)
    cfg = _full_config()
    cfg.device_config = cpu
    checks.check_config(cfg)  # SmolLM2's 64


def test_the_native_decode_kernel_is_checked_at_start(monkeypatch):
    """kvarn_decode_impl=native (the C++ CPU kernel): refused at start for a scheme it does not take,
    on a GPU, and where it cannot be built; accepted for KVarN on a CPU."""
    from kvarn_jax.attention import paged_decode_cpu
    from kvarn_vllm import checks

    cpu = types.SimpleNamespace(device_type="cpu")
    cfg = _full_config({"kvarn_kv_cache_dtype": "kvarn_k4v2_g128", "kvarn_decode_impl": "native"})
    cfg.device_config = cpu
    monkeypatch.setattr(paged_decode_cpu, "available", lambda: None)
    checks.check_config(cfg)
    cfg.device_config = types.SimpleNamespace(device_type="cuda")
    with pytest.raises(ValueError, match="native on cuda.*CPU decode kernel"):
        checks.check_config(cfg)
    cfg = _full_config({"kvarn_kv_cache_dtype": "int8", "kvarn_decode_impl": "native"})
    cfg.device_config = cpu
    with pytest.raises(ValueError, match="native with int8.*KVarN caches only"):
        checks.check_config(cfg)
    cfg = _full_config({"kvarn_kv_cache_dtype": "kvarn_k4v2_g128", "kvarn_decode_impl": "native"})
    cfg.device_config = cpu
    monkeypatch.setattr(paged_decode_cpu, "available", lambda: "no C++ compiler (g++) found")
    with pytest.raises(ValueError, match="native on this machine.*no C\\+\\+ compiler"):
        checks.check_config(cfg)


def test_the_config_hook_refuses_bad_settings_and_versions(monkeypatch, tmp_path):
    from kvarn_vllm import checks

    with pytest.raises(ValueError, match="kvarn_kv_cache_dtype"):
        checks.check_config(_full_config({"kvarn_kv_cache_dtype": "kvarn_k3v2_g128"}))
    (tmp_path / "cal.npz").write_bytes(b"not a calibration")
    with pytest.raises(ValueError, match="kvarn_calibration .* cannot be loaded"):
        checks.check_config(_full_config({"kvarn_kv_cache_dtype": "int8_static", "kvarn_calibration": str(tmp_path / "cal.npz")}))
    monkeypatch.setattr(plugin, "installed_version", lambda: (0, 40))
    with pytest.raises(ValueError, match="0.40 is outside"):
        checks.check_config(_full_config())


def test_the_config_hook_selects_the_scheduler_that_fails_altered_requests():
    """A kvarn engine gets `failures.KvarnScheduler` (the async one under async scheduling); a
    subclass of it is kept; an engine without kvarn keeps vLLM's."""
    pytest.importorskip("vllm")
    from kvarn_vllm import checks, failures

    for async_ in (False, True):
        cfg = _full_config(**{"sched.async_scheduling": async_})
        checks.check_config(cfg)
        assert cfg.scheduler_config.scheduler_cls == failures.SCHEDULERS[async_]
    mine = type("Mine", (failures.KvarnScheduler,), {})
    cfg = _full_config(**{"sched.scheduler_cls": mine})
    checks.check_config(cfg)
    assert cfg.scheduler_config.scheduler_cls is mine
    cfg = _full_config({})
    checks.check_config(cfg)
    assert cfg.scheduler_config.scheduler_cls is None
