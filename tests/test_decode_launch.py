"""The GPU decode kernel's launch: the tuning table follows the device it runs on (its SM count, its
family), and `resolve_launch` decides every option the caller leaves open. No kernel runs here."""

import dataclasses
import types

import pytest

import kvarn_jax as kj
from kvarn_jax.attention import paged_decode_pallas as pdp


def gpu(compute_capability="9.0", core_count=132):
    return types.SimpleNamespace(platform="gpu", compute_capability=compute_capability, core_count=core_count)


def test_table_reads_the_sm_count_from_the_device():
    assert pdp.launch_table(gpu()) == pdp.HOPPER
    assert pdp.launch_table(types.SimpleNamespace(platform="cpu")) == pdp.HOPPER  # interpreted: as measured
    h100_pcie = pdp.launch_table(gpu(core_count=114))
    assert h100_pcie.num_sms == 114 and h100_pcie.tiled_latency == pdp.HOPPER.tiled_latency
    cfg = kj.parse("kvarn_k4v2_g128")
    # the small-batch launch holds below one (sequence, kv head) pair per SM: 15 x 8 = 120 pairs
    assert pdp.default_launch(cfg, 15, 8, table=pdp.HOPPER) == (2, 128)
    assert pdp.default_launch(cfg, 15, 8, table=h100_pcie) == (1, None)
    assert pdp.default_launch(cfg, 14, 8, table=h100_pcie) == (2, 128)
    # a wave is the SM count times the programs that fit one SM
    big = 1 << 20
    assert pdp.default_num_splits(32, 8, big, 1, None, table=pdp.HOPPER) == 132 * 8 // 256
    # 8 pairs: four waves of programs, capped at a quarter of a wave per pair
    assert pdp.default_num_splits(1, 8, big, 1, None, table=h100_pcie) == 114 * 8 // 4
    assert pdp.default_num_splits(1, 8, big, 1, None, table=pdp.HOPPER) == 132 * 8 // 4
    # short contexts: splits of at least `min_tiles_per_split` (2) tiles. SmolLM2's 32 x 3 pairs at
    # 2K tokens (16 tiles): 8 splits (4 with 4 tiles a split, 1.2x slower on an H100)
    assert pdp.HOPPER.min_tiles_per_split == 2
    assert pdp.default_num_splits(32, 3, 16, 2, 128, table=pdp.HOPPER) == 8
    assert pdp.default_num_splits(1, 8, 32, 2, 128, table=pdp.HOPPER) == 16


def test_unmeasured_family_gets_hoppers_numbers_and_says_so():
    ampere = pdp.launch_table(gpu("8.0", 108))
    assert dataclasses.replace(ampere, num_sms=132) == pdp.HOPPER
    assert not pdp.is_measured(gpu("8.0", 108)) and pdp.is_measured(gpu()) and pdp.is_measured(
        types.SimpleNamespace(platform="cpu"))


def test_merge_launch_reads_the_table():
    from kvarn_jax.attention.paged_decode_pallas import merge
    # heads-major merges aim for two programs per SM: fewer SMs, wider programs
    wide = merge.merge_launch(1, 8, 1, 16, 16, 128, -2, table=dataclasses.replace(pdp.HOPPER, num_sms=16))
    assert merge.merge_launch(1, 8, 1, 16, 16, 128, -2, table=pdp.HOPPER) == (16, 4, 4) and wide == (16, 32, 4)


