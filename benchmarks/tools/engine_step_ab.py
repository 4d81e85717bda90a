"""Same-process A/B of the engine's decode step: variants of one scheme's decode executable timed in
turn on one prefilled engine, so machine drift between processes does not enter the comparison.

    python benchmarks/tools/engine_step_ab.py --config llama3-8b --batch 32 --prompt-len 8192 \
        --run fp16:base --run kvarn_k4v2_g128:base,f32rot,nounrot,splits1 [--rounds 3] [--steps 8] \
        [--dtype bfloat16] [--profile] [--json out.json]

Per `--run SCHEME:VARIANTS` one engine (random bf16 weights of the architecture) prefills `batch`
random prompts once; each variant's decode executable is compiled once in an executable cache of its
own, then `rounds` rounds time `steps` decode steps of every variant in turn (after two untimed
steps). Rows: median and min ms/step over the rounds, and per step the host's time inside the decode
executable's call (dispatch: with the previous step still running, a call that waits for the device
shows here; prewait: the serial variant's wait before the call), waiting for the sampled tokens
afterwards, and receiving them; with `--profile` (GPU) three traced steps per variant (none of them
committing a block): device-busy ms (overlapping kernels merged), kernels a step and the host events
that took longest (`host_events`).

Variants (marked t: timing only, wrong outputs):
  base      the code as it is
  f32rot    a bf16 query/K/V rotated in fp32 with the fp32 matrix (the rotation before 335d67a)
  nofold    KVarN layers' attention output unrotated before their own o_proj, not left rotated for
            a rotated copy of o_proj (`ModelRunner.decode_kernels`)
  splitsN   every decode call with N splits
  stablemeta the step's packed metadata sent into the same device buffers every step (a donated
            refill), so the step's parameters keep their addresses: whether XLA's command-buffer
            update for parameters that move each step is what holds the host
  serial    each decode call made after the previous step finished (steps never overlap; the
            wait is the host column prewait): whether XLA's per-execution buffers taking other
            addresses while the previous step runs is what its command-buffer update costs
  pallasmerge the decode kernel's splits merged by the Pallas merge kernel for every scheme (by
            default only KVarN with 2-bit values; the others merge in XLA fusions, ~4 kernels a layer)
  concatrope RoPE as its two halves' results concatenated (the form before 2026-12-07)
  refattn   decode attention on the jnp reference where "auto" runs a kernel (on CPUs: the reference
            instead of the C++ kernel for KVarN caches)
  capped3   a bf16/fp32 cache's launch at batch x kv heads >= SMs capped at 128 registers in 3
            splits (the default is uncapped, in the splits rule's count: 2 at Llama-3-8B's 32 x 8K);
            faster alone (decode.py), slower in this step (benchmarks/results/2026-12-06_engine_gpu.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/

from kvarn_jax import hadamard  # noqa: E402
from kvarn_jax.attention import paged_decode  # noqa: E402
from kvarn_jax.attention.paged_decode_pallas import entry, launch  # noqa: E402
from kvarn_jax.models import ARCHITECTURES  # noqa: E402
from kvarn_jax.models import llama  # noqa: E402
from kvarn_jax.models.llama import Decoder  # noqa: E402
from kvarn_jax.serving import Engine, SamplingParams  # noqa: E402
from kvarn_jax.serving import runner  # noqa: E402
from generate import device_kernels  # noqa: E402

WARM = 2
# (owner, attribute) a variant may replace -> its original, put back before every variant
_ORIGINAL = {(owner, name): getattr(owner, name) for owner, name in (
    (hadamard, "_signs_product"), (launch, "default_num_splits"), (entry, "launch_table"),
    (runner.ModelRunner, "_executable"), (launch, "default_merge"), (runner.ModelRunner, "decode_kernels"),
    (llama, "apply_rope"), (paged_decode, "decode_impl"))}


def _concat_rope(x, positions, inv_freq):
    """RoPE as the two halves' results concatenated (the form before `llama.apply_rope`'s)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class _StableBuffers:
    """Host arrays sent into the same device buffer every step: a one-line executable that donates
    the previous step's buffer takes the new values into it, so the step's parameters keep their
    addresses (XLA then has no command-buffer nodes to update for them)."""

    def __init__(self):
        self.bufs = {}
        # `old` must be used, or jit drops the argument and its donation (finite values: 0 * old is 0)
        self.refill = jax.jit(lambda old, new: old * 0 + new, donate_argnums=0)

    def __call__(self, x):
        key = (x.shape, x.dtype)
        buf = self.bufs.get(key)
        self.bufs[key] = buf = jax.device_put(x) if buf is None else self.refill(buf, x)
        return buf


