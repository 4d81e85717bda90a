"""Capacity of the engine's pools with the high-precision sink and tail options: exact bytes against
`memory_report` (Llama-3-8B shapes computed abstractly, a tiny model served for real), the pages a
request holds, and the options served end to end."""

import numpy as np
import pytest
from flax import nnx

import kvarn_jax as kj
from kvarn_jax.cache.memory import hp_bytes_per_seq, page_blocks, sequence_bytes
from kvarn_jax.cache.paged import NO_PAGE
from kvarn_jax.models import Decoder
from kvarn_jax.serving import Engine, SamplingParams
from kvarn_jax.serving.engine import pool_blocks, pool_memory_report
from test_serving import KW, TINY, _poison, _prompts, greedy_direct

LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
FP16_PER_TOKEN = 32 * 8 * 128 * 2 * 2          # Llama-3-8B: every layer's K and V of one token in fp16


def _llama_pool(scheme, seqs, context):
    return pool_memory_report(scheme, max_seqs=seqs, max_model_len=context, **LLAMA3_8B)


@pytest.mark.parametrize("scheme, context, pages_per_seq, hp_per_token, ratio", [
    # the default: 16-bit sink and tail (bf16 here), neither holding a page: 14 pages of a 2K sequence
    ("kvarn_k4v2_g128", 2048, 14, 512, 3.230),
    # the int8 sink and tail (per-token codes + bf16 scale and zero: 128 + 4 bytes per head and side)
    ("kvarn_k4v2_g128_hpint8", 2048, 14, 264, 4.016),
    ("kvarn_k4v2_g128", 32768, 254, 512, 4.606),
    ("kvarn_k4v2_g128_hpint8", 32768, 254, 264, 4.688),
])
def test_llama3_8b_engine_pool_bytes_are_exact(scheme, context, pages_per_seq, hp_per_token, ratio):
    """64 sequences of `context` tokens: every byte of the pool, and its capacity against fp16."""
    rep = _llama_pool(scheme, 64, context)
    pages = 64 * pages_per_seq * 128 * 8 * 32                    # (page, head, layer) token slots
    assert rep["page_bytes"] == pages * 108                       # 13,824 B per 128-token tile and head
    assert rep["sink_bytes"] == rep["tail_bytes"] == 64 * 128 * 8 * 32 * hp_per_token
    assert rep["total_bytes"] == rep["page_bytes"] + rep["sink_bytes"] + rep["tail_bytes"]
    assert rep["tokens"] == 64 * context and rep["hp_only_tokens"] == 64 * 2 * 128
    assert rep["fp16_bytes"] == 64 * context * FP16_PER_TOKEN
    assert rep["capacity_vs_fp16"] == pytest.approx(ratio, abs=0.005)
    # the same, from the per-sequence function (a pool of full sequences is that many sequences)
    seq = sequence_bytes(scheme, context - 1, block_size=128, **LLAMA3_8B)
    assert 64 * seq["total_bytes"] == rep["total_bytes"] and 64 * seq["fp16_bytes"] == rep["fp16_bytes"]


def test_llama3_8b_targets():
    """The capacity targets: 64 x 2K tokens at >= 4.0x fp16's tokens (the int8 sink and tail), 32K-token
    sequences at >= 4.6x (the default)."""
    assert _llama_pool("kvarn_k4v2_g128_hpint8", 64, 2048)["capacity_vs_fp16"] >= 4.0
    assert _llama_pool("kvarn_k4v2_g128", 64, 32768)["capacity_vs_fp16"] >= 4.6
    # before: sink and tail in the model dtype, each sequence's sink and last block also holding pages
    before = (16 * 128 * 108 + 2 * 128 * 512) * 8 * 32
    assert 2048 * FP16_PER_TOKEN / before == pytest.approx(2.98, abs=0.005)


