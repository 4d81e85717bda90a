"""How the GPU decode kernel runs a call: the `Launch` options and the rules that fill in the ones
left open, reading a device's `LaunchTable`. Every option gives the same results up to fp32 rounding
(tested); only speed differs, and the rules pick what measured fastest (docs/kernels.md)."""

from __future__ import annotations

import dataclasses

from ... import triton_options
from ...config import KVQuantConfig
from ...validation import is_power_of_two
from . import merge as split_merge
from .launch_table import LaunchTable, launch_table
from .layout import group_rows, tokens_major_unsupported


@dataclasses.dataclass(frozen=True)
class Launch:
    """Layout and launch options of one kernel call; None leaves an option to the rules
    (`resolve_launch`). Static under jit (frozen, hashable).

    num_splits: programs per (sequence, kv head) along the KV length.
    num_warps, maxnreg, num_stages: Triton launch options; maxnreg caps the registers per thread
      (`triton_options`); from 3 stages on the tile loop reads its block ids ahead.
    unpack: "asm" (PTX, compiled only) or "magic" (jnp) - how codes become fp16 (`unpack.py`).
    orient: "tokens" or "heads" - the products' layout (`layout.py`).
    fold: tokens-major, integer codes: which products take the codes biased (magic + code,
      `unpack.magic`) and subtract magic times the other operand's sum from their result: "keys"
      (the default; True means the same), "all" (the value products too) or "none" (False).
      The value products are exact only unbiased: the matrix unit aligns the products it adds to the
      largest and truncates the rest, so 2^10 + code (2-bit values: 680x the code) loses the codes'
      low bits in a bias of one sign. Every tile adds the same relative bias, which the value zero
      point's term no longer cancels: on the H200 kvarn_k4v2_g128 drifted from the reference as the
      context grew (0.9% at 4K, 5.0% at 128K tokens, relative L2), as the bias ~ magnitude of one
      value over the output ~ 1/sqrt(context). A key's score bias is one per tile and token class,
      a perturbation of the softmax that does not grow with the context.
    sums: tokens-major: "mma" (zero-point and fold sums as products with a ones matrix) or "reduce".
    parts, steps: tokens-major tiled schemes: walk each tile in `parts` parts per loop iteration,
      over `steps` iterations.
    merge: "xla", "pallas" (`merge.py`) or "kernel" (one split, the kernel finishes its output).
    chunk: per-token schemes: tokens per step of the tile loop.
    q_in_kernel: read the GQA group's query rows in the kernel rather than from a copy padded in XLA.
    narrow: bf16/fp32 caches (`layout.Narrowed`): the power of two that brings a product's operand
      into fp16's range, from the operand's own maximum ("max", a reduction over it per tile) or,
      for the tiled schemes' scaled query and probabilities, from a bound - the query's maximum (once
      per program) or 1 (probabilities) times the maximum of the tile's scale vector ("bound": a
      reduction over that vector only; the default). Both give 1, the same bits, while the bound is
      below 2^15.
    """

    num_splits: int | None = None
    num_warps: int | None = None
    maxnreg: int | None = None
    num_stages: int | None = None
    unpack: str | None = None
    orient: str | None = None
    fold: bool | str | None = None
    sums: str | None = None
    parts: int = 1
    steps: int = 1
    merge: str | None = None
    chunk: int | None = None
    q_in_kernel: bool | None = None
    narrow: str | None = None


# ----------------------------------------------------------------------------- the rules
def default_orient(cfg: KVQuantConfig, head_dim: int | None = None) -> str:
    """"tokens" for the tiled schemes (KVarN, KIVI) and for int schemes with one dynamic scale per
    token; "heads" for fp8, grouped or static int scales and passthrough. head_dim: where the
    scheme's channel group is given explicitly, whether it spans the head (None: only schemes
    without one count as one scale per token)."""
    if cfg.method in ("kvarn", "kivi"):
        return "tokens"
    if cfg.method == "int" and not cfg.static and (
            not cfg.group if head_dim is None else tokens_major_unsupported(cfg, head_dim) is None):
        return "tokens"
    return "heads"


