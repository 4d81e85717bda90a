"""Tuning data of the GPU decode kernel and its split merge, per GPU family (keyed by compute
capability). Rules in `launch.py` read these numbers; docs/kernels.md ("Launch rules") gives the
measurements they come from. Only Hopper (sm_90) has been measured, on an H200 (the splits' tile
minimum and `tiled_wide` on an H100)."""

from __future__ import annotations

import dataclasses
import functools

import jax


@dataclasses.dataclass(frozen=True)
class LaunchTable:
    """What the launch rules need to know about one GPU family.

    num_sms: streaming multiprocessors; `launch_table()` replaces it with the count the device
      reports, so this value serves where no device is asked (interpreted runs, offline lowering).
    The SM's register file and what fits on it: `schedulers_per_sm` warp schedulers with
      `registers_per_scheduler` 32-bit registers each, allocated to a warp in steps of
      `register_step` per thread; uncapped programs (~255 registers per thread) fit
      `uncapped_warps_per_sm` warps, at least `min_programs_per_sm` programs; capped ones at most
      `max_programs_per_sm` (the shared memory of one-warp KVarN programs).
    Launches, (num_warps, maxnreg): `tiled_latency` for whole KVarN/KIVI tiles tokens-major with
      4-bit values or fewer (sequence, kv head) pairs than SMs; `tiled` for the other KVarN/KIVI
      launches (`tiled_wide` with a bf16/fp32 cache, on two warps: faster than one at 32 x 8192
      on an H100, 0.121 vs 0.159 ms with balanced KVarN tiles; capped at 128 registers in 3 splits
      the kernel alone took 0.110 ms, but the Llama-3-8B engine step 2% longer); per-token schemes `per_token_step` stepping
      `step_tokens` tokens (int codes tokens-major, fp8 heads-major), `per_token_grouped_8bit` (heads-major 8-bit keys and values
      with grouped or static scales), else `per_token`, stepping `chunk_tokens`.
    read_ahead_stages: pipeline stages of KVarN's one-warp whole-tile launch on tiles of at most
      `read_ahead_tile_elements` (tokens x head_dim); 3+ stages read block ids ahead, up to
      `ids_group` at a time. Other launches use 2.
    hp_chunk: tokens per step through the high-precision sink and tail (half under a register cap
      or with read-ahead stages).
    Splits: with fewer pairs than SMs, about `small_batch_waves` waves of programs of at least
      `min_tiles_per_split` tiles, a pair's at most 1 / `max_wave_share` of a wave.
    Merge (`merge.py`): heads-major partials in programs of about `merge_block` elements, at least
      `merge_programs_per_sm` programs per SM; tokens-major ones in programs of up to
      `tokens_merge_block` elements, one warp each, at least `tokens_merge_programs` programs.
    """

    measured_on: str
    num_sms: int
    schedulers_per_sm: int = 4
    registers_per_scheduler: int = 16384
    register_step: int = 8
    uncapped_warps_per_sm: int = 8
    min_programs_per_sm: int = 4
    max_programs_per_sm: int = 11
    tiled_latency: tuple[int, int | None] = (2, 128)
    tiled: tuple[int, int | None] = (1, None)
    tiled_wide: tuple[int, int | None] = (2, None)
    per_token_step: tuple[int, int | None] = (2, None)
    per_token_grouped_8bit: tuple[int, int | None] = (2, None)
    per_token: tuple[int, int | None] = (4, None)
    step_tokens: int = 128
    chunk_tokens: int = 64
    read_ahead_stages: int = 3
    read_ahead_tile_elements: int = 128 * 128
    ids_group: int = 128
    hp_chunk: int = 64
    small_batch_waves: int = 4
    min_tiles_per_split: int = 2
    max_wave_share: int = 4
    merge_block: int = 8192
    merge_programs_per_sm: int = 2
    tokens_merge_block: int = 4096
    tokens_merge_programs: int = 256


HOPPER = LaunchTable(measured_on="NVIDIA H200", num_sms=132)

# compute capability -> table. Families not listed get Hopper's numbers (only their SM count is
# their own): correct results, at a launch nobody measured there.
LAUNCH_TABLES = {"9.0": HOPPER}


@functools.lru_cache(maxsize=None)
def _table_for(compute_capability: str | None, num_sms: int | None) -> LaunchTable:
    table = LAUNCH_TABLES.get(compute_capability, HOPPER)
    return dataclasses.replace(table, num_sms=num_sms) if num_sms else table


def launch_table(device=None) -> LaunchTable:
    """The table of `device` (default: the first device), with the SM count it reports. Off a GPU
    (interpreted kernels, lowering without one) Hopper's table as it is."""
    device = device if device is not None else jax.devices()[0]
    if device.platform != "gpu":
        return HOPPER
    return _table_for(getattr(device, "compute_capability", None), getattr(device, "core_count", None))


def is_measured(device=None) -> bool:
    """Whether the launch table of `device` was measured on its GPU family (benchmarks report it)."""
    device = device if device is not None else jax.devices()[0]
    return device.platform != "gpu" or getattr(device, "compute_capability", None) in LAUNCH_TABLES
