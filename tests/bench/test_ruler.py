"""bench/ruler.py's plan, resumption and summary, on hand-made runs (no server, no lm-eval)."""

from __future__ import annotations

import json

import pytest

from bench import ruler


def test_the_plan_runs_log_n_only_past_training_and_names_the_pretend_training_length():
    smol = ruler.plan("smollm2-135m", 8192, ruler.LENGTHS, ["niah_single_1"])
    at = lambda jobs, length: [job["label"] for job in jobs if job["length"] == length]  # noqa: E731
    assert len(at(smol, 8192)) == len(ruler.SETTINGS) + 1  # inside training: no log-n twin, and auto
    assert len(at(smol, 16384)) == 2 * len(ruler.SETTINGS) + 1
    assert "dual_chunk(log_n=True)" in at(smol, 16384) and "auto" in at(smol, 4096)
    assert all("train_length" not in job["settings"] for job in smol)
    qwen = ruler.plan("qwen2.5-coder-0.5b", 32768, ruler.LENGTHS, ruler.TASKS)
    assert all(job["settings"]["train_length"] == 4096 and job["tasks"] == ruler.TASKS for job in qwen)
    assert len(at(qwen, 8192)) == 2 * len(ruler.SETTINGS) + 1  # past its pretend 4096
    assert {job["without_log_n"] for job in qwen if job["label"] == "yarn(factor=auto, log_n=True)"} == {
        "yarn(factor=auto)"}


def test_settings_are_chosen_by_their_labels_and_an_unknown_label_says_which_exist():
    jobs = ruler.plan("smollm2-135m", 8192, [8192, 32768], ["niah_single_1"])
    picked = ruler.chosen(jobs, ["rerope", "dual_chunk(log_n=True)"])
    assert [(job["length"], job["label"]) for job in picked] == [(8192, "rerope"), (32768, "rerope"),
                                                                  (32768, "dual_chunk(log_n=True)")]
    assert ruler.chosen(jobs, None) == jobs
    with pytest.raises(SystemExit, match=r"no setting labelled rerop .*the labels: none, rerope"):
        ruler.chosen(jobs, ["rerop"])


def logged(job: dict, scores: dict[str, list[float]]) -> str:
    """A runs-log line: one lm-eval run of ``job`` over the tasks of ``scores``."""
    record = {**{k: v for k, v in job.items() if k != "tasks"}, "scores": scores, "seconds": 20.0,
              "date": "2026-11-27T00:00:00+00:00"}
    return json.dumps(record) + "\n"


def test_a_rerun_does_only_the_tasks_the_log_lacks_with_enough_samples(tmp_path):
    jobs = ruler.plan("smollm2-135m", 8192, [4096], ["niah_single_1", "ruler_vt"])
    runs = tmp_path / "runs.jsonl"
    runs.write_text(logged(jobs[0], {"niah_single_1": [1.0] * 10, "ruler_vt": [0.5] * 3})
                    + logged(jobs[1], {"niah_single_1": [0.0] * 10, "ruler_vt": [1.0] * 10}))
    left = ruler.still_to_do(jobs, ruler.records(runs), samples=10)
    assert left[0] == {**jobs[0], "tasks": ["ruler_vt"]}  # the one with too few samples
    assert jobs[1]["label"] not in [job["label"] for job in left] and len(left) == len(jobs) - 1
    per_task = {(r["label"], r["task"]): r for r in ruler.records(runs)}
    assert per_task["none", "ruler_vt"]["score"] == 0.5 and per_task["none", "ruler_vt"]["seconds"] == 10.0


def test_a_setting_that_scored_zero_on_every_task_is_not_run_at_longer_lengths(tmp_path):
    jobs = ruler.plan("smollm2-135m", 8192, [16384, 32768], ["niah_single_1", "ruler_vt"])
    at = {(job["label"], job["length"]): job for job in jobs}
    runs = tmp_path / "runs.jsonl"
    runs.write_text(logged(at["string", 16384], {"niah_single_1": [0.0] * 10, "ruler_vt": [0.0] * 10})
                    + logged(at["yarn(factor=auto)", 16384], {"niah_single_1": [0.0] * 10, "ruler_vt": [0.1] * 10}))
    kept, skipped = ruler.after_a_zero(ruler.still_to_do(jobs, ruler.records(runs), samples=10), ruler.records(runs))
    assert [(job["label"], job["length"]) for job in skipped] == [("string", 32768)]
    assert ("yarn(factor=auto)", 32768) in [(job["label"], job["length"]) for job in kept]  # one task above 0
    assert ("string(log_n=True)", 32768) in [(job["label"], job["length"]) for job in kept]  # its own row


@pytest.mark.parametrize("mean,n", [(0.0, 10), (1.0, 10), (0.5, 40), (0.9, 3)])
def test_the_wilson_interval_holds_the_mean_inside_zero_and_one(mean, n):
    low, high = ruler.wilson(mean, n)
    assert 0.0 <= low <= mean <= high <= 1.0 and high - low > 0
    assert ruler.wilson(mean, 4 * n)[1] - ruler.wilson(mean, 4 * n)[0] < high - low  # more samples, narrower