def _decode_wrapped(wrap):
    """`ModelRunner._executable` whose decode executables are called through `wrap(exe)` (a function
    of the call's arguments); the runner's own decode is unchanged."""
    original = _ORIGINAL[runner.ModelRunner, "_executable"]

    def executable(self, kind, fn, args, *a, **k):
        exe = original(self, kind, fn, args, *a, **k)
        return wrap(exe) if kind == "decode" else exe
    return executable


def _stable_meta(stable):
    """Decode calls taking their packed metadata (arguments 3 and 4) through `_StableBuffers`."""
    return _decode_wrapped(lambda exe: lambda *c: exe(*c[:3], stable(c[3]), stable(c[4]), *c[5:]))


_PREWAIT = [0.0]  # seconds the serial variant waited for the previous step before a decode call


def _serial(exe):
    """A decode call that first waits for the previous step (its donated caches), so no two steps
    overlap: XLA's per-execution buffers (temporaries, outputs) can then take the same addresses
    every step. The wait is timed apart (`_PREWAIT`)."""
    def call(*c):
        t = time.perf_counter()
        jax.block_until_ready(c[1])
        _PREWAIT[0] += time.perf_counter() - t
        return exe(*c)
    return call


def apply(variant: str) -> None:
    """Put the module functions a variant changes in place (every other variant's undone)."""
    for (owner, name), fn in _ORIGINAL.items():
        setattr(owner, name, fn)
    if variant == "base":
        return
    if variant == "f32rot":
        hadamard._signs_product = lambda x, max_abs: hadamard._matmul(
            x.astype(np.float32), hadamard.hadamard_matrix(x.shape[-1]), max_abs)
    elif variant == "nofold":
        runner.ModelRunner.decode_kernels = lambda self, schemes: (self._kernels, False)
    elif variant.startswith("splits") and variant[6:].isdigit():
        n = int(variant[6:])
        launch.default_num_splits = lambda *a, **k: n
    elif variant == "capped3":
        table = _ORIGINAL[entry, "launch_table"]
        entry.launch_table = lambda device=None: dataclasses.replace(table(device), tiled_wide=(2, 128))
        launch.default_num_splits = lambda *a, **k: 3
    elif variant == "stablemeta":
        runner.ModelRunner._executable = _stable_meta(_StableBuffers())
    elif variant == "serial":
        runner.ModelRunner._executable = _decode_wrapped(_serial)
    elif variant == "pallasmerge":
        launch.default_merge = lambda cfg: "pallas"
    elif variant == "concatrope":
        llama.apply_rope = _concat_rope
    elif variant == "refattn":
        chosen = _ORIGINAL[paged_decode, "decode_impl"]
        paged_decode.decode_impl = lambda cfg, bs, hd, impl="auto", *a, **k: chosen(
            cfg, bs, hd, "reference" if impl == "auto" else impl, *a, **k)
    else:
        raise SystemExit(f"unknown variant {variant!r} (base, f32rot, nofold, splitsN, capped3, stablemeta, serial, "
                         "pallasmerge, concatrope, refattn)")


