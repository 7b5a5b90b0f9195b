"""dtype_check's comparison of the two dtypes' per-method losses, on results logs written here."""

from __future__ import annotations

import json

from bench import dtype_check, quality


def write_log(path, losses: dict[str, float], length: int = 16384) -> None:
    records = [{"test": "loss", "label": label, "settings": {"method": label}, "length": length, "nll": nll,
                "accuracy": 0.5, "text_end": max(length, quality.LOSS_TEXT_END)} for label, nll in losses.items()]
    records.append({"test": "loss", "label": "rerope", "settings": {}, "length": 8192, "nll": 9.0,
                    "accuracy": 0.5, "text_end": quality.LOSS_TEXT_END})  # another length: not compared
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_each_setting_is_held_to_the_tolerance_in_both_directions(tmp_path):
    tolerance = dtype_check.METHOD_TOLERANCE
    write_log(tmp_path / "f32.jsonl", {"none": 3.0, "rerope": 2.5, "yarn": 2.6, "pi": 2.7})
    write_log(tmp_path / "bf16.jsonl", {"none": 3.0 + tolerance / 2, "rerope": 2.5 - 2 * tolerance,
                                        "yarn": 2.6 + 2 * tolerance})  # pi not measured in bfloat16
    report = dtype_check.method_losses(tmp_path / "f32.jsonl", tmp_path / "bf16.jsonl", 16384)
    within = {row["setting"]: row["within"] for row in report["rows"]}
    assert within == {"none": True, "rerope": False, "yarn": False}
    assert not report["all_within"]
    assert "**no**" in dtype_check.methods_markdown(report)


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


def test_losses_on_other_tokens_are_not_compared(tmp_path):
    """A float32 log written before the tokenizer split digits (no "tokenizer" in its records) scores
    other tokens than a bfloat16 log written after: those losses are left out, not compared."""
    write_log(tmp_path / "f32.jsonl", {"none": 3.0, "pi": 2.7})
    records = [{"test": "loss", "label": label, "settings": {"method": label}, "length": 16384, "nll": nll,
                "accuracy": 0.5, "text_end": quality.LOSS_TEXT_END, "tokenizer": "Digits (each digit) + ByteLevel"}
               for label, nll in {"none": 3.0 + 1.0, "pi": 2.7}.items()]
    (tmp_path / "bf16.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = dtype_check.method_losses(tmp_path / "f32.jsonl", tmp_path / "bf16.jsonl", 16384)
    assert report["rows"] == [] and report["unmatched"] == ["none", "pi"] and not report["all_within"]
    assert "Not compared" in dtype_check.methods_markdown(report)
