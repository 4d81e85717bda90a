"""The README's Python examples must run as written (with small sizes substituted)."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

import kvarn_jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_block_runs():
    text = README.read_text()
    block = re.search(r"```python\n(import jax, jax.numpy as jnp\nimport kvarn_jax\n.*?)```", text, re.S).group(1)
    ns = {}
    exec(block, ns)
    assert ns["k_hat"].shape == (256, 8, 128) and ns["k_hat"].dtype == jnp.float16
    assert ns["cfg"] == kvarn_jax.parse("int4")


def test_readme_cache_block_runs():
    text = README.read_text()
    block = re.search(r"```python\n(cache = kvarn_jax.PagedKVCache.create\(.*?)```", text, re.S).group(1)
    block = block.replace("num_blocks=1024", "num_blocks=4").replace("max_seqs=64", "max_seqs=2")
    rng = np.random.default_rng(0)
    n = 130
    ns = {"kvarn_jax": kvarn_jax, "jnp": jnp,
          "k_new": jnp.asarray(rng.standard_normal((n, 8, 128)), jnp.bfloat16),
          "v_new": jnp.asarray(rng.standard_normal((n, 8, 128)), jnp.bfloat16),
          "slot_mapping": jnp.concatenate([jnp.arange(128), 2 * 128 + jnp.arange(2)]).astype(jnp.int32),
          "seq_ids": jnp.zeros(n, jnp.int32), "positions": jnp.arange(n, dtype=jnp.int32),
          "q": jnp.asarray(rng.standard_normal((1, 32, 128)), jnp.bfloat16),
          "block_tables": jnp.array([[0, 2]], jnp.int32), "seq_lens": jnp.array([n], jnp.int32)}
    exec(block, ns)
    assert ns["out"].shape == (1, 32, 128) and bool(jnp.all(jnp.isfinite(ns["out"])))


def test_readme_memory_example_numbers():
    c = kvarn_jax.PagedKVCache.create("kvarn_k4v2_g128", num_blocks=1024, block_size=128, num_kv_heads=8,
                                      head_dim=128, max_seqs=64, dtype=jnp.bfloat16)
    r = kvarn_jax.memory_report(c)
    assert r["page_bytes"] == 108 * 2 ** 20 and r["sink_bytes"] + r["tail_bytes"] == 64 * 2 ** 20
    assert round(r["capacity_vs_fp16"], 2) == 2.98
    assert "2.98x" in README.read_text()
