import itertools

import jax
import pytest

import kvarn_jax as kj
from kvarn_jax.config import KVQuantConfig


def all_scheme_strings():
    out = []
    for kb, vb, g in itertools.product((2, 4, 8), (2, 4, 8), (32, 64, 128)):
        out.append(f"kvarn_k{kb}v{vb}_g{g}")
    for kb, vb, g in itertools.product((2, 4), (2, 4), (32, 64, 128)):
        out.append(f"kivi_k{kb}v{vb}_g{g}")
    for b in (2, 4, 8):
        out += [f"int{b}", f"int{b}_g32", f"int{b}_static"]
    out += ["int_k8v4", "int_k4v2_g64", "int_k8v2_static", "fp8", "fp8_static", "fp16", "bf16", "fp32"]
    return out


@pytest.mark.parametrize("text", all_scheme_strings())
def test_every_string_round_trips(text):
    cfg = KVQuantConfig.parse(text)
    assert cfg.name == text
    assert KVQuantConfig.parse(cfg.name) == cfg
    assert hash(cfg) == hash(KVQuantConfig.parse(text))  # static under jit


def test_parse_facts():
    c = kj.parse("kvarn_k4v2_g128")
    assert (c.method, c.k_bits, c.v_bits, c.group, c.rotated, c.tile_tokens) == ("kvarn", 4, 2, 128, True, 128)
    c = kj.parse("int_k8v4")
    assert (c.method, c.k_bits, c.v_bits, c.group, c.tile_tokens, c.rotated) == ("int", 8, 4, 0, 1, False)
    assert kj.parse("int4_g32").channel_group("k", 128) == 32
    assert kj.parse("int4").channel_group("v", 128) == 128
    assert kj.parse("kivi_k2v2_g32").channel_group("v", 128) == 32
    assert kj.parse("fp8_e4m3") == kj.parse("fp8")
    assert kj.parse("kvarn") == kj.parse("kvarn_k4v2_g128")
    assert kj.parse(" FP16 ").dtype == "float16"
    assert kj.parse(kj.parse("int8")) == kj.parse("int8")


def test_config_is_static_under_jit():
    f = jax.jit(lambda x, cfg: x * cfg.k_bits, static_argnames="cfg")
    assert int(f(1, cfg=kj.parse("int4"))) == 4
    assert int(f(1, cfg=kj.parse("int8"))) == 8


@pytest.mark.parametrize("text, needle", [
    ("kvarn_k3v2_g128", "key bits 3"),
    ("kvarn_k4v2_g100", "group (tile tokens) 100"),
    ("kivi_k8v2_g32", "key bits 8"),
    ("int3", "key bits 3"),
    ("int4_g48", "group (channels per scale) 48"),
    ("int8_g32_static", "group suffix does not apply"),
    ("nf4", "not a known scheme"),
    ("", "not a known scheme"),
])
def test_bad_strings_name_the_argument_and_list_what_is_accepted(text, needle):
    with pytest.raises(ValueError) as e:
        KVQuantConfig.parse(text)
    msg = str(e.value)
    assert needle in msg
    assert "kv_cache_dtype" in msg
    if "not a known scheme" in needle or "bits" in needle or "group" in needle and "suffix" not in needle:
        assert "kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}" in msg  # the grammar is listed


def test_non_string_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype must be a string"):
        KVQuantConfig.parse(4)


@pytest.mark.parametrize("text, head_dim, needle", [
    ("kvarn_k4v2_g128", 96, "power-of-two head_dim"),
    ("kvarn_k4v2_g128", 8, "power-of-two head_dim"),
    ("int4_g32", 48, "channel group 32 must divide head_dim"),
    ("int2", 6, "whole bytes"),
])
def test_head_dim_errors(text, head_dim, needle):
    with pytest.raises(ValueError, match=needle) as e:
        kj.parse(text).check_head_dim(head_dim)
    assert "head_dim" in str(e.value)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kvarn_takes_64_128_256(head_dim):
    kj.parse("kvarn_k4v2_g128").check_head_dim(head_dim)


def test_block_size_rules():
    kj.parse("kvarn_k4v2_g64").check_block_size(128)
    kj.parse("int8").check_block_size(16)
    with pytest.raises(ValueError, match="block_size=96 .* multiple of the scheme's tile of 64"):
        kj.parse("kvarn_k4v2_g64").check_block_size(96)
    with pytest.raises(ValueError, match="block_size=2048"):
        kj.parse("int8").check_block_size(2048)


@pytest.mark.parametrize("args, kw, needle", [
    (("int", 3, 3), {}, "key bits 3"),
    (("int", 16, 16), {}, "key bits 16"),
    (("kvarn", 3, 2), dict(group=32), "key bits 3"),
    (("kvarn", 4, 2), dict(group=100), "group (tile tokens) 100"),
    (("kivi", 4, 8), dict(group=32), "value bits 8"),
    (("int", 8, 8), dict(group=48), "group (channels per scale) 48"),
    (("int", 8, 8), dict(group=32, static=True), "a group does not apply"),
    (("kivi", 2, 2), dict(group=32, static=True), "static scales exist for int and fp8 only"),
    (("fp8", 4, 8), {}, "k_bits = v_bits = 8"),
    (("passthrough", 16, 16), dict(dtype="float64"), "passthrough dtype"),
    (("passthrough", 32, 32), dict(dtype="float16"), "16-bit"),
    (("int", 8, 8), dict(dtype="float16"), "takes none"),
    (("int", True, 8), {}, "k_bits must be an int"),
    (("int", 8, 8), dict(static=1), "static must be a bool"),
    (("kvarn", 4, 2), dict(group=32, sinkhorn_iters=-1), "sinkhorn_iters"),
    (("int", 8, 8), dict(sinkhorn_iters=3), "applies to kvarn only"),
    (("nf", 4, 4), {}, "method 'nf'"),
])
def test_hand_built_configs_obey_the_grammar(args, kw, needle):
    """A config built field by field is checked as its string would be: no reshape or division
    error later, no silently accepted 3-bit KVarN."""
    with pytest.raises(ValueError) as e:
        KVQuantConfig(*args, **kw)
    assert needle in str(e.value)


def test_every_parsed_config_rebuilds_from_its_fields():
    import dataclasses
    for text in ["kvarn_k2v8_g32", "kivi_k4v2_g128", "int2_g8", "int_k8v4_g256", "int4_static", "fp8", "fp8_static",
                 "fp16", "bf16", "fp32", "kvarn"]:
        cfg = KVQuantConfig.parse(text)
        assert KVQuantConfig(**dataclasses.asdict(cfg)) == cfg
    assert KVQuantConfig("kvarn", 4, 4, group=128, sinkhorn_iters=0).sinkhorn_iters == 0
