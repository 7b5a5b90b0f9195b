"""The evaluation's plan and reports, without a server (its end-to-end run is in test_server.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import evaluate, readme

LENGTHS = [4096, 8192, 16384, 32768]
DEPTHS = [0.1, 0.5, 0.9]


@pytest.fixture(scope="module")
def full_plan():
    return evaluate.plan(LENGTHS, evaluate.configs(evaluate.METHODS, log_n_too=True), DEPTHS, keys=2)


def test_the_plan_holds_every_measurement_once(full_plan):
    keys = [(job[0], evaluate.label(job[1]), job[2], job[4] if job[0] == "passkey" else 0) for job in full_plan]
    assert len(keys) == len(set(keys))
    methods, sized = len(evaluate.METHODS), len(evaluate.SIZED_METHODS)
    plain = methods + sized  # each method at its defaults; the frequency methods also with factor "auto"
    scaled = plain - 1  # with log_n: all but auto, which decides log_n itself
    fixed = 2 * sized  # factor auto at 32k is the fixed factor 4, with log_n and without: not measured again
    losses = 4 * (plain + scaled) - fixed
    within = 2 * methods * (1 + 6)  # repeat and 6 passkeys at 4k and 8k: not for log_n or factor auto (identities)
    past = 2 * (plain + scaled) * (1 + 6) - fixed * (1 + 6)  # everything at 16k and 32k
    search = 2 * len(evaluate.AUTO_CANDIDATES)  # auto's candidates at 16k and 32k
    retrieval = 2 * (1 + 6) * len(evaluate.RETRIEVAL_CANDIDATES)  # and some of them with repeat and passkeys
    assert len(full_plan) == losses + within + past + len(evaluate.ablations()) + search + retrieval


def test_the_plan_runs_the_loss_curves_first(full_plan):
    search = 2 * len(evaluate.AUTO_CANDIDATES) + 2 * (1 + 6) * len(evaluate.RETRIEVAL_CANDIDATES)
    assert all(evaluate.is_candidate(job[1]) for job in full_plan[:search])  # auto's search first of all
    full_plan = full_plan[search:]
    tests = [job[0] for job in full_plan]
    first_detail = min(tests.index("repeat"), tests.index("passkey"))
    early_losses = {(evaluate.label(job[1]), job[2]) for job in full_plan[:first_detail]}
    for settings in evaluate.configs(evaluate.METHODS, log_n_too=True):
        for length in (4096, 8192, 16384):
            assert (evaluate.label(settings), length) in early_losses
    # every loss curve, with log_n too, before the repeat and passkey tests past training
    tests_past = [i for i, job in enumerate(full_plan) if job[0] != "loss" and job[2] > evaluate.TRAIN_LENGTH]
    assert all(job[0] == "loss" for job in full_plan[:min(tests_past)] if job[2] > evaluate.TRAIN_LENGTH)
    assert {(evaluate.label(job[1]), job[2]) for job in full_plan if job[0] == "loss"} <= {
        (evaluate.label(job[1]), job[2]) for job in full_plan[:min(tests_past)] if job[0] == "loss"}
    # the ablations come with the first length past training
    assert all(job[2] == 16384 for job in full_plan if evaluate.is_ablation({"settings": job[1]}))


def test_log_n_is_only_a_loss_check_within_training(full_plan):
    within = [job for job in full_plan if job[1].get("log_n") and job[2] <= evaluate.TRAIN_LENGTH]
    assert within and {job[0] for job in within} == {"loss"}


def test_factor_auto_is_measured_where_it_is_not_the_fixed_factor(full_plan):
    sized = {(job[0], job[2]) for job in full_plan if job[1].get("factor") == "auto"}
    assert ("passkey", 16384) in sized and ("loss", 8192) in sized  # factor 2, and 1 (plain RoPE's check)
    assert not {length for _, length in sized} & {32768}  # factor 4 (4.0009 with a passkey's answer)
    assert evaluate.is_the_fixed_factor(("passkey", {"method": "yarn", "factor": "auto"}, 32768, 0.5, 0))
    assert not evaluate.is_the_fixed_factor(("loss", {"method": "yarn"}, 32768))
    assert not evaluate.is_the_fixed_factor(("loss", {"method": "yarn", "factor": "auto"}, 30000))


def test_passkey_trials_go_deepest_first(full_plan):
    for settings in evaluate.configs(["rerope"], log_n_too=False):
        depths = [job[3] for job in full_plan if job[0] == "passkey" and job[1] == settings and job[2] == 16384]
        assert depths == sorted(depths, reverse=True) and len(depths) == 6


def summary_of(rows):
    return {"rows": [{"settings": {"method": evaluate.method_of(r["label"])}, "passkey_trials": 0, "passkey_found": 0,
                      "passkey": None, **r} for r in rows]}


def test_the_table_orders_methods_and_skips_tests_not_run():
    summary = summary_of([{"label": "rerope", "length": 16384, "nll": 2.5, "accuracy": 0.5},
                          {"label": "none", "length": 16384, "nll": 6.25, "accuracy": 0.125}])
    table = evaluate.markdown_table(summary)
    assert table.index("| none | 6.250 |") < table.index("| rerope | 2.500 |")
    assert "second copy" not in table and "Passkey" not in table


def test_a_collapsed_loss_goes_off_the_axis_and_close_ones_stay_apart():
    close = [2.47, 2.50, 2.51, 2.57, 2.60, 2.73]
    top = evaluate.off_scale_limit(close + [6.4, 8.9])
    assert max(close) < top < 6.4
    assert evaluate.off_scale_limit(close) == max(close)


def test_the_plot_draws_lines_and_bars(tmp_path):
    rows = [{"label": m, "length": n, "nll": 2.0 + n / 32768 + 6 * (m == "none" and n > 8192), "accuracy": 0.5,
             "passkey_trials": 6, "passkey_found": 3, "passkey": 0.5}
            for m in ("none", "rerope") for n in (4096, 16384)]
    evaluate.plot(summary_of(rows), tmp_path / "lines.png")
    evaluate.plot(summary_of([r for r in rows if r["length"] == 16384]), tmp_path / "bars.png")
    assert (tmp_path / "lines.png").stat().st_size > 10_000 and (tmp_path / "bars.png").stat().st_size > 10_000


def test_the_report_line_tells_missing_measurements_from_unplanned_cells():
    rows = [{"label": "rerope", "length": 16384, "nll": 2.5, "accuracy": 0.5, "passkey_trials": 6, "passkey_found": 6},
            {"label": "rerope(log_n=True)", "length": 4096, "nll": 2.5, "accuracy": 0.5},
            {"label": "rerope(log_n=True)", "length": 16384, "nll": 2.4, "accuracy": 0.5,
             "passkey_trials": 6, "passkey_found": 6}]
    report = {**summary_of(rows), "date": "2026-11-22T00:00:00", "machine": "m", "model": "x", "corpus": "pydoc",
              "measurements_planned": 9}
    partial = evaluate.markdown_report({**report, "measurements_missing": 2})
    assert "7 of the 9 planned measurements, `-` where not yet measured." in partial
    complete = evaluate.markdown_report({**report, "measurements_missing": 0})
    assert "all 9 planned measurements, `-` where not planned." in complete  # log_n's passkey at 4k: not planned
    no_dashes = evaluate.markdown_report({**report, "rows": summary_of(rows[:1])["rows"], "measurements_missing": 0})
    assert "all 9 planned measurements." in no_dashes


@pytest.mark.parametrize("stem", ["eval", "eval_quick", "eval_digits", "eval_new_methods", "eval_dual_chunk"])
def test_bench_readme_shows_the_committed_results(stem):
    """bench/README.md's block is the summary file's, and the summary file is its results log's
    (rerun `bench/evaluate.py [--quick] --table --readme` after measuring)."""
    results = json.loads((evaluate.RESULTS / f"{stem}.json").read_text())
    log = evaluate.current_records(evaluate.RESULTS / f"{stem}_runs.jsonl")
    assert results["rows"] == evaluate.summarize(log)["rows"]
    assert results["date"] == max(r["date"] for r in log)
    assert readme.block(readme.DOCUMENT.read_text(), stem) == evaluate.markdown(results)


def test_the_readings_compare_log_n_and_the_training_length():
    rows = [{"label": label, "length": n, "nll": nll, "accuracy": 0.5}
            for label, nlls in {"none": (2.5, 9.0), "none(log_n=True)": (2.5, 8.0), "rerope": (2.6, 2.7),
                                "yarn": (2.7, 2.8), "yarn(log_n=True)": (2.7, 2.9)}.items()
            for n, nll in zip((8192, 32768), nlls)]
    readings = evaluate.readings({**summary_of(rows), "train_length": 8192})
    assert readings[0] == ("Within training (8k), each method's loss against plain RoPE's (2.500): "
                           "`yarn` +0.200, `rerope` +0.100.")
    assert "`rerope` 2.700 (+0.100)" in readings[1] and "(the seeds expect no rise: not met)" in readings[2]
    assert readings[3] == ("log_n at 32k lowers the loss of `none` (9.000 to 8.000); "
                           "it raises it for `yarn` (2.800 to 2.900).")


def test_the_readings_of_named_settings_past_training_name_plain_ropes_loss_inside_it():
    rows = [{"label": "none", "length": 8192, "nll": 2.46, "accuracy": 0.5},
            {"label": "dual_chunk(chunk_size=8192)", "length": 32768, "nll": 2.48, "accuracy": 0.5}]
    readings = evaluate.readings({**summary_of(rows), "train_length": 8192})
    assert readings[0] == ("Lowest loss at 32k (in brackets: the change from 8k): `dual_chunk(chunk_size=8192)` "
                           "2.480; plain RoPE at 8k 2.460.")  # and no line of costs inside training: none measured


def test_the_time_estimate_comes_from_the_log_and_scales_to_longer_lengths():
    rerope = {"method": "rerope"}
    records = [{"test": "loss", "length": 16384, "seconds": 400.0},  # an older, slower machine: not among the latest 3
               {"test": "loss", "length": 16384, "seconds": 150.0}, {"test": "loss", "length": 16384, "seconds": 170.0},
               {"test": "loss", "length": 16384, "seconds": 160.0},
               {"test": "loss", "length": 32768, "seconds": 560.0},
               {"test": "passkey", "length": 16384, "sample": 9000, "seconds": 140.0},
               {"test": "passkey", "length": 16384, "sample": 9001, "seconds": 28.0}]
    jobs = [("loss", rerope, 16384), ("passkey", rerope, 16384, 0.9, 9001), ("passkey", rerope, 32768, 0.9, 9000),
            ("repeat", rerope, 32768), ("repeat", rerope, 4096)]
    same, reused_prefix, longer, untried, unknown = evaluate.estimated_seconds(jobs, records)
    assert same == 160.0 and reused_prefix == 28.0
    assert longer == 140.0 * 560.0 / 160.0  # the 16k trial scaled as the loss time grew from 16k to 32k
    assert untried == 560.0 and unknown is None  # no repeat measured: the loss time at that length, else nothing


def test_a_measurement_starts_only_if_it_fits_the_budget_at_this_runs_pace():
    assert evaluate.fits_budget(expected=300, measured=0, estimated=0, left=301)
    assert not evaluate.fits_budget(expected=300, measured=0, estimated=0, left=299)
    # this run has been twice as slow as the log: a 5-minute measurement needs 10
    assert not evaluate.fits_budget(expected=300, measured=400, estimated=200, left=500)
    assert evaluate.fits_budget(expected=300, measured=100, estimated=200, left=200)
    assert not evaluate.fits_budget(expected=1, measured=0, estimated=0, left=0)  # --budget-minutes 0: none


def test_a_table_rewrite_keeps_the_timed_runs_seconds(tmp_path):
    record = {"test": "loss", "label": "none", "settings": {"method": "none"}, "length": 4096, "sample": 0,
              "nll": 2.5, "accuracy": 0.5, "seconds": 30.0, "text_end": 32768, "date": "2026-11-22T00:00:00+00:00"}
    runs = tmp_path / "eval_runs.jsonl"
    runs.write_text(json.dumps(record) + "\n")
    jobs = [("loss", {"method": "none"}, 4096)]
    meta = {"machine": "x86_64, 2 cores", "model": "tiny", "corpus": "pydoc", "train_length": 8192, "profile": "full"}
    assert evaluate.report(runs, jobs, {**meta, "seconds": 95}, tmp_path, "eval") == 0  # a timed run
    assert evaluate.report(runs, jobs, meta, tmp_path, "eval") == 0  # --table
    assert json.loads((tmp_path / "eval.json").read_text())["seconds"] == 95


def test_the_report_names_the_tokenizer_of_its_records(tmp_path):
    """A log from before the tokenizer split digits (no "tokenizer" in its records) says ByteLevel;
    one that mixes both says so, rather than passing one tokenizer's numbers off as the other's."""
    old = {"test": "loss", "label": "none", "settings": {"method": "none"}, "length": 4096, "sample": 0,
           "nll": 2.5, "accuracy": 0.5, "seconds": 30.0, "text_end": 32768, "date": "2026-11-22T00:00:00+00:00"}
    new = {**old, "length": 8192, "tokenizer": "Digits (each digit) + ByteLevel", "date": "2026-11-26T00:00:00+00:00"}
    jobs = [("loss", {"method": "none"}, 4096), ("loss", {"method": "none"}, 8192)]
    meta = {"machine": "x86_64, 2 cores", "model": "tiny", "corpus": "pydoc", "train_length": 8192, "profile": "full"}
    runs = tmp_path / "eval_runs.jsonl"
    for records, named in (([old], "tokenizer ByteLevel)"),
                           ([old, new], "tokenizer ByteLevel and Digits (each digit) + ByteLevel)")):
        runs.write_text("".join(json.dumps(record) + "\n" for record in records))
        assert evaluate.report(runs, jobs, meta, tmp_path, "eval") == 0
        assert named in evaluate.markdown(json.loads((tmp_path / "eval.json").read_text()))


def test_settings_named_on_the_command_line_replace_the_grid_and_a_bad_one_says_why():
    settings = evaluate.settings_argument('{"method": "dual_chunk", "chunk_size": 8192, "log_n": true}')
    jobs = evaluate.plan([32768], [settings], [0.5], 2, with_ablations=False)
    name = "dual_chunk(chunk_size=8192,log_n=True)"
    assert [(job[0], evaluate.label(job[1])) for job in jobs if job[0] != "repeat"] == [("loss", name)] + [
        ("passkey", name)] * 2
    for bad in ['{"method": "rope"}', "[1]", "{method"]:
        with pytest.raises(argparse.ArgumentTypeError, match="method is one of|not JSON"):
            evaluate.settings_argument(bad)
