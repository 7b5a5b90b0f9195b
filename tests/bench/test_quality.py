"""The quality suite's plan and reports, without a server (its end-to-end run is in test_server.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import harness, quality, readme

LENGTHS = [4096, 8192, 16384, 32768]
DEPTHS = [0.1, 0.5, 0.9]


@pytest.fixture(scope="module")
def full_plan():
    return quality.plan(LENGTHS, quality.configs(quality.METHODS, log_n_too=True), DEPTHS, keys=2)


def test_the_plan_holds_every_measurement_once(full_plan):
    keys = [(job[0], quality.label(job[1]), job[2], job[4] if job[0] == "passkey" else 0) for job in full_plan]
    assert len(keys) == len(set(keys))
    methods, sized = len(quality.METHODS), len(quality.SIZED_METHODS)
    plain = methods + sized  # each method at its defaults; the frequency methods also with factor "auto"
    scaled = plain - 1  # with log_n: all but auto, which decides log_n itself
    fixed = 2 * sized  # factor auto at 32k is the fixed factor 4, with log_n and without: not measured again
    losses = 4 * (plain + scaled) - fixed
    within = 2 * methods * (1 + 6)  # repeat and 6 passkeys at 4k and 8k: not for log_n or factor auto (identities)
    past = 2 * (plain + scaled) * (1 + 6) - fixed * (1 + 6)  # everything at 16k and 32k
    search = 2 * len(quality.AUTO_CANDIDATES)  # auto's candidates at 16k and 32k
    retrieval = 2 * (1 + 6) * len(quality.RETRIEVAL_CANDIDATES)  # and some of them with repeat and passkeys
    assert len(full_plan) == losses + within + past + len(quality.ABLATIONS) + search + retrieval


def test_the_plan_runs_the_loss_curves_first(full_plan):
    search = 2 * len(quality.AUTO_CANDIDATES) + 2 * (1 + 6) * len(quality.RETRIEVAL_CANDIDATES)
    candidates = quality.AUTO_CANDIDATES + quality.RETRIEVAL_CANDIDATES
    assert all(job[1] in candidates for job in full_plan[:search])  # auto's search first of all
    full_plan = full_plan[search:]
    tests = [job[0] for job in full_plan]
    first_detail = min(tests.index("repeat"), tests.index("passkey"))
    early_losses = {(quality.label(job[1]), job[2]) for job in full_plan[:first_detail]}
    for settings in quality.configs(quality.METHODS, log_n_too=True):
        for length in (4096, 8192, 16384):
            assert (quality.label(settings), length) in early_losses
    # every loss curve, with log_n too, before the repeat and passkey tests past training
    tests_past = [i for i, job in enumerate(full_plan) if job[0] != "loss" and job[2] > quality.TRAIN_LENGTH]
    assert all(job[0] == "loss" for job in full_plan[:min(tests_past)] if job[2] > quality.TRAIN_LENGTH)
    assert {(quality.label(job[1]), job[2]) for job in full_plan if job[0] == "loss"} <= {
        (quality.label(job[1]), job[2]) for job in full_plan[:min(tests_past)] if job[0] == "loss"}
    # the ablations come with the first length past training
    assert all(job[2] == 16384 for job in full_plan if not quality.is_default({"settings": job[1]}))


def test_log_n_is_only_a_loss_check_within_training(full_plan):
    within = [job for job in full_plan if job[1].get("log_n") and job[2] <= quality.TRAIN_LENGTH]
    assert within and {job[0] for job in within} == {"loss"}


def test_factor_auto_is_measured_where_it_is_not_the_fixed_factor(full_plan):
    sized = {(job[0], job[2]) for job in full_plan if job[1].get("factor") == "auto"}
    assert ("passkey", 16384) in sized and ("loss", 8192) in sized  # factor 2, and 1 (plain RoPE's check)
    assert not {length for _, length in sized} & {32768}  # factor 4 (4.0009 with a passkey's answer)
    assert quality.is_the_fixed_factor(("passkey", {"method": "yarn", "factor": "auto"}, 32768, 0.5, 0))
    assert not quality.is_the_fixed_factor(("loss", {"method": "yarn"}, 32768))
    assert not quality.is_the_fixed_factor(("loss", {"method": "yarn", "factor": "auto"}, 30000))


def test_passkey_trials_go_deepest_first(full_plan):
    for settings in quality.configs(["rerope"], log_n_too=False):
        depths = [job[3] for job in full_plan if job[0] == "passkey" and job[1] == settings and job[2] == 16384]
        assert depths == sorted(depths, reverse=True) and len(depths) == 6


def summary_of(rows):
    return {"rows": [{"settings": {"method": r["label"].split("(")[0]}, "passkey_trials": 0, "passkey_found": 0,
                      "passkey": None, **r} for r in rows]}


REPORT = {"date": "2026-11-22T00:00:00", "machine": "m", "model": "x", "corpus": "pydoc", "measurements_planned": 9,
          "measurements_missing": 2, "measured_seconds": 7200}


def test_the_table_orders_methods_and_leaves_other_settings_to_the_json():
    rows = [{"label": "rerope", "length": 16384, "nll": 2.5, "accuracy": 0.5, "passkey_trials": 6,
             "passkey_found": 5},
            {"label": "none", "length": 16384, "nll": 6.25, "accuracy": 0.125},
            {"label": "rerope(window=1024)", "length": 16384, "nll": 2.6, "accuracy": 0.5,
             "settings": {"method": "rerope", "window": 1024}},
            {"label": "pi(factor=auto)", "length": 16384, "nll": 3.4, "accuracy": 0.5,
             "settings": {"method": "pi", "factor": "auto"}}]
    text = quality.markdown({**REPORT, **summary_of(rows)})
    assert text.startswith("Measured 2026-11-22 on m (x, corpus `pydoc`): 7 of 9 planned measurements, 2.0 h;")
    assert text.index("| none | 6.250 | - |") < text.index("| rerope | 2.500 | 5/6 |")
    assert "2 rows of other settings in the JSON" in text and "window=1024" not in text and "factor" not in text
    assert "accuracy" not in text  # in the JSON, not the README


def test_the_plot_draws_the_loss_and_the_passkeys(tmp_path):
    rows = [{"label": m, "length": n, "nll": 2.0 + n / 32768 + 6 * (m == "none" and n > 8192), "accuracy": 0.5,
             "passkey_trials": 6, "passkey_found": 3, "passkey": 0.5}
            for m in ("none", "rerope", "rerope(log_n=True)") for n in (4096, 16384)]
    quality.plot({**REPORT, **summary_of(rows)}, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 10_000


@pytest.mark.parametrize("stem", ["eval", "eval_digits", "eval_new_methods"])
def test_bench_readme_shows_the_committed_results(stem):
    """bench/README.md's block is the summary file's, and the summary file is its results log's
    (rerun `python -m bench quality [--quick] --table --readme` after measuring)."""
    results = json.loads((quality.RESULTS / f"{stem}.json").read_text())
    log = harness.read_log(quality.RESULTS / f"{stem}_runs.jsonl")
    assert results["rows"] == quality.summarize(log)["rows"]
    assert results["date"] == max(r["date"] for r in log)
    assert readme.shown(stem) == quality.markdown(results)


def test_the_report_names_the_tokenizer_of_its_records(tmp_path):
    """A log from before the tokenizer split digits (no "tokenizer" in its records) says ByteLevel;
    one that mixes both says so, rather than passing one tokenizer's numbers off as the other's."""
    old = {"test": "loss", "label": "none", "settings": {"method": "none"}, "length": 4096, "sample": 0,
           "nll": 2.5, "accuracy": 0.5, "seconds": 30.0, "text_end": 32768, "date": "2026-11-22T00:00:00+00:00"}
    new = {**old, "length": 8192, "tokenizer": "Digits (each digit) + ByteLevel", "date": "2026-11-26T00:00:00+00:00"}
    jobs = [("loss", {"method": "none"}, 4096), ("loss", {"method": "none"}, 8192)]
    meta = {"machine": "x86_64, 2 cores", "model": "tiny", "corpus": "pydoc", "train_length": 8192}
    runs = tmp_path / "eval_runs.jsonl"
    for records, named in (([old], "tokenizer ByteLevel)"),
                           ([old, new], "tokenizer ByteLevel and Digits (each digit) + ByteLevel)")):
        runs.write_text("".join(json.dumps(record) + "\n" for record in records))
        assert quality.report(runs, jobs, meta, tmp_path, "eval") == 0
        assert named in quality.markdown(json.loads((tmp_path / "eval.json").read_text()))
    assert quality.report(tmp_path / "none.jsonl", jobs, meta, tmp_path, "eval") == 1  # nothing measured yet


def test_settings_named_on_the_command_line_replace_the_grid_and_a_bad_one_says_why():
    settings = quality.settings_argument('{"method": "dual_chunk", "chunk_size": 8192, "log_n": true}')
    jobs = quality.plan([32768], [settings], [0.5], 2, with_ablations=False)
    name = "dual_chunk(chunk_size=8192,log_n=True)"
    assert [(job[0], quality.label(job[1])) for job in jobs if job[0] != "repeat"] == [("loss", name)] + [
        ("passkey", name)] * 2
    for bad in ['{"method": "rope"}', "[1]", "{method"]:
        with pytest.raises(argparse.ArgumentTypeError, match="method is one of|not JSON"):
            quality.settings_argument(bad)
