"""The vLLM bridge's configuration rules and plugin checks, without vLLM: where the scheme comes
from (additional-config, environment, a registered --kv-cache-dtype), conflicts, the names
registered on vLLM >= 0.33, and the supported version range."""

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
    for key in ("KVARN_KV_CACHE_DTYPE", "KVARN_CALIBRATION", "KVARN_DECODE_IMPL"):
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
            "kvarn_fp8", "fp8_static", "fp16", "bf16"} <= set(names)
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
    monkeypatch.setattr(plugin, "_version", lambda: (0, 29))
    monkeypatch.setitem(plugin._DONE, "registered", False)
    monkeypatch.setenv("KVARN_KV_CACHE_DTYPE", "int8")
    with pytest.raises(RuntimeError, match="0.29"):
        plugin.register()
    # without kvarn asked for, the plugin stays inactive and vLLM runs as usual
    monkeypatch.delenv("KVARN_KV_CACHE_DTYPE")
    plugin.register()
    assert plugin._DONE["registered"] and plugin.registered_dtype_names() == []
