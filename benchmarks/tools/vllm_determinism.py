"""Where two runs of the same requests part ways, offline (an in-process `vllm.LLM`, greedy).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/tools/vllm_determinism.py [--scheme kvarn_k4v2_g128]
        [--prompt-lens 5,40,120,250] [--max-tokens 16] [--alone]

Runs the batch (one request per --prompt-lens entry, prompts cut from the shipped text as
`benchmarks/vllm_serve.py` cuts them) --runs times, and with --alone each prompt by itself,
recording every attention layer call: the layer's inputs (q, k, v), what the cache holds for each
row before the call (a digest of its sink/tail rows and completed pages), the step's metadata (rows'
request ids, query starts and lengths, sequence lengths), the output, and the call's wall time
(mean per run, decode-only steps apart). For each request it then compares runs row by row (the
request's k-th step against its k-th step, layer by layer) and prints the first (step, layer) where
they differ and what differed there: the inputs (vLLM's side: the schedule or its own matrix
products), the cache (an earlier write), or with both the same the output (the attention).
--scheme none records vLLM's own attention (`CPUAttentionBackendImpl.forward`; no cache digest).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class Recorder:
    """Per run: a list of layer calls, each {step, layer, rows: [(req, q_start, q_len, seq_len)],
    q, k, v, out} (tensors cloned on the host)."""

    def __init__(self):
        self.times = collections.defaultdict(list)  # "decode" / "other": seconds per layer forward
        self.calls = None
        self.step = -1
        self.last_meta = None
        self.layer_of = {}

    def start(self):
        self.calls, self.step, self.last_meta = [], -1, None
        self.times.clear()

    def record(self, impl, query, key, value, output, meta, rows, n, cache=None):
        if self.calls is None:
            return
        if meta is not self.last_meta:
            self.step += 1
            self.last_meta = meta
        layer = self.layer_of.setdefault(id(impl), len(self.layer_of))
        rec = {name: x[:n].detach().clone().reshape(n, -1)
               for name, x in (("q", query), ("k", key), ("v", value), ("out", output))}
        self.calls.append({"step": self.step, "layer": layer, "rows": rows, "cache": cache, **rec})


def _req_rows(runner, qsl, seq_lens) -> list:
    ids = list(runner.input_batch.req_ids)
    return [(ids[r], int(qsl[r]), int(qsl[r + 1] - qsl[r]), int(seq_lens[r])) for r in range(len(seq_lens))]


def _cache_digests(impl, layer, kv_cache, plan) -> list:
    """Per row, before the layer's forward: a digest of what the cache holds for it - its sink and
    tail rows (the units of its high-precision blocks; none for a row starting its sequence) and its
    quantized pages (blocks 1 .. ctx // block_size - 1) - comparable across runs whatever block ids
    vLLM handed out."""
    import hashlib

    import torch
    from kvarn_vllm.hp_pool import HP_BLOCKS
    bound = impl._bind(layer, kv_cache)
    if bound.cfg.is_passthrough:
        return None
    hu, buf = impl.hp_pool._bound_units(bound)
    hb = plan.cache[HP_BLOCKS]
    out = []
    for r in range(plan.num_rows):
        h = hashlib.sha1()
        if plan.context[r]:  # a row starting its sequence reads zeros (hp_pool), not its blocks
            h.update(buf[hu.seq_units(hb[r:r + 1]).reshape(-1)].numpy().tobytes())
        full = int(plan.context[r]) // plan.block_size
        blocks = plan.block_table[r, 1:full].to(torch.int64) if full > 1 else plan.block_table[r, :0].to(torch.int64)
        for key in sorted(k for k in bound.views if k.startswith("pages.")):
            h.update(bound.views[key][blocks].contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


def install(rec: Recorder, scheme: str):
    from kvarn_jax.integrations.vllm_runner import find_model_runner
    if scheme != "none":
        from kvarn_vllm import impl as kimpl
        fwd = kimpl.KvarnAttentionImpl.forward

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            digests = None if attn_metadata is None else _cache_digests(self, layer, kv_cache, attn_metadata.plan)
            t0 = time.perf_counter()
            res = fwd(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            dt = time.perf_counter() - t0
            if attn_metadata is not None:
                p = attn_metadata.plan
                rec.times["decode" if p.num_decodes == p.num_rows else "other"].append(dt)
                qsl = list(p.q_start) + [p.num_tokens]
                rec.record(self, query, key, value, output, attn_metadata,
                           _req_rows(find_model_runner(), qsl, p.seq_len), p.num_tokens, digests)
            return res
        kimpl.KvarnAttentionImpl.forward = forward
    else:
        from vllm.v1.attention.backends import cpu_attn
        fwd = cpu_attn.CPUAttentionBackendImpl.forward

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            res = fwd(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            if attn_metadata is not None:
                n = attn_metadata.num_actual_tokens
                qsl = attn_metadata.query_start_loc.cpu().numpy()
                lens = attn_metadata.seq_lens.cpu().numpy()
                rec.record(self, query, key, value, output, attn_metadata,
                           _req_rows(find_model_runner(), qsl, lens[:len(qsl) - 1]), n)
            return res
        cpu_attn.CPUAttentionBackendImpl.forward = forward


def per_request(calls: list) -> dict:
    """{request: [(k-th step of the request, layer, q_len, seq_len, step, q, k, v, out rows, cache digest)]}."""
    out = collections.defaultdict(list)
    seen = collections.defaultdict(dict)
    for c in calls:
        for r, (rid, a, ql, sl) in enumerate(c["rows"]):
            kth = seen[rid].setdefault(c["step"], len(seen[rid]))
            digest = None if c["cache"] is None else c["cache"][r]
            out[rid].append((kth, c["layer"], ql, sl, c["step"],
                             *(c[x][a:a + ql] for x in ("q", "k", "v", "out")), digest))
    return out


def first_difference(a: list, b: list) -> dict | None:
    """The first (request step, layer) where two runs of one request differ, and what differed."""
    import torch
    for x, y in zip(a, b):
        kth, layer, ql, sl, step = x[:5]
        if (ql, sl) != (y[2], y[3]):
            return {"request_step": kth, "layer": layer, "what": "schedule", "a": (ql, sl), "b": (y[2], y[3])}
        diff = [name for name, u, v in zip("qkvo", x[5:9], y[5:9]) if not torch.equal(u, v)]
        if x[9] != y[9]:
            diff.append("cache")
        if diff:
            o = (x[8].float() - y[8].float()).abs().max().item()
            return {"request_step": kth, "layer": layer, "q_len": ql, "seq_len": sl, "steps": (step, y[4]),
                    "differ": diff, "inputs_equal": not set(diff) & {"q", "k", "v", "cache"}, "out_max_abs_diff": o}
    if len(a) != len(b):
        return {"what": "length", "a": len(a), "b": len(b)}
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--scheme", default="kvarn_k4v2_g128", help="a kvarn scheme, or none for vLLM's own attention")
    p.add_argument("--prompt-lens", default="5,40,120,250")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=2, help="runs of the whole batch")
    p.add_argument("--alone", action="store_true", help="also each prompt by itself")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from vllm_serve import offline_llm
    lens = [int(x) for x in a.prompt_lens.split(",")]
    rec = Recorder()
    install(rec, a.scheme)
    kw = {"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}
    llm, prompts = offline_llm(a, lens, dtype=a.dtype, **kw)
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine

    def run(name, which):
        rec.start()
        for i in which:
            engine.add_request(f"{name}-{i}", {"prompt_token_ids": list(prompts[i])}, sp)
        tokens = {}
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    tokens[int(r.request_id.split("-")[1])] = list(r.outputs[0].token_ids)
        dt = time.perf_counter() - t0
        by_req = {int(k.split("-")[1]): v for k, v in per_request(rec.calls).items()}
        layer_ms = {k: round(1e3 * sum(v) / len(v), 3) for k, v in rec.times.items() if v}
        print(f"{name}: {dt:.1f} s, {rec.step + 1} steps; mean layer forward ms {layer_ms}", flush=True)
        report["runs"].append({"name": name, "wall_s": dt, "steps": rec.step + 1, "layer_forward_ms": layer_ms,
                               "decode_layer_calls": len(rec.times["decode"])})
        return tokens, by_req

    report = {"scheme": a.scheme, "prompt_lens": lens, "max_tokens": a.max_tokens, "runs": [], "comparisons": []}
    runs = [run(f"batch{j}", range(len(prompts))) for j in range(a.runs)]

    def compare(label, x, y, reqs):
        for i in reqs:
            d = first_difference(x[1][i], y[1][i])
            same = x[0][i] == y[0][i]
            report["comparisons"].append({"what": label, "request": i, "prompt_len": lens[i], "tokens_equal": same,
                                          "first_difference": d})
            print(f"{label} request {i} ({lens[i]} tokens): tokens {'equal' if same else 'DIFFER'}; "
                  f"first difference: {d}", flush=True)

    for j in range(1, a.runs):
        compare(f"batch0 vs batch{j}", runs[0], runs[j], range(len(prompts)))
    if a.alone:
        for i in range(len(prompts)):
            compare("batch0 vs alone", runs[0], run(f"alone{i}", [i]), [i])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