@pytest.mark.parametrize("cfg,batch,ctx,want", [
    ("kvarn_k4v2_g128", 32, 32768, dict(num_warps=1, maxnreg=None, num_stages=3, orient="tokens", merge="pallas",
                                         q_in_kernel=True, chunk=None)),
    ("kvarn_k4v2_g128", 128, 4096, dict(num_splits=1, merge="kernel")),
    ("kvarn_k4v4_g128", 1, 131072, dict(num_warps=2, maxnreg=128, num_stages=2, merge="xla", q_in_kernel=False)),
    ("int8", 8, 16384, dict(num_warps=2, orient="tokens", chunk=128, fold="keys", sums="mma")),
    ("fp8", 8, 16384, dict(num_warps=2, orient="heads", chunk=128, fold="none", sums="reduce")),
])
def test_resolve_launch_decides_every_option(cfg, batch, ctx, want):
    shape = pdp.CallShape(batch=batch, q_heads=32, kv_heads=8, head_dim=128, block_size=128,
                          max_blocks=ctx // 128, interpret=False)
    run = pdp.resolve_launch(kj.parse(cfg), shape, pdp.Launch(), pdp.HOPPER)
    open_ok = {"maxnreg"} | ({"chunk"} if kj.parse(cfg).tile_tokens > 1 else set())
    assert all(v is not None for k, v in dataclasses.asdict(run).items() if k not in open_ok), run
    assert run.unpack == "asm" and run.num_splits >= 1
    assert {k: getattr(run, k) for k in want} == want
    # an explicit option is kept; the resolved launch resolves to itself
    assert pdp.resolve_launch(kj.parse(cfg), shape, pdp.Launch(num_splits=3), pdp.HOPPER).num_splits == 3
    assert pdp.resolve_launch(kj.parse(cfg), shape, run, pdp.HOPPER) == run


def test_wide_caches_take_their_own_tiled_launch():
    """A bf16/fp32 cache (CallShape.wide) takes `tiled_wide` where an fp16 cache takes `tiled`, with
    two stages (the read-ahead is the one-warp launch's), and narrows by the bound; launches that
    are not `tiled` (a batch below the SM count: `tiled_latency`) do not depend on the dtype."""
    cfg = kj.parse("kvarn_k4v2_g128")

    def run(batch, wide, max_blocks=64, launch=pdp.Launch()):
        return pdp.resolve_launch(cfg, pdp.CallShape(batch=batch, q_heads=32, kv_heads=8, head_dim=128, block_size=128,
                                                     max_blocks=max_blocks, interpret=False, wide=wide), launch, pdp.HOPPER)
    narrow, wide = run(32, False), run(32, True)
    assert (narrow.num_warps, narrow.maxnreg, narrow.num_stages) == (*pdp.HOPPER.tiled, 3)
    assert (wide.num_warps, wide.maxnreg, wide.num_stages) == (*pdp.HOPPER.tiled_wide, 2)
    assert wide.narrow == "bound" and pdp.HOPPER.tiled_wide != pdp.HOPPER.tiled
    assert run(4, True) == run(4, False)
    # uncapped, in the splits rule's count: the launch the Llama-3-8B engine step ran fastest with
    # (2 splits at 32 x 8K; capped at 128 registers in 3 splits the step was 2% slower on an H100)
    assert wide.maxnreg is None and wide.num_splits == 2
    assert wide.num_splits == pdp.default_num_splits(32, 8, 64, *pdp.HOPPER.tiled_wide, pdp.HOPPER)
    assert wide.merge == "pallas" and narrow.num_splits == 4
    # at most one split per two tiles; an explicit count keeps its own
    assert run(32, True, max_blocks=2).num_splits == 1
    assert run(32, True, launch=pdp.Launch(num_splits=3)).num_splits == 3


def test_resolve_launch_names_the_bad_option():
    shape = pdp.CallShape(batch=1, q_heads=4, kv_heads=1, head_dim=64, block_size=32, max_blocks=2, interpret=True)
    cfg = kj.parse("kvarn_k4v2_g32")
    with pytest.raises(ValueError, match="unpack must be 'magic' or \\(compiled only\\) 'asm'"):
        pdp.resolve_launch(cfg, shape, pdp.Launch(unpack="asm"), pdp.HOPPER)
    with pytest.raises(ValueError, match="merge must be 'xla', 'pallas' or 'kernel', got 'host'"):
        pdp.resolve_launch(cfg, shape, pdp.Launch(merge="host"), pdp.HOPPER)
    with pytest.raises(ValueError, match="chunk \\(tokens per step of a per-token scheme\\)"):
        pdp.resolve_launch(cfg, shape, pdp.Launch(chunk=64), pdp.HOPPER)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pdp.Launch().num_warps = 2
    assert hash(pdp.Launch(num_warps=2)) == hash(pdp.Launch(num_warps=2))  # static under jit
