"""Capacity of the high-precision sink/tail options, computed exactly (no device, no weights).

Two tables:
- engine pools (`kvarn_jax.serving.engine.pool_memory_report`): Llama-3-8B shapes (32 layers, 8 KV
  heads, head_dim 128, bf16), `--seqs` sequences of each `--context`, every scheme: the pool's bytes
  and its tokens against fp16's;
- a fixed KV budget with one high-precision row per possible sequence (how a serving layer that
  reserves rows for `max_num_seqs` up front spends it, as the vLLM bridge did before its requests held
  their rows in blocks of the pool): SmolLM2-135M shapes (30
  layers, 3 KV heads, head_dim 64, bf16), blocks left for pages against a bf16 cache's blocks.

    python benchmarks/hp_capacity.py --json capacity.json
"""

from __future__ import annotations

import argparse
import json

from kvarn_jax.cache.memory import bytes_per_token, hp_bytes_per_seq
from kvarn_jax.serving.engine import pool_memory_report

SCHEMES = ("kvarn_k4v2_g128", "kvarn_k4v2_g128_hpint8", "kvarn_k4v2_g128_sink16",
           "kvarn_k4v2_g128_hpint8_sink16")
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64)


def engine_rows(seqs: int, contexts, schemes, block_size: int) -> list:
    rows = []
    for context in contexts:
        for s in schemes:
            r = pool_memory_report(s, max_seqs=seqs, max_model_len=context, block_size=block_size, dtype="bfloat16",
                                   **LLAMA3_8B)
            rows.append({"scheme": s, "seqs": seqs, "context": context, "page_bytes": r["page_bytes"],
                         "hp_bytes": r["sink_bytes"] + r["tail_bytes"], "total_bytes": r["total_bytes"],
                         "fp16_bytes": r["fp16_bytes"], "capacity_vs_fp16": r["capacity_vs_fp16"]})
    return rows


def budget_rows(budgets_gib, max_seqs, schemes, block_size: int) -> list:
    m = SMOLLM2
    stock_block = block_size * m["num_kv_heads"] * m["head_dim"] * 4 * m["num_layers"]
    rows = []
    for gib in budgets_gib:
        budget = int(gib * 2 ** 30)
        for n in max_seqs:
            for s in schemes:
                page = bytes_per_token(s, m["head_dim"], "bfloat16") * block_size * m["num_kv_heads"] * m["num_layers"]
                hp = hp_bytes_per_seq(s, block_size=block_size, dtype="bfloat16", **m) * n
                blocks = max(0, budget - hp) // page
                rows.append({"budget_gib": gib, "max_num_seqs": n, "scheme": s, "hp_bytes": hp,
                             "blocks": int(blocks), "bf16_blocks": budget // stock_block,
                             "blocks_vs_bf16": blocks / (budget // stock_block),
                             "blocks_without_reserve": int(budget // page)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", default="2048,32768", help="comma-separated tokens per sequence")
    p.add_argument("--budget-gib", default="1,4", help="comma-separated KV budgets for the second table")
    p.add_argument("--max-num-seqs", default="128,256")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    eng = engine_rows(a.seqs, [int(x) for x in a.context.split(",")], SCHEMES, a.block_size)
    bud = budget_rows([float(x) for x in a.budget_gib.split(",")], [int(x) for x in a.max_num_seqs.split(",")],
                      SCHEMES, a.block_size)
    print(f"engine pools, Llama-3-8B shapes, {a.seqs} sequences:")
    for r in eng:
        print(f"  {r['context']:>6} tokens  {r['scheme']:<32} pages {r['page_bytes'] / 2 ** 30:7.2f} GiB  "
              f"sink+tail {r['hp_bytes'] / 2 ** 30:6.2f} GiB  {r['capacity_vs_fp16']:.3f}x fp16's tokens")
    print("KV budget with a high-precision row per possible sequence, SmolLM2 shapes:")
    for r in bud:
        print(f"  {r['budget_gib']:g} GiB  max_num_seqs {r['max_num_seqs']:>3}  {r['scheme']:<32} rows "
              f"{r['hp_bytes'] / 2 ** 30:5.2f} GiB  {r['blocks']:>5} blocks = {r['blocks_vs_bf16']:.2f}x bf16's "
              f"{r['bf16_blocks']} (no rows reserved: {r['blocks_without_reserve']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"engine_pools_llama3_8b": eng, "budget_smollm2": bud}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
