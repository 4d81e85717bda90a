"""The engine's own host (Python) cost per decode step, with the compiled step replaced by a stub.

    python benchmarks/tools/engine_host_cost.py [--scheme kvarn_k4v2_g32] [--batch 32] [--steps 2000]
        [--against PATH]

A tiny model's engine is prefilled with `batch` requests; then `ModelRunner.decode` and `commit`
return ready arrays without running anything, and `Engine.step()` is timed: what the scheduler,
the packed metadata and receiving the tokens cost a step on the host, which a small model's GPU
step pays on top of XLA's own dispatch. `--against` also times the engine of another tree (its
`kvarn_jax` folder's parent), alternating, in fresh processes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def measure(scheme: str, batch: int, steps: int) -> float:
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kvarn_jax.models.llama import Decoder, LlamaConfig
    from kvarn_jax.serving import Engine, SamplingParams

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=8192, eos_token_ids=(3,))
    model = Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.2)
    rng = np.random.default_rng(0)
    engine = Engine(model, kv_cache_dtype=scheme, max_seqs=batch, max_model_len=4096, block_size=128,
                    prefill_chunk=512, prefill_batch=batch)
    for _ in range(batch):
        engine.add_request(rng.integers(4, 256, 300).tolist(),
                           SamplingParams(max_new_tokens=steps + 100, ignore_eos=True))
    pool, runner = engine.pool(), engine.runner
    while not all(s.computed == len(s.prompt) and s.scheduled >= 1 for s in pool.running) or engine.waiting:
        engine.step()
    engine._drain()
    out = jnp.stack([jnp.full((batch,), 5, jnp.int32), jnp.zeros((batch,), jnp.int32)])  # tokens, no flags

    def decode(caches, last_tokens, meta, fmeta):
        runner._past_sink(caches, meta)  # the host work of the real call before XLA's
        runner.decode_kernels(caches.layer_schemes)
        return out, caches, last_tokens

    runner.decode, runner.commit = decode, lambda caches, blocks: caches
    for _ in range(50):
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t) / steps * 1000
    if len(pool.running) != batch:
        raise SystemExit("requests finished during the timed steps: raise --steps' margin")
    return ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", default="kvarn_k4v2_g32")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", help="another tree's root (holding kvarn_jax/), timed alternately")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(f"{measure(args.scheme, args.batch, args.steps):.4f}")
        return 0
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    trees = {"this tree": here} | ({"against": os.path.abspath(args.against)} if args.against else {})
    times = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            env = {**os.environ, "PYTHONPATH": root}
            res = subprocess.run([sys.executable, __file__, "--child", "--scheme", args.scheme, "--batch",
                                  str(args.batch), "--steps", str(args.steps)], env=env, capture_output=True,
                                 text=True, check=True)
            times[name].append(float(res.stdout.strip().splitlines()[-1]))
    for name, ts in times.items():
        print(f"{name}: {min(ts):.3f} ms host a step (min of {len(ts)}; all {', '.join(f'{t:.3f}' for t in ts)}), "
              f"{args.scheme}, batch {args.batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