def default_chunk(cfg: KVQuantConfig, head_dim: int | None = None, orient: str | None = None,
                  table: LaunchTable | None = None) -> int:
    """Tokens per step of the tile loop: a tile for KVarN/KIVI; for per-token schemes the table's
    `step_tokens` for int codes tokens-major and fp8 heads-major, else its `chunk_tokens`."""
    table = table or launch_table()
    if cfg.tile_tokens > 1:
        return cfg.tile_tokens
    o = orient or default_orient(cfg, head_dim)
    if (cfg.method == "int" and o == "tokens") or (cfg.method == "fp8" and o == "heads"):
        return table.step_tokens
    return table.chunk_tokens


def default_launch(cfg: KVQuantConfig, batch: int, num_kv_heads: int, orient: str | None = None,
                   parts: int = 1, steps: int = 1, chunk: int | None = None,
                   table: LaunchTable | None = None, wide: bool = False) -> tuple[int, int | None]:
    """(num_warps, maxnreg) per program. KVarN/KIVI tokens-major whole tiles: `tiled_latency` for
    4-bit values and for <= 2-bit values with fewer (sequence, kv head) pairs than SMs, else
    `tiled` (`tiled_wide` for a bf16/fp32 cache: wide). Per-token schemes: `per_token_step` when
    they step `step_tokens` tokens (chunk: the step if not that), else `per_token_grouped_8bit` or
    `per_token`."""
    table = table or launch_table()
    if cfg.method in ("kvarn", "kivi"):
        whole = (orient or default_orient(cfg)) == "tokens" and parts == 1 and steps == 1
        pairs = batch * num_kv_heads
        if whole and (cfg.v_bits == 4 or (cfg.v_bits <= 2 and pairs < table.num_sms)):
            return table.tiled_latency
        return table.tiled_wide if wide else table.tiled
    if default_chunk(cfg, None, orient, table) >= table.step_tokens and (chunk or table.step_tokens) >= table.step_tokens:
        return table.per_token_step
    heads = (orient or default_orient(cfg)) == "heads"
    grouped_8bit = cfg.method == "int" and cfg.k_bits == 8 and cfg.v_bits == 8 and (cfg.static or bool(cfg.group))
    return table.per_token_grouped_8bit if heads and grouped_8bit else table.per_token


def default_stages(cfg: KVQuantConfig, batch: int, num_kv_heads: int, head_dim: int, orient: str | None = None,
                   parts: int = 1, steps: int = 1, table: LaunchTable | None = None, wide: bool = False) -> int:
    """Pipeline stages of the default launch: `read_ahead_stages` where `default_launch` gives
    KVarN's whole tokens-major tiles of at most `read_ahead_tile_elements` the `tiled` launch, else 2."""
    table = table or launch_table()
    if cfg.method != "kvarn" or cfg.tile_tokens * head_dim > table.read_ahead_tile_elements or parts != 1 or steps != 1:
        return 2
    if (orient or default_orient(cfg, head_dim)) != "tokens":
        return 2
    tiled = default_launch(cfg, batch, num_kv_heads, orient, parts, steps, table=table, wide=wide) == table.tiled
    return table.read_ahead_stages if tiled else 2


def default_q_in_kernel(cfg: KVQuantConfig) -> bool:
    """Whether the kernel reads the query itself by default: KVarN with 2-bit values."""
    return cfg.method == "kvarn" and cfg.v_bits == 2


def default_merge(cfg: KVQuantConfig) -> str:
    """How splits are merged by default: "pallas" for KVarN with 2-bit values, else "xla". (With
    one split and a GQA group that is a power of two >= 2 nothing is merged: "kernel".)"""
    return "pallas" if cfg.method == "kvarn" and cfg.v_bits == 2 else "xla"


