"""dtype_check's comparison of stock vLLM's and the plugin's losses in both dtypes."""

from __future__ import annotations

from bench import dtype_check


def test_plain_rope_rows_are_measured_against_stock_float32():
    rows = [{"engine": "stock", "dtype": "float32", "attention_precision": None, "loss": 6.0},
            {"engine": "stock", "dtype": "bfloat16", "attention_precision": None, "loss": 6.0 + 0.002},
            {"engine": "plugin", "dtype": "bfloat16", "attention_precision": "bfloat16", "loss": 6.0 - 0.006}]
    measured = dtype_check.against_stock_float32(rows)
    assert [round(r["difference"], 6) for r in measured] == [0.0, 0.002, -0.006]
    assert [r["within"] for r in measured] == [True, True, False]
    report = {"date": "2026-11-28T00:00:00+00:00", "machine": "test", "length": 16384,
              "tolerance": dtype_check.METHOD_TOLERANCE, "rows": measured}
    table = dtype_check.stock_markdown(report)
    assert table.count("**no**") == 1 and "| plugin | bfloat16 | bfloat16 | 5.9940 | -0.0060 |" in table
