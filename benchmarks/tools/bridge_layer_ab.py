"""One decode (or prefill) layer of the vLLM bridge on the CPU, this checkout against another, in
one process.

    git archive <commit> bridge | tar -x -C /tmp/base
    python benchmarks/tools/bridge_layer_ab.py --against /tmp/base/bridge [--step prefill]

Both bridges (this one's `kvarn_vllm`, and the other imported as `kvarn_vllm_against`) get the same
pooled cache (the sink and tail in the sequences' own blocks, as vLLM's impl keeps them), prefilled
with the same prompts (default: `benchmarks/vllm_serve.py`'s batch lengths) on SmolLM2's attention
shapes in bfloat16, and time the same decode-only step (one token per prompt; --step prefill: all
the prompts' prefill as one step) through vLLM's impl path (the pool in place or staged,
`torch_ops.forward`), alternating bridges --rounds times (round 0 compiles, untimed). Reports the
median per bridge, their ratio and whether their outputs are the same bits.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time

import numpy as np
import torch


def load_bridge(folder: str | None, name: str):
    """The kvarn_vllm package under `folder`, imported as `name` (None: this checkout's)."""
    if folder is None:
        import kvarn_vllm
        return kvarn_vllm
    init = os.path.join(folder, "kvarn_vllm", "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Bridge:
    """One bridge's cache and pool, fed the same steps as the others."""

    def __init__(self, pkg_name: str, scheme: str, bs: int, lens: list, hk: int, d: int, dtype):
        self.m = {k: importlib.import_module(f"{pkg_name}.{k}") for k in ("torch_ops", "hp_pool", "layout", "plan")}
        lay = self.m["layout"].PageLayout(scheme, block_size=bs, num_kv_heads=hk, head_dim=d,
                                           dtype=str(dtype).split(".")[-1], max_seqs=len(lens))
        self.lay, self.bs = lay, bs
        h = lay.hp_blocks_per_seq
        need = [-(-(n + 8) // bs) for n in lens]
        n_blocks = sum(need) + h * len(lens) + 1
        page = lay.vllm_page_bytes(0)
        al = self.m["layout"].ALIGN
        raw = torch.zeros(n_blocks * page + al, dtype=torch.uint8)
        start = (-raw.data_ptr()) % al
        self.pool = self.m["hp_pool"].HpPool(lay, self.m["layout"].allocate_hp(lay, "cpu"))
        self.bound = self.m["torch_ops"].bind(raw[start:start + n_blocks * page].view(n_blocks, 1, bs, page // bs), lay,
                                              hp_buffers=self.pool.staging)
        ids = iter(range(n_blocks))
        self.pages = [[next(ids) for _ in range(k)] for k in need]
        self.hp = [[next(ids) for _ in range(h)] for _ in lens]
        self.width = max(need)

    def plan(self, rows):
        """rows: [(seq, context, new tokens)], decodes first."""
        hp = self.m["hp_pool"]
        bs = self.bs
        qsl = np.concatenate([[0], np.cumsum([n for _, _, n in rows])])
        table = torch.zeros((len(rows), self.width), dtype=torch.int32)
        slots = []
        for r, (s, c, n) in enumerate(rows):
            table[r, :len(self.pages[s])] = torch.tensor(self.pages[s])
            slots += [self.pages[s][p // bs] * bs + p % bs for p in range(c, c + n)]
        plan = self.m["plan"].StepPlan.build(block_size=bs, max_seqs=self.lay.max_seqs, query_start_loc=qsl,
                                             seq_lens=[c + n for _, c, n in rows], seq_ids=np.arange(len(rows)),
                                             block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64))
        plan.cache[hp.HP_BLOCKS] = torch.tensor([self.hp[s] for s, _, _ in rows], dtype=torch.int32)
        plan.cache[hp.HP_FRESH] = np.array([c == 0 for _, c, _ in rows])
        return plan

    def layer(self, plan, q, k, v, out):
        """What vLLM's impl runs for one layer (the pool used in place, or staged around the call)."""
        t = self.m["torch_ops"]
        pooled = self.pool.in_place(self.bound, plan, t.decode_impl("auto"))
        if pooled is None:
            self.pool.gather(self.bound, plan)
        t.forward(self.bound, q, k, v, plan, scale=q.shape[-1] ** -0.5, impl="auto", out=out, pooled=pooled)
        if pooled is None:
            self.pool.scatter(self.bound, plan)
        return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="a folder holding another commit's kvarn_vllm package")
    p.add_argument("--scheme", default="kvarn_k4v2_g128")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--prompt-lens", default="5,40,120,250,500,800,1100,1516")
    p.add_argument("--step", choices=["decode", "prefill"], default="decode",
                   help="the step timed: a decode token per prompt after their prefill, or their prefill")
    p.add_argument("--calls", type=int, default=50, help="layer calls per timing")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    lens = [int(x) for x in a.prompt_lens.split(",")]
    hk, hq, d, dtype = 3, 9, 64, torch.bfloat16  # SmolLM2-135M
    load_bridge(None, "kvarn_vllm")
    load_bridge(a.against, "kvarn_vllm_against")
    bridges = {"this": Bridge("kvarn_vllm", a.scheme, a.block_size, lens, hk, d, dtype),
               "against": Bridge("kvarn_vllm_against", a.scheme, a.block_size, lens, hk, d, dtype)}
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randn((n, h, d), generator=g).to(dtype) for h in (hq, hk, hk)) for n in lens]
    if a.step == "decode":
        step = [tuple(torch.randn((len(lens), h, d), generator=g).to(dtype) for h in (hq, hk, hk))]
        rows = [(s, n, 1) for s, n in enumerate(lens)]
        for b in bridges.values():  # each prompt prefilled alone, then one decode step (the one timed)
            for s, (q, k, v) in enumerate(prompts):
                b.layer(b.plan([(s, 0, lens[s])]), q, k, v, torch.empty_like(q))
    else:
        step = [tuple(torch.cat([x[i] for x in prompts]) for i in range(3))]
        rows = [(s, 0, n) for s, n in enumerate(lens)]
    outs, times = {}, {name: [] for name in bridges}
    for r in range(a.rounds + 1):
        for name, b in bridges.items():
            plan = b.plan(rows)
            q, k, v = step[0]
            out = torch.empty_like(q)
            t0 = time.perf_counter()
            for _ in range(a.calls):
                b.layer(plan, q, k, v, out)
            dt = (time.perf_counter() - t0) / a.calls
            if r:  # round 0 compiles
                times[name].append(dt * 1e3)
            outs[name] = out.clone()
    med = {name: statistics.median(t) for name, t in times.items()}
    res = {"scheme": a.scheme, "prompt_lens": lens, "step": a.step, "layer_ms_median": med,
           "layer_ms": times, "ratio": med["this"] / med["against"],
           "same_bits": bool(torch.equal(outs["this"], outs["against"])),
           "max_abs_diff": float((outs["this"].float() - outs["against"].float()).abs().max())}
    print({k: v for k, v in res.items() if k != "layer_ms"})
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
