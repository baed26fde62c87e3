import json

from scripts.gemm_variants_table import collect, table


def test_variants_table_medians_over_rounds_and_ratios(tmp_path):
    def gemm_rows(ms):
        return {"rows": [{"shape": "8x8x8", "gemm": "bertaccel gemm+bias+gelu", "impl": "epilogue", "ms": ms},
                         {"shape": "8x8x8", "gemm": "fwd", "impl": "cublas", "ms": 1.0}]}

    for name, rounds in {"a": [2.0, 4.0, 3.0], "b": [1.5, 1.5]}.items():
        for r, ms in enumerate(rounds, 1):
            (tmp_path / f"variant_{name}_gemm_r{r}.json").write_text(json.dumps(gemm_rows(ms)))
    (tmp_path / "variant_b_ffn.json").write_text(json.dumps({"rows": [
        {"shape": "8x8x8", "impl": "ffn", "fwd_ms": 0.5, "fwd+bwd_ms": 2.0}]}))
    rows = {(r["bench"], r["case"]): r for r in table(collect(tmp_path, ["a", "b"]), ["a", "b"])}
    epi = rows[("gemm", "bertaccel gemm+bias+gelu")]
    assert epi["a"] == 3.0 and epi["b"] == 1.5 and epi["b/a"] == 0.5
    assert rows[("gemm", "fwd cublas")]["b/a"] == 1.0
    ffn = rows[("ffn", "ffn fwd+bwd_ms")]
    assert ffn["a"] is None and ffn["b"] == 2.0 and ffn["b/a"] is None  # variant a has no ffn run