def kernel_kinds(kernels: dict) -> list:
    """[(kind, calls a step, ms a step)] of `device_kernels`' kernels, XLA's numbered fusions of one
    kind together (loop_add_fusion_3 and _7 are one kind), most calls first: what a layer runs."""
    kinds: dict = {}
    for name, (calls, ms) in kernels.items():
        k = kinds.setdefault(re.sub(r"([._]\d+)+$", "", name), [0.0, 0.0])
        k[0] += calls
        k[1] += ms
    return sorted(((n, c, t) for n, (c, t) in kinds.items()), key=lambda x: (-x[1], -x[2]))


def profile(engine: Engine, steps: int = 3) -> dict:
    """Device-busy ms and kernels per decode step over `steps` traced steps (`generate.device_kernels`),
    and the 25 host events with the most time a step; the steps are chosen so that no block commit
    runs among them."""
    bs = engine.block_size
    while any((len(s.prompt) + s.scheduled + k - 1) % bs == bs - 1 for s in engine.pool().running
              for k in range(steps + 1)):
        engine.step()  # a block commit's call would be traced with the steps: step past it
    engine._drain()
    commits = engine.stats.commit_calls
    folder = tempfile.mkdtemp(prefix="engine_step_ab_")
    with jax.profiler.trace(folder):
        for _ in range(steps):
            engine.step()
        engine._drain()
    if engine.stats.commit_calls != commits:
        raise RuntimeError("a block commit ran in the traced steps")
    return {**device_kernels(folder, steps), "host_events": host_events(folder, steps)}


def host_events(folder: str, steps: int, top: int = 25) -> list:
    """[thread, event, calls a step, ms a step] of a trace's host planes, longest first."""
    import glob

    from jax.profiler import ProfileData

    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    total = {}
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for e in line.events:
                t = total.setdefault((line.name[:40], e.name[:100]), [0, 0.0])
                t[0] += 1
                t[1] += e.duration_ns / 1e6
    rows = sorted(total.items(), key=lambda kv: -kv[1][1])[:top]
    return [[line, name, c / steps, ms / steps] for (line, name), (c, ms) in rows]


