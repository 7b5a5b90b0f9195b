"""dtype_check's comparison of stock vLLM's and the plugin's losses in both dtypes."""

from __future__ import annotations

from bench import dtype_check


def test_plain_rope_rows_are_measured_against_stock_float32():
    rows = [{"engine": "stock", "dtype": "float32", "attention_precision": None, "loss": 6.0},
            {"engine": "stock", "dtype": "bfloat16", "attention_precision": None, "loss": 6.0 + 0.002},
            {"engine": "plugin", "dtype": "bfloat16", "attention_precision": "bfloat16", "loss": 6.0 - 0.006},
            {"engine": "stock", "dtype": "bfloat16", "attention_precision": None, "kv_cache_dtype": "fp8_e5m2",
             "loss": 6.0 + 0.03}]
    measured = dtype_check.against_stock_float32(rows)
    assert [round(r["difference"], 6) for r in measured] == [0.0, 0.002, -0.006, 0.03]
    assert [r["within"] for r in measured] == [True, True, False, None]  # an fp8 cache's: bfloat16's tolerance not its
    report = {"date": "2026-11-28T00:00:00+00:00", "machine": "test", "length": 16384,
              "tolerance": dtype_check.METHOD_TOLERANCE, "rows": measured}
    table = dtype_check.stock_markdown(report)
    assert table.count("**no**") == 1 and "| plugin | bfloat16 | bfloat16 | auto | 5.9940 | -0.0060 |" in table


def test_fp8_drift_is_held_to_stocks_own_plus_the_margin_in_both_formats():
    losses = {"auto": {"rerope": 3.0, "yarn": 3.1}, "fp8_e4m3": {"rerope": 3.012, "yarn": 3.1},
              "fp8_e5m2": {"rerope": 3.02, "yarn": 3.1 - 0.04}}
    rows = dtype_check.drift_rows(losses, {"fp8_e4m3": 0.01, "fp8_e5m2": -0.02})
    assert [round(r["fp8_e5m2"], 6) for r in rows] == [0.02, -0.04]
    assert [r["within"] for r in rows] == [True, False]  # yarn's e5m2 drift is 0.04 > 0.02 + 0.005
    report = {"date": "2026-12-01T00:00:00+00:00", "machine": "test", "length": 16384, "margin": 0.005,
              "yardstick": {"fp8_e4m3": 0.01, "fp8_e5m2": -0.02}, "rows": rows}
    assert "| yarn | 3.1000 | +0.0000 | -0.0400 | **no** |" in dtype_check.fp8_markdown(report)


def test_fp8_drift_reads_stocks_yardstick_and_the_quality_runs(tmp_path):
    import json

    stock = {"date": "2026-12-01T00:00:00+00:00", "machine": "test", "length": 16384, "rows": [
        {"engine": "stock", "dtype": "bfloat16", "kv_cache_dtype": kv, "loss": loss}
        for kv, loss in (("auto", 6.0), ("fp8_e4m3", 6.01), ("fp8_e5m2", 5.97))]}
    for kv, nll in (("auto", 3.0), ("fp8_e4m3", 3.004), ("fp8_e5m2", 3.05)):
        rows = [{"label": "rerope", "length": 16384, "nll": nll}, {"label": "rerope", "length": 8192, "nll": 9.0}]
        (tmp_path / f"kv_bfloat16_{kv}.json").write_text(json.dumps({"rows": rows}))
    report = dtype_check.fp8_drift(stock, tmp_path)
    assert {kv: round(v, 6) for kv, v in report["yardstick"].items()} == {"fp8_e4m3": 0.01, "fp8_e5m2": -0.03}
    [row] = report["rows"]
    assert round(row["fp8_e5m2"], 6) == 0.05 and row["within"] is False  # 0.05 > 0.03 + 0.005
