"""Fused paged decode attention for GPUs in Pallas (Triton lowering; any backend with interpret=True).
Oracle: `attention/reference.py`.

One program per (sequence, kv head, split) walks its share of a sequence's quantized tiles, reading
codes and scales straight from the pages, with an fp32 online softmax for the query heads of its kv
head; split 0 also covers the high-precision sink and tail. The splits are merged afterwards
(flash-decoding), or, with one split, the program finishes its output itself. Scales stay out of
the inner products (docs/design.md §3).

Modules, by concern:
    unpack        packed codes -> fp16 (jnp and PTX)
    layout        the per-scheme layout plan of the inner loop, and block helpers
    kernel        the program
    launch        `Launch` options and the rules that fill them in
    launch_table  the tuning data those rules read, per GPU family
    merge         merging the splits (jnp and a Pallas kernel)
    entry         `paged_decode_pallas`, the kernel entry

docs/kernels.md describes the kernel and the measurements behind its layouts and launch rules.
"""

from .entry import paged_decode_pallas, supports
from .kernel import NEG
from .launch import (CallShape, Launch, default_chunk, default_launch, default_merge, default_num_splits,
                     default_orient, default_q_in_kernel, default_stages, programs_per_sm, resolve_launch)
from .launch_table import HOPPER, LAUNCH_TABLES, LaunchTable, is_measured, launch_table
from .layout import LayoutPlan, group_rows, tokens_major_unsupported, value_planes

__all__ = [
    "paged_decode_pallas", "supports", "Launch", "CallShape", "resolve_launch", "LaunchTable", "HOPPER",
    "LAUNCH_TABLES", "launch_table", "is_measured", "default_orient", "default_chunk", "default_launch",
    "default_stages", "default_q_in_kernel", "default_merge", "programs_per_sm", "default_num_splits",
    "LayoutPlan", "group_rows", "value_planes", "tokens_major_unsupported", "NEG",
]
