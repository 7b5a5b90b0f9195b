"""dtype_check's comparison of the two dtypes' per-method losses, on results logs written here."""

from __future__ import annotations

import json

from bench import dtype_check, evaluate


def write_log(path, losses: dict[str, float], length: int = 16384) -> None:
    records = [{"test": "loss", "label": label, "settings": {"method": label}, "length": length, "nll": nll,
                "accuracy": 0.5, "text_end": max(length, evaluate.LOSS_TEXT_END)} for label, nll in losses.items()]
    records.append({"test": "loss", "label": "rerope", "settings": {}, "length": 8192, "nll": 9.0,
                    "accuracy": 0.5, "text_end": evaluate.LOSS_TEXT_END})  # another length: not compared
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