class HostClock:
    """Host time of an engine's decode steps: inside the decode executable's call, waiting for the
    sampled tokens, receiving them (seconds, summed until `take`)."""

    def __init__(self, engine: Engine):
        self.engine, self.acc = engine, {"prewait": 0.0, "dispatch": 0.0, "wait": 0.0, "collect": 0.0}
        _PREWAIT[0] = 0.0
        decode, collect = engine.runner.decode, engine._collect

        def timed_decode(*a, **k):
            t, before = time.perf_counter(), _PREWAIT[0]
            out = decode(*a, **k)
            waited = _PREWAIT[0] - before
            self.acc["prewait"] += waited
            self.acc["dispatch"] += time.perf_counter() - t - waited
            return out

        def timed_collect(launched, *a):
            t = time.perf_counter()
            for sent in launched:
                jax.block_until_ready(sent[2])
            t1 = time.perf_counter()
            collect(launched, *a)
            self.acc["wait"] += t1 - t
            self.acc["collect"] += time.perf_counter() - t1

        engine.runner.decode, engine._collect = timed_decode, timed_collect

    def take(self, steps: int) -> dict:
        out = {k: 1e3 * v / steps for k, v in self.acc.items()}
        self.acc = dict.fromkeys(self.acc, 0.0)
        return out

    def close(self) -> None:
        del self.engine.runner.decode, self.engine._collect  # the instance attributes set above


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="llama3-8b", choices=sorted(ARCHITECTURES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--run", action="append", required=True, help="SCHEME:VARIANT[,VARIANT...] (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
    p.add_argument("--profile", action="store_true", help="trace 3 steps per variant (GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="random weights' dtype")
    p.add_argument("--json", default="")
    args = p.parse_args()
    plan = []
    for r in args.run:
        scheme, _, variants = r.partition(":")
        plan.append((scheme, (variants or "base").split(",")))
    cfg = ARCHITECTURES[args.config]
    model = Decoder(cfg, dtype=args.dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.vocab_size - 10, args.prompt_len).tolist() for _ in range(args.batch)]
    res = {"device": jax.devices()[0].device_kind, "config": args.config, "dtype": args.dtype, "batch": args.batch,
           "prompt_len": args.prompt_len, "rounds": args.rounds, "steps_per_block": args.steps, "rows": {}}
    for scheme, variants in plan:
        new = args.rounds * len(variants) * (WARM + args.steps) + len(variants) * (WARM + 4) + 8
        t0 = time.perf_counter()
        engine = Engine(model, kv_cache_dtype=scheme, block_size=128, max_seqs=args.batch,
                        max_model_len=args.prompt_len + new + 8, prefill_chunk=512, prefill_batch=args.batch)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        pool = engine.pool()
        while not all(s.computed == len(s.prompt) and s.scheduled >= 1 for s in pool.running) or engine.waiting:
            engine.step()
        engine._drain()
        print(f"{scheme}: engine and prefill {time.perf_counter() - t0:.1f} s", flush=True)
        shared = runner._COMPILED  # prefill and store/commit executables serve every variant
        stores, times, hosts = {}, {v: [] for v in variants}, {v: [] for v in variants}
        for v in variants:
            apply(v)
            jax.clear_caches()  # nested jitted functions would otherwise keep the previous variant's trace
            runner._COMPILED = stores[v] = {k: e for k, e in shared.items() if k[0] != "decode"}
            t0 = time.perf_counter()
            for _ in range(WARM):
                engine.step()
            engine._drain()
            print(f"  {v}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.rounds):
            for v in variants:
                apply(v)
                runner._COMPILED = stores[v]
                for _ in range(WARM):
                    engine.step()
                engine._drain()
                clock = HostClock(engine)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                engine._drain()
                times[v].append(1e3 * (time.perf_counter() - t0) / args.steps)
                hosts[v].append(clock.take(args.steps))
                clock.close()
        row = {v: {"median_ms": statistics.median(t), "min_ms": min(t), "blocks_ms": t,
                   "host_ms": {k: statistics.median(h[k] for h in hosts[v]) for k in hosts[v][0]},
                   "host_blocks_ms": hosts[v]} for v, t in times.items()}
        if args.profile and jax.default_backend() == "gpu":
            for v in variants:
                apply(v)
                runner._COMPILED = stores[v]
                row[v]["profile"] = profile(engine)
        for v, x in row.items():
            line = (f"  {scheme} {v}: median {x['median_ms']:.3f} ms/step, min {x['min_ms']:.3f}; host "
                    + ", ".join(f"{k} {ms:.3f}" for k, ms in x["host_ms"].items()))
            if "profile" in x:
                line += (f"; busy {x['profile']['busy_ms_per_step']:.3f} ms, "
                         f"{x['profile']['kernels_per_step']:.0f} kernels a step")
            print(line, flush=True)
            for _, event, calls, ms in x.get("profile", {}).get("host_events", [])[:12]:
                print(f"    host {event[:80]:80s} {calls:6.1f} calls {ms:8.3f} ms a step", flush=True)
            if "profile" in x and v == variants[0]:
                for name, calls, ms in kernel_kinds(x["profile"].get("kernels", {}))[:25]:
                    print(f"    kernels {name[:70]:70s} {calls:6.1f} a step {ms:8.4f} ms", flush=True)
        res["rows"][scheme] = row
        apply("base")
        runner._COMPILED = shared
        # the pool's buffers dropped here, whatever still refers to the engine (on an H100 the next
        # scheme's pool was refused for the memory this one held)
        for p in engine.pools.values():
            p.caches = p.last_tokens = None
        engine.pools.clear()
        del engine, pool
        gc.collect()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
