import json

from kvarn_jax.cli import main


def test_schemes_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["schemes", "--kv-cache-dtype", "fp16,int8,kvarn_k4v2_g64", "--head-dim", "64", "--tokens", "256",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "kvarn_k4v2_g64" in text and "int8" in text
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fp16"]["k_rel_err"] == 0 and rows["fp16"]["capacity_vs_fp16"] == 1
    assert 0 < rows["int8"]["k_rel_err"] < 0.02
    # K codes 64x64x4/8 + 3x64 fp16 scales; V codes 64x64x2/8 + 3x64 fp16 scales; per 64 tokens
    assert rows["kvarn_k4v2_g64"]["bytes_per_token_per_head"] == (2048 + 384 + 1024 + 384) / 64
    assert rows["kvarn_k4v2_g64"]["capacity_vs_fp16"] > 4


def test_bad_scheme_is_a_clean_error(capsys):
    assert main(["schemes", "--kv-cache-dtype", "nf4"]) == 2
    assert "not a known scheme" in capsys.readouterr().err
