"""Bridges from other frameworks to kvarn_jax.

    transformers   KVarNCache: a transformers Cache whose blocks kvarn_jax quantizes (via DLPack)
    dlpack         torch <-> jax without copies, in the [batch, heads, tokens, head_dim] layout
    vllm_runner    what the vLLM plugins share about vLLM's internals (finding the model runner)

Import the submodule you need (`from kvarn_jax.integrations.transformers import KVarNCache`); this
package imports neither torch nor transformers by itself.
"""
