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
    # bits beside every error, the units stated, the Pareto front of bits vs attention error marked
    assert "bits/elem" in text and "||x̂ - x|| / ||x||" in text and "front * = no scheme with fewer or equal bits" in text
    for name, r in rows.items():
        dominated = any(o["bits_per_element"] <= r["bits_per_element"] and o["attn_out_rel_err"] < r["attn_out_rel_err"]
                        for o in rows.values() if o is not r)
        assert r["pareto_front"] == (not dominated), name
    lines = [ln for ln in text.splitlines() if ln.split() and ln.split()[0] in rows]
    assert [ln.split()[0] for ln in lines] == sorted(rows, key=lambda n: rows[n]["bits_per_element"])
    assert all(ln.rstrip().endswith("*") == rows[ln.split()[0]]["pareto_front"] for ln in lines)


def test_bad_scheme_is_a_clean_error(capsys):
    assert main(["schemes", "--kv-cache-dtype", "nf4"]) == 2
    assert "--kv-cache-dtype 'nf4' is not a known scheme" in capsys.readouterr().err
    assert main(["schemes", "--kv-cache-dtype", "kvarn_k4v2_g128", "--head-dim", "96"]) == 2
    assert "--head-dim=96 cannot be used with kvarn_k4v2_g128" in capsys.readouterr().err
    assert main(["schemes", "--json", "/none/t.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
