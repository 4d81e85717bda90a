"""Where the plugin's decode steps go, offline (an in-process `vllm.LLM`, the 8-request batch).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/tools/vllm_decode_profile.py [--scheme kvarn_k4v2_g128]
        [--runs 3] [--json out.json]

Sends `benchmarks/vllm_serve.py`'s batch (one request per --prompt-lens entry, greedy, --max-tokens
new tokens, ignore_eos) to one engine --runs times (the first compiles; its numbers are reported
but not averaged) and times every attention layer call: the layer's forward (decode-only steps
apart from the others) and, for the plugin, the pieces of a decode-only layer (`torch_ops` and
`hp_pool` functions wrapped with timers). --scheme none times vLLM's own attention
(`CPUAttentionBackendImpl.forward`). To compare two bridges, run it once per checkout, back to back,
with the other checkout's `bridge` first on PYTHONPATH; the generated token ids are in the JSON.
--replay N then times the last fused decode step's XLA computation N times in a row in the same
process (warm caches, no model in between), and each layer's last call in turn (each reads its own
cache, as in a step). The last run also reports its busiest threads' CPU
seconds (Linux).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PIECES = {"torch_ops": ["_decode_served", "_decode_step_served", "_write_jax", "_to_jax", "_to_torch",
                        "_decode_inputs", "_count_altered", "_qkv", "_store_step", "_hp_units", "_hp_rows",
                        "_native_decode", "_check_plan", "_check_tokens"],
          "hp_pool": []}


class Timers:
    def __init__(self):
        self.t = collections.defaultdict(float)
        self.n = collections.Counter()
        self.decode_layers: list = []
        self.other_layers: list = []
        self.last_decode = None
        self.layer_decode: dict = {}

    def clear(self):
        self.t.clear()
        self.n.clear()
        self.decode_layers, self.other_layers = [], []

    def wrap(self, owner, name, label=None):
        f = getattr(owner, name, None)
        if f is None:
            return
        label = label or name
        timers = self

        def w(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                timers.t[label] += time.perf_counter() - t0
                timers.n[label] += 1
        setattr(owner, name, w)


def thread_cpu_seconds() -> dict:
    """{thread id: (name, CPU seconds)} of this process's threads (Linux /proc; empty elsewhere)."""
    import glob
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for t in glob.glob("/proc/self/task/*"):
        try:
            name = open(t + "/comm").read().strip()
            stat = open(t + "/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        try:
            cpus = [x for x in open(t + "/status") if x.startswith("Cpus_allowed_list")][0].split()[1]
        except (OSError, IndexError):
            cpus = "?"
        out[os.path.basename(t)] = (f"{name} (cpus {cpus})", (int(stat[11]) + int(stat[12])) / tick)
    return out


def install(timers: Timers, scheme: str):
    if scheme == "none":
        from vllm.v1.attention.backends import cpu_attn
        fwd = cpu_attn.CPUAttentionBackendImpl.forward

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            t0 = time.perf_counter()
            res = fwd(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            if attn_metadata is not None:
                decode = attn_metadata.num_actual_tokens == attn_metadata.query_start_loc.shape[0] - 1
                (timers.decode_layers if decode else timers.other_layers).append(time.perf_counter() - t0)
            return res
        cpu_attn.CPUAttentionBackendImpl.forward = forward
        return
    from kvarn_vllm import hp_pool, impl as kimpl, torch_ops
    served = torch_ops._decode_served

    def keep_last(*args, **kw):  # the last fused decode step's arguments, for --replay
        if kw.get("q_heads") is not None:
            timers.last_decode = (args, kw)
            timers.layer_decode[id(args[1])] = (args, kw)  # each layer's cache: its last step's call
        return served(*args, **kw)
    torch_ops._decode_served = keep_last
    for name in PIECES["torch_ops"]:
        timers.wrap(torch_ops, name)
    for name in ("in_place", "gather", "scatter"):
        timers.wrap(hp_pool.HpPool, name, "hp_pool." + name)
    fwd = kimpl.KvarnAttentionImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        t0 = time.perf_counter()
        res = fwd(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
        if attn_metadata is not None:
            p = attn_metadata.plan
            (timers.decode_layers if p.num_decodes == p.num_rows else timers.other_layers).append(
                time.perf_counter() - t0)
        return res
    kimpl.KvarnAttentionImpl.forward = forward


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--scheme", default="kvarn_k4v2_g128", help="a kvarn scheme, or none for vLLM's own attention")
    p.add_argument("--prompt-lens", default="5,40,120,250,500,800,1100,1516")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="runs of the batch (the first compiles)")
    p.add_argument("--label", default="", help="a name for this run in the JSON")
    p.add_argument("--replay", type=int, default=0, help="after the runs, call the last fused decode step's XLA "
                   "computation this many times in a row (same inputs, warm caches) and report its mean")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from vllm_serve import offline_llm
    lens = [int(x) for x in a.prompt_lens.split(",")]
    timers = Timers()
    install(timers, a.scheme)
    llm, prompts = offline_llm(a, lens)
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    bridge = None
    if a.scheme != "none":
        import kvarn_vllm
        bridge = os.path.dirname(kvarn_vllm.__file__)
    report = {"scheme": a.scheme, "label": a.label, "bridge": bridge, "prompt_lens": lens,
              "max_tokens": a.max_tokens, "runs": []}
    for run in range(a.runs):
        timers.clear()
        cpu0 = dict(thread_cpu_seconds()) if run == a.runs - 1 else None
        for i in range(len(prompts)):
            engine.add_request(f"r{run}-{i}", {"prompt_token_ids": list(prompts[i])}, sp)
        tokens, steps = {}, 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            steps += 1
            for r in engine.step():
                if r.finished:
                    tokens[int(r.request_id.split("-")[1])] = list(r.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        d = timers.decode_layers
        res = {"wall_s": round(wall, 3), "steps": steps, "decode_layer_calls": len(d),
               "decode_layer_ms_mean": round(1e3 * statistics.fmean(d), 4) if d else None,
               "decode_layer_ms_median": round(1e3 * statistics.median(d), 4) if d else None,
               "decode_layers_s": round(sum(d), 3), "other_layers_s": round(sum(timers.other_layers), 3),
               "pieces_ms_per_decode_layer": {k: round(1e3 * v / max(1, len(d)), 4) for k, v in timers.t.items()},
               "piece_calls": dict(timers.n),
               "tokens": [tokens[i] for i in range(len(prompts))]}
        if cpu0 is not None:  # the last run's CPU seconds per thread: vLLM's OpenMP workers, XLA's pool
            cpu = [(name, sec - cpu0.get(tid, (name, 0.0))[1]) for tid, (name, sec) in thread_cpu_seconds().items()]
            res["thread_cpu_s"] = [(n, round(x, 2)) for n, x in sorted(cpu, key=lambda x: -x[1])[:6]]
        report["runs"].append(res)
        print(f"run {run}: " + json.dumps({k: v for k, v in res.items() if k != "tokens"}), flush=True)
    timed = report["runs"][1:] or report["runs"]
    report["summary"] = {k: round(statistics.fmean(r[k] for r in timed), 4)
                         for k in ("wall_s", "decode_layer_ms_mean", "decode_layers_s") if timed[0][k] is not None}
    report["repeats_identical"] = sum(report["runs"][-1]["tokens"][i] == report["runs"][0]["tokens"][i]
                                      for i in range(len(prompts)))
    print("summary", json.dumps(report["summary"]), "last run's tokens equal to the first's:",
          report["repeats_identical"], "/", len(prompts), flush=True)
    if a.replay and timers.last_decode is not None:
        import jax
        from kvarn_vllm import torch_ops
        args, kw = timers.last_decode
        jax.block_until_ready(torch_ops._decode_served(*args, **kw))
        t0 = time.perf_counter()
        for _ in range(a.replay):
            jax.block_until_ready(torch_ops._decode_served(*args, **kw))
        report["replay_ms"] = round(1e3 * (time.perf_counter() - t0) / a.replay, 4)
        print("replay: the last fused decode step's XLA computation, warm, ms", report["replay_ms"], flush=True)
        calls = list(timers.layer_decode.values())
        n = max(1, a.replay // len(calls))
        t0 = time.perf_counter()
        for _ in range(n):
            for args, kw in calls:  # every layer's last call in turn: each reads its own cache, as in a step
                jax.block_until_ready(torch_ops._decode_served(*args, **kw))
        report["replay_layers_ms"] = round(1e3 * (time.perf_counter() - t0) / (n * len(calls)), 4)
        print(f"replay across the {len(calls)} layers' caches in turn, ms", report["replay_layers_ms"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