def programs_per_sm(num_warps: int, maxnreg: int | None = None, table: LaunchTable | None = None) -> int:
    """Programs that fit one SM at once. Uncapped, our kernels take ~255 registers per thread:
    `uncapped_warps_per_sm` warps' worth of programs, at least `min_programs_per_sm` (wider programs
    use fewer registers). Capped, the register file decides, up to `max_programs_per_sm`."""
    table = table or launch_table()
    if maxnreg is None:
        return max(table.min_programs_per_sm, table.uncapped_warps_per_sm // max(1, num_warps))
    step = table.register_step
    per_scheduler = table.registers_per_scheduler // (-(-maxnreg // step) * step * 32)
    return max(1, min(table.schedulers_per_sm * per_scheduler // max(1, num_warps), table.max_programs_per_sm))


def default_num_splits(batch: int, num_kv_heads: int, max_tiles: int, num_warps: int = 2,
                       maxnreg: int | None = None, table: LaunchTable | None = None) -> int:
    """Splits of each sequence's tiles along the KV length. A wave is num_sms x `programs_per_sm`
    programs. With at least as many (sequence, kv head) pairs as SMs: as many splits as still fit
    one wave; with fewer: about `small_batch_waves` waves of programs of at least
    `min_tiles_per_split` tiles each, a pair's splits at most 1 / `max_wave_share` of a wave."""
    table = table or launch_table()
    wave = table.num_sms * programs_per_sm(num_warps, maxnreg, table)
    pairs = max(1, batch * num_kv_heads)
    want = max(1, wave // pairs) if pairs >= table.num_sms else -(-table.small_batch_waves * wave // pairs)
    return int(max(1, min(want, max_tiles // table.min_tiles_per_split, wave // table.max_wave_share)))


# ----------------------------------------------------------------------------- resolution
@dataclasses.dataclass(frozen=True)
class CallShape:
    """What of a call the rules look at: batch B, query heads Hq, kv heads Hk, head_dim D, block
    size, block-table columns, whether the kernel runs interpreted, and whether the cache is bf16 or
    fp32 (wide: the kernel's products narrow their operands, `layout.Narrowed`)."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int
    interpret: bool
    wide: bool = False


def resolve_launch(cfg: KVQuantConfig, shape: CallShape, launch: Launch = Launch(),
                   table: LaunchTable | None = None) -> Launch:
    """`launch` with every option decided (chunk: a per-token scheme's tokens per step, None for
    tiled schemes, which step by their tiles; q_in_kernel: whether the kernel reads the query itself
    in this call). Resolving the result again gives it back. Raises ValueError naming the option for
    combinations the kernel does not take."""
    table = table or launch_table()
    interpret, d, hk = shape.interpret, shape.head_dim, shape.kv_heads
    unpack = launch.unpack or ("magic" if interpret else "asm")
    if unpack not in ("magic", "asm") or (unpack == "asm" and interpret):
        raise ValueError(f"unpack must be 'magic' or (compiled only) 'asm', got {unpack!r} (interpret={interpret})")
    orient = launch.orient or default_orient(cfg, d)
    tiled = cfg.method in ("kvarn", "kivi")
    why_not = tokens_major_unsupported(cfg, d) if orient == "tokens" else None
    if orient not in ("heads", "tokens") or why_not:
        raise ValueError(f"orient must be 'heads' or 'tokens', got {orient!r} for {cfg.name}"
                         + (f" ({why_not})" if why_not else ""))
    tokens_major = orient == "tokens"
    fold, parts, steps = launch.fold, launch.parts, launch.steps
    fold = {True: "keys", False: "none"}.get(fold, fold) if isinstance(fold, bool) else fold
    if fold not in (None, "none", "keys", "all"):
        raise ValueError(f"fold must be 'keys', 'all', 'none' (or True / False), got {launch.fold!r}")
    if tokens_major and not tiled and (parts != 1 or steps != 1 or (fold not in (None, "none") and cfg.method == "fp8")):
        raise ValueError(f"parts and steps apply to the tiled schemes' tokens-major products only, fold to "
                         f"integer codes (got fold={fold}, parts={parts}, steps={steps} for {cfg.name})")
    if fold is None:
        fold = "keys" if tokens_major and (tiled or cfg.method == "int") else "none"
    sums = launch.sums or ("mma" if tokens_major else "reduce")
    merge = default_merge(cfg) if launch.merge is None else launch.merge
    if merge not in ("xla", "pallas", "kernel"):
        raise ValueError(f"merge must be 'xla', 'pallas' or 'kernel', got {merge!r}")
    if sums not in ("reduce", "mma"):
        raise ValueError(f"sums must be 'reduce' or 'mma', got {sums!r}")
    if (fold != "none" or parts != 1 or steps != 1 or sums != "reduce") and not tokens_major:
        raise ValueError(f"fold, parts, steps and sums apply to orient='tokens' only (got fold={fold}, parts={parts}, steps={steps}, "
                         f"sums={sums!r})")
    n_parts = parts * steps
    if tokens_major and tiled and (parts < 1 or steps < 1 or cfg.tile_tokens % n_parts
                                   or (cfg.tile_tokens // n_parts) % (8 // cfg.k_bits)):
        raise ValueError(f"parts={parts} x steps={steps} must divide the {cfg.tile_tokens}-token tile into whole "
                         f"bytes of key codes")
    chunk = launch.chunk
    if chunk is not None and (cfg.tile_tokens > 1 or not is_power_of_two(chunk) or chunk < 16):
        raise ValueError(f"chunk (tokens per step of a per-token scheme) must be a power of two >= 16, for "
                         f"per-token schemes only; got {chunk} for {cfg.name}")
    # tokens per step of the tile loop: a tile, or a chunk of a block for per-token schemes
    t_tok = cfg.tile_tokens if tiled else min(chunk or default_chunk(cfg, d, orient, table), shape.block_size)
    maxnreg = launch.maxnreg
    if launch.num_warps is None:  # the default launch; its register cap applies unless one is given
        warps, cap = default_launch(cfg, shape.batch, hk, orient, parts, steps, None if tiled else t_tok, table,
                                    shape.wide)
        if cap is not None and (interpret or not triton_options.available()):
            # interpreted, launch options change nothing (and need no lowering hook); without the
            # hook no cap can be set, and uncapped two-warp programs were slower than one warp
            warps, cap = 1, None
        maxnreg = cap if maxnreg is None else maxnreg
    else:
        warps = launch.num_warps
    num_stages = launch.num_stages
    if num_stages is None:
        num_stages = (default_stages(cfg, shape.batch, hk, d, orient, parts, steps, table, shape.wide)
                      if launch.num_warps is None else 2)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    grp = shape.q_heads // hk
    gp, written = group_rows(grp, tokens_major)
    splits = launch.num_splits or default_num_splits(shape.batch, hk, shape.max_blocks * (shape.block_size // t_tok),
                                                     warps, maxnreg, table)
    if merge == "pallas" and not launch.num_splits:  # a power of two: the merge then reads no padding
        splits = split_merge.unpadded_splits(splits)
    # One split and a GQA group that is a power of two: by default the kernel writes the final
    # output, with no merge kernel after it (merge="kernel"); an explicit merge keeps its own.
    if launch.merge is None and splits == 1 and written == grp:
        merge = "kernel"
    if merge == "kernel" and (splits != 1 or written != grp):
        raise ValueError(f"merge='kernel' needs one split and a GQA group that is a power of two >= 2 "
                         f"(got {splits} splits, {grp} query heads per kv head)")
    # The kernel reads its group's query rows itself, except for per-token keys split into channel
    # planes (they need the planes' copy) and fewer query heads than Gp (the masked rows would lie
    # past the block).
    q_in_kernel = default_q_in_kernel(cfg) if launch.q_in_kernel is None else launch.q_in_kernel
    key_planes = 8 // cfg.k_bits if cfg.method == "int" else 1
    q_in_kernel = bool(q_in_kernel) and key_planes == 1 and shape.q_heads >= gp
    # "bound" by default: the same bits while the bound is below 2^15, 10% faster on an H200 (bf16 cache)
    narrow = launch.narrow or "bound"
    if narrow not in ("max", "bound"):
        raise ValueError(f"narrow must be 'max' or 'bound', got {launch.narrow!r}")
    return Launch(num_splits=splits, num_warps=warps, maxnreg=maxnreg, num_stages=num_stages, unpack=unpack,
                  orient=orient, fold=fold, sums=sums, parts=parts, steps=steps, merge=merge,
                  chunk=None if tiled else t_tok, q_in_kernel=q_in_kernel, narrow=narrow)
