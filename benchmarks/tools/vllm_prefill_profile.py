"""Where the plugin's prefill of one long prompt goes, offline (an in-process `vllm.LLM`).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/tools/vllm_prefill_profile.py --tokens 8100 [--scheme kvarn_k4v2_g128]

Per step (vLLM chunks the prompt): wall time, the bridge's time in each piece of a prefill layer
(`torch_ops` functions wrapped with timers), and XLA compilations (count and seconds, from JAX's
monitoring events). --scheme none runs stock vLLM (step wall times only). Runs the prompt --runs
times: the first compiles the shapes of its chunks.
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--scheme", default="kvarn_k4v2_g128", help="a kvarn scheme, or none for stock vLLM")
    p.add_argument("--tokens", type=int, default=8100)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", default="")
    a = p.parse_args()
    import jax
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from vllm_serve import _prompts, resolve_model
    a = resolve_model(a)
    _, ids = _prompts(a.model, [8], a.tokens)

    compiles = collections.Counter()

    def on_duration(event, duration_secs, **kw):
        if "backend_compile" in event or "jaxpr_to_mlir" in event or "compile" in event:
            compiles[event] += 1
            compiles[event + "_s"] += duration_secs
    jax.monitoring.register_event_duration_secs_listener(on_duration)

    timers = collections.defaultdict(float)
    calls = collections.Counter()
    if a.scheme != "none":
        from kvarn_vllm import impl as kimpl, torch_ops
        from vllm import _custom_ops as vllm_ops
        names = ["_write_jax", "_prefill_rule", "_rule_inputs", "_write_step", "_before", "_served", "_prefill_rows"]

        def wrap(mod, name):
            f = getattr(mod, name, None)
            if f is None:
                return

            def w(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return f(*args, **kw)
                finally:
                    timers[name] += time.perf_counter() - t0
                    calls[name] += 1
            setattr(mod, name, w)
        for n in names:
            wrap(torch_ops, n)
        for n in ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache"):  # inside _prefill_rule
            wrap(vllm_ops, n)
        fwd = kimpl.KvarnAttentionImpl.forward

        def forward(self, *args, **kw):
            t0 = time.perf_counter()
            try:
                return fwd(self, *args, **kw)
            finally:
                timers["layer_forward"] += time.perf_counter() - t0
                calls["layer_forward"] += 1
        kimpl.KvarnAttentionImpl.forward = forward
        from kvarn_vllm import hp_pool
        for n in ("gather", "scatter"):
            g = getattr(hp_pool.HpPool, n)

            def mk(g=g, n=n):
                def w(self, *args, **kw):
                    t0 = time.perf_counter()
                    try:
                        return g(self, *args, **kw)
                    finally:
                        timers["hp_" + n] += time.perf_counter() - t0
                return w
            setattr(hp_pool.HpPool, n, mk())

    from vllm import LLM, SamplingParams
    kw = {} if a.scheme == "none" else {"additional_config": {"kvarn_kv_cache_dtype": a.scheme}}
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    llm = LLM(model=a.model, enable_prefix_caching=False, max_num_seqs=8, max_model_len=8192, **kw)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    out = {"scheme": a.scheme, "tokens": a.tokens, "runs": []}
    for run in range(a.runs):
        timers.clear()
        calls.clear()
        compiles.clear()
        engine.add_request(f"r{run}", {"prompt_token_ids": list(ids)}, sp)
        steps = []
        t_all = time.perf_counter()
        while engine.has_unfinished_requests():
            before = dict(timers)
            c_before = dict(compiles)
            t0 = time.perf_counter()
            res = engine.step()
            dt = time.perf_counter() - t0
            steps.append({"wall_s": round(dt, 3),
                          **{k: round(v - before.get(k, 0.0), 3) for k, v in timers.items() if v - before.get(k, 0.0) > 1e-3},
                          "compiles": {k: (round(v - c_before.get(k, 0), 3)) for k, v in compiles.items()
                                       if v != c_before.get(k, 0)}})
            print(f"run {run} step {len(steps)}: {json.dumps(steps[-1])}", flush=True)
            if res and res[0].finished:
                text = res[0].outputs[0].token_ids
        total = time.perf_counter() - t_all
        print(f"run {run}: {total:.2f} s, tokens {text}; totals {dict(timers)} calls {dict(calls)} "
              f"compiles {dict(compiles)}", flush=True)
        out["runs"].append({"total_s": total, "steps": steps, "timers": dict(timers), "calls": dict(calls),
                            "compiles": dict(compiles), "tokens": list(text)})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
