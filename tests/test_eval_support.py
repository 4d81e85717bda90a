"""Shared builders for the evaluation tests (no tests here): a tiny random Llama and a local model
folder with a word-level tokenizer, so the eval pipeline runs hermetically in seconds."""

from __future__ import annotations

import collections
import re

import torch


def tiny_llama(num_layers: int = 2, head_dim: int = 32, vocab: int = 97, seed: int = 0, init: float = 0.2):
    """A random LlamaForCausalLM in eval mode: 4 query heads, 2 kv heads (GQA), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=4 * head_dim, intermediate_size=8 * head_dim,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=2048, initializer_range=init, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def word_tokenizer(text: str, size: int = 256):
    """A word-level fast tokenizer over the `size - 1` most frequent words of `text` (+ [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = collections.Counter(re.findall(r"\w+|[^\w\s]", text))
    vocab = {"[UNK]": 0}
    for w, _ in words.most_common(size - 1):
        vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")


def tiny_model_folder(path, num_layers: int = 2, head_dim: int = 32):
    """Save a tiny random model + tokenizer (vocab 256, from the shipped text) as a Hugging Face folder."""
    from kvarn_jax.data import load_text

    tok = word_tokenizer(load_text(), 256)
    model = tiny_llama(num_layers=num_layers, head_dim=head_dim, vocab=256)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def one_torch_thread():
    """Generator for an autouse fixture: torch on one thread during a test, restored after.

    The models here are tiny; with several OpenMP threads on a shared 2-core machine their small
    matmuls spend most of the time spin-waiting (measured 10x slower). torch._C's setter is called:
    an in-process vLLM CPU worker (an earlier test on the same xdist worker) replaces
    `torch.set_num_threads` with a no-op."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