def test_per_sequence_functions():
    kw = dict(block_size=128, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert hp_bytes_per_seq("kvarn_k4v2_g128", **kw) == 2 * 128 * 8 * 512
    assert hp_bytes_per_seq("kvarn_k4v2_g128_hpint8_sink16", **kw) == (16 + 128) * 8 * 264
    assert hp_bytes_per_seq("kvarn_k4v2_g128_hpfp32", tail_blocks=2, **kw) == 3 * 128 * 8 * 1024
    assert hp_bytes_per_seq("fp16", **kw) == 0
    # pages: every block but the last, and but the first with a whole-block sink
    assert [page_blocks("kvarn_k4v2_g128", t, 128) for t in (1, 128, 129, 256, 257)] == [0, 0, 0, 0, 1]
    assert [page_blocks("kvarn_k4v2_g128_sink16", t, 128) for t in (1, 128, 129, 257)] == [0, 0, 1, 2]
    assert [page_blocks("int8_sink4", t, 128) for t in (1, 129)] == [0, 1]
    assert [page_blocks("fp16", t, 128) for t in (1, 129)] == [1, 2]


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def tiny_model():
    return Decoder(TINY, rngs=nnx.Rngs(7), init_std=0.2)


def test_engine_report_equals_the_abstract_pool(tiny_model):
    for scheme in ("kvarn_k4v2_g32", "int8_hpint8_sink8", "fp16"):
        eng = Engine(tiny_model, kv_cache_dtype=scheme, **KW)
        got = eng.memory_report()
        want = pool_memory_report(scheme, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                                  max_seqs=KW["max_seqs"], max_model_len=KW["max_model_len"],
                                  block_size=KW["block_size"])
        assert {k: got[k] for k in want} == want
        # 4 sequences of 96 tokens (3 blocks): 1 page each with a whole-block sink, 2 with a short sink
        assert eng.pool().num_blocks == {"kvarn_k4v2_g32": 4, "int8_hpint8_sink8": 8, "fp16": 12}[scheme]
        assert got["tokens"] == 4 * 96


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32_hpint8", "kvarn_k4v2_g32_sink8", "int4_hpint8_sink4"])
def test_engine_serves_the_options_as_the_model_does(tiny_model, rng, scheme):
    """Greedy tokens of a batch (chunked prefill, decode, commits, blocks without pages, poisoned
    pools) equal the model's own prefill/decode over a cache with every page."""
    prompts = _prompts(rng, [20, 70])
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eng = Engine(tiny_model, kv_cache_dtype=scheme, **KW)
    _poison(eng, scheme)
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    pool = eng.pool()
    held = {s.request_id: s.blocks for s in pool.running}
    whole_sink = not kj.parse(scheme).sink_tokens
    for rid, p in zip(ids, prompts):
        n = -(-(len(p) + 9) // 32)
        want = [NO_PAGE if (j == 0 and whole_sink) or j == n - 1 else 0 for j in range(n)]
        assert [NO_PAGE if b == NO_PAGE else 0 for b in held[rid]] == want
    done = eng.run()
    assert pool.blocks.num_free == pool.num_blocks == pool_blocks(kj.parse(scheme), max_seqs=4, max_model_len=96,
                                                                  block_size=32)
    assert int(pool.caches.dropped_tokens) == 0
    for rid, p in zip(ids, prompts):
        assert done[rid].output_ids == greedy_direct(tiny_model, scheme, p, 10)


def test_a_request_needs_pages_only_for_paged_blocks(tiny_model):
    # 3 pages: a 90-token request (3 blocks) takes 1 with a whole-block sink, 2 with a short one
    eng = Engine(tiny_model, kv_cache_dtype="kvarn_k4v2_g32", **{**KW, "num_blocks": 1})
    assert eng.pages_needed(80, 11) == 1 and eng.pages_needed(80, 11, kv_cache_dtype="int8_sink4") == 2
    assert eng.pages_needed(80, 11, kv_cache_dtype="fp16") == 3 and eng.pages_needed(10, 5) == 0
    eng.generate([list(range(4, 84))], SamplingParams(max_new_tokens=11, ignore_eos=True))
    with pytest.raises(ValueError, match="needs 2 pages .* num_blocks=1"):
        eng.add_request(list(range(4, 84)), SamplingParams(max_new_tokens=11), kv_cache_dtype="int8_sink4")
    np.testing.assert_equal(eng.pool().blocks.num_free, 1)
