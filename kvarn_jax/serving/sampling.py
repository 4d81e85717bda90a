"""Next-token sampling: greedy, temperature and top-p (nucleus), one PRNG stream per request.

Each row's key is `fold_in(PRNGKey(seed), step)` (step = the index of the token being generated),
so a request's samples depend only on its own seed and logits, never on which other requests share
the batch: a batch reproduces the same requests run one by one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    max_new_tokens: tokens to generate at most (>= 1). temperature: 0 = greedy (argmax), else logits
    are divided by it. top_p: sample only from the smallest set of most likely tokens whose
    probability reaches top_p (1.0 = all). seed: the request's PRNG seed. stop_token_ids: ids that
    end generation (None = the model's EOS ids); the stop token is kept as the last output token.
    ignore_eos: never stop on a stop token (benchmarks generate a fixed length).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)


def _nucleus_sample(logits, top_p, key):
    """One token from softmax(logits) restricted to the top-p nucleus. logits: [V] float32."""
    order = jnp.argsort(-logits)                     # most likely first (stable: ties keep id order)
    sorted_logits = logits[order]
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs          # probability of strictly more likely tokens
    keep = (mass_before < top_p) | (top_p >= 1.0)    # the first token is always kept
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    return order[choice]


@jax.jit
def sample(logits: jnp.ndarray, temperature: jnp.ndarray, top_p: jnp.ndarray, seeds: jnp.ndarray,
           steps: jnp.ndarray) -> jnp.ndarray:
    """Next tokens [B] int32 from logits [B, V]; per-row temperature, top_p, seed and step [B].

    Rows with temperature 0 take the argmax; the others sample (the sort for top-p runs only when
    some row samples).
    """
    return jax.lax.cond(jnp.any(temperature > 0), lambda _: sample_rows(logits, temperature, top_p, seeds, steps, True),
                        lambda _: sample_rows(logits, temperature, top_p, seeds, steps, False), None)


def sample_rows(logits, temperature, top_p, seeds, steps, any_sampled: bool) -> jnp.ndarray:
    """`sample` with the branch decided by the caller (static `any_sampled`: some row has temperature
    > 0), for compiled steps whose host knows it: a data-dependent branch would make the device wait
    for the host in the middle of the step."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not any_sampled:
        return greedy
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(
        seeds.astype(jnp.uint32), steps.astype(jnp.uint32))
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    tok = jax.vmap(_nucleus_sample)(scaled, top_p.astype(jnp.float32), keys).astype(jnp.int32)
    return jnp.where(temperature > 0, tok, greedy)