def fake_runs(scores: dict[tuple[str, int], float], tasks=("niah_single_1", "ruler_vt"), n=4) -> list[dict]:
    """Each task's runs of SmolLM2 with every task at ``scores[(label, length)]``."""
    runs = []
    for job in ruler.plan("smollm2-135m", 8192, ruler.LENGTHS, list(tasks)):
        if (job["label"], job["length"]) in scores:
            score = scores[job["label"], job["length"]]
            runs += [{**job, "task": task, "n": n, "scores": [score] * n, "score": score, "seconds": 10.0,
                      "date": "2026-11-27T00:00:00+00:00"} for task in tasks]
    return runs


def test_the_summary_scores_against_the_own_4k_score_and_finds_the_effective_length():
    runs = fake_runs({("none", 4096): 0.8, ("none", 8192): 0.7, ("none", 16384): 0.1,
                      ("rerope", 4096): 0.8, ("rerope", 8192): 0.75, ("rerope", 16384): 0.72, ("rerope", 32768): 0.2,
                      ("rerope(log_n=True)", 16384): 0.7, ("rerope(log_n=True)", 32768): 0.69})
    model = ruler.summarize_model(runs, ["niah_single_1", "ruler_vt"])
    assert model["own_4k"] == 0.8
    assert model["cells"]["rerope @ 16384"]["of_own_4k"] == 0.9
    # 0.856 x 0.8 = 0.685: plain RoPE holds to 8k, ReRoPE to 16k, with log-n (its 4k and 8k are ReRoPE's) to 32k
    assert model["effective_length"] == {"none": 8192, "rerope": 16384, "rerope(log_n=True)": 32768}
    assert model["settings"] == ["none", "rerope", "rerope(log_n=True)"]


def test_a_setting_missing_a_task_at_a_length_has_no_cell_there():
    runs = fake_runs({("none", 4096): 0.5})
    runs = [run for run in runs if run["task"] != "ruler_vt"]
    assert ruler.summarize_model(runs, ["niah_single_1", "ruler_vt"])["cells"] == {}


def test_the_report_renders_every_model(tmp_path):
    runs = fake_runs({("none", 4096): 0.8, ("dual_chunk", 16384): 0.6})
    summary = ruler.summarize(runs, ["niah_single_1", "ruler_vt"], {"machine": "x86_64, 2 cores",
                                                                    "lengths": ruler.LENGTHS})
    text = ruler.markdown(summary)
    assert "**smollm2-135m** (its own 4k score, plain RoPE: 0.800)" in text
    assert "| dual_chunk |  |  | 0.60 [0.29, 0.85] |  |  |" in text  # 8 samples; no 4k score yet
    assert text.index("| none |") < text.index("| dual_chunk |")  # the settings in their table's order
    ruler.plot(summary, tmp_path / "ruler.png")
    assert (tmp_path / "ruler.png").stat().st_size > 0


def test_a_log_n_row_borrows_only_the_lengths_inside_training_and_an_open_effective_length_says_at_least():
    runs = fake_runs({("none", 4096): 1.0, ("none", 8192): 1.0, ("none", 16384): 0.0,
                      ("rerope", 4096): 1.0, ("rerope", 8192): 1.0, ("rerope", 16384): 1.0, ("rerope", 32768): 1.0,
                      ("rerope(log_n=True)", 16384): 1.0})
    model = ruler.summarize_model(runs, ["niah_single_1", "ruler_vt"])
    # ReRoPE's own 32k score is not its log-n twin's: that one held up to 16k, all it has run
    assert model["effective_length"]["rerope(log_n=True)"] == 16384
    assert model["effective_at_least"] == ["rerope(log_n=True)"]
    table = ruler.model_table("smollm2-135m", model, ruler.LENGTHS)
    assert "| rerope(log_n=True) |  |  | 1.00 [0.68, 1.00] |  | at least 16k |" in table
    assert "| none | " in table and "0.00 [0.00, 0.32] | not run: 0 at 16k | 8k |" in table


def test_a_dry_run_lists_the_runs_left_with_their_hours_and_starts_nothing(tmp_path, capsys):
    jobs = ruler.plan("smollm2-135m", 8192, [16384], ["niah_single_1"])
    runs = tmp_path / "runs.jsonl"
    runs.write_text(logged(jobs[0], {"niah_single_1": [0.0] * 10}))  # none at 16k: 10 samples in 20 s
    argv = ["--model", "smollm2-135m", "--lengths", "16384", "32768", "--tasks", "niah_single_1", "--runs", str(runs),
            "--out-dir", str(tmp_path), "--dry-run"]
    assert ruler.main(argv) == 0
    out, err = capsys.readouterr()
    assert "not run: none at 32768 (0 at a shorter length" in err
    # 14 runs left at 16k at the logged 2 s a sample; 14 at 32k (not none) at the guess, 8 x 8^1.5 s a sample
    hours = (14 * 20 + 14 * 10 * 8 * 8**1.5) / 3600
    assert f"28 runs to do for smollm2-135m (10 samples each): about {hours:.1f} h" in err
    assert "  rerope at 16384: niah_single_1 (about 0 min)" in out and not list(tmp_path.glob("ruler.json"))
