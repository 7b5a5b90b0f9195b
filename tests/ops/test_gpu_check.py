"""tests/ops/gpu_check.py (the kernels' check on a GPU) on this CPU: its --interpret mode (the
Triton kernels at small sizes under Triton's interpreter, against the float64 oracle) passes and
says so in its report; a tolerance below the error, a kernel fed a wrong plan and a cache write
that does nothing each show as errors and a failed verdict; with no CUDA and no --interpret it
refuses, saying why."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import harness
from rope_plugins.attention import planner
from rope_plugins.ops import gpu
from rope_plugins.rules.settings import METHOD_NAMES
from tests.ops import gpu_check

ROOT = Path(__file__).resolve().parents[2]
EVERY_METHOD = set(METHOD_NAMES) - {"auto"}
ONE_SHAPE = dataclasses.replace(gpu_check.SMALL, shapes=gpu_check.SMALL.shapes[:1])
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The command a GPU owner without a GPU would run, and the report it wrote."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    result = subprocess.run([sys.executable, "-m", "tests.ops.gpu_check", "--interpret", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def test_interpret_mode_passes_every_case(interpreted):
    stdout, report = interpreted
    cases = report["kernels"]["cases"]
    assert {(case["shape"], case["dtype"], case["kv_cache_dtype"]) for case in cases} == {
        (shape.label, dtype, cache) for shape in gpu_check.SMALL.shapes for dtype in ("float32", "float16")
        for cache in ("auto", "fp8_e4m3")}
    for case in cases:
        assert case["passed"] and case["cache_write_exact"], case
        assert 0 < case["relative_error"] <= case["tolerance"] == gpu_check.TOLERANCE[case["dtype"]]
        for key in ("max_error", "relative_error"):
            assert case[key] == max(row[key] for row in case["rows"])
        for row in case["rows"]:
            assert row["relative_error"] == pytest.approx(row["max_error"] / row["scale"])
        assert {row["settings"]["method"] for row in case["rows"]} == EVERY_METHOD
    assert report["kernels"]["passed"] and report["kernels"]["complete"] and "Kernels: every case passed" in stdout


def test_the_report_says_what_ran_and_what_did_not(interpreted):
    _, report = interpreted
    environment = report["environment"]
    assert report["mode"] == "interpreter" and environment["triton_interpreter"]
    assert environment["gpu"] is None and environment["cuda"] is None
    assert environment["triton"] and environment["torch"] == torch.__version__


def test_the_real_sizes_cover_what_the_check_promises():
    """Without running them (a GPU's work): real head shapes, every method, chunks after a
    cached context and a first chunk, decode rows at thousands of keys, valid settings."""
    shapes = {(shape.head, shape.kv * shape.queries_per_kv, shape.kv) for shape in gpu_check.REAL.shapes}
    assert {(128, 32, 8), (128, 28, 4), (64, 14, 2)} == shapes
    rows = gpu_check.step_rows(gpu_check.REAL)
    assert {settings.method for settings, _, _ in rows} == EVERY_METHOD
    assert any(settings.log_n for settings, _, _ in rows)
    prefill = [(context, new) for _, context, new in rows if new > 1]
    assert any(context > 0 for context, _ in prefill) and any(context == 0 for context, _ in prefill)
    assert {settings.method for settings, context, new in rows if new == 1 and context >= 2000} == EVERY_METHOD


def test_a_tolerance_below_the_error_fails_and_keeps_the_errors():
    kernels = gpu_check.check_kernels(ONE_SHAPE, ["float32"], {"float32": 1e-9}, CPU)
    case = kernels["cases"][0]
    assert not kernels["passed"] and not case["passed"] and case["cache_write_exact"]
    assert case["tolerance"] == 1e-9 and 1e-9 < case["relative_error"] <= gpu_check.TOLERANCE["float32"]
    text = printed(kernels)
    assert "| FAIL |" in text and "some cases failed" in text and "relative" in text


def printed(kernels: dict) -> str:
    """What gpu_check prints for these cases: the table and, under it, what failed."""
    report = {"date": "d", "mode": "interpreter", "environment": harness.gpu_versions(CPU), "kernels": kernels}
    return gpu_check.markdown(report) + "\n" + gpu_check.failures(report)


@pytest.mark.parametrize("cases", [[], [{"passed": True}, {"passed": False}]], ids=["no case", "one failed"])
def test_a_failed_or_empty_check_is_exit_status_1_with_the_report_written(tmp_path, monkeypatch, cases):
    monkeypatch.setattr(gpu_check, "check_kernels", lambda *args, **kwargs: {"cases": cases})
    monkeypatch.setattr(gpu_check, "markdown", lambda report: "")
    monkeypatch.setattr(gpu_check, "failures", lambda report: "")
    out = tmp_path / "report.json"
    assert gpu_check.main(["--interpret", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["kernels"] == {"passed": False, "complete": True, "block_size": 16,
                                                      "cases": cases}


def rows_wrong_under(monkeypatch, change) -> tuple[bool, set[str]]:
    """Whether gpu_check passes, and the methods of its rows past tolerance, with every step's
    kernel plan changed by ``change`` (plan -> plan)."""
    real_plan = planner.kernel_plan
    monkeypatch.setattr(planner, "kernel_plan", lambda *args, **kwargs: change(real_plan(*args, **kwargs)))
    case = gpu_check.check_kernels(ONE_SHAPE, ["float32"], gpu_check.TOLERANCE, CPU)["cases"][0]
    return case["passed"], {row["settings"]["method"] for row in case["rows"]
                            if row["relative_error"] > case["tolerance"]}


def test_a_kernel_given_a_wrong_leak_fails_the_rows_that_use_it(monkeypatch):
    """The plan's leak ρ halved: ReRoPE (ρ = 0) is untouched, and so is Self-Extend (its far
    positions come from its group); every other method is wrong."""
    passed, wrong = rows_wrong_under(monkeypatch, lambda plan: dataclasses.replace(plan, leak=plan.leak * 0.5))
    assert not passed and wrong == EVERY_METHOD - {"rerope", "self_extend"}


def test_a_kernel_given_a_wrong_group_fails_only_the_grouped_rows(monkeypatch):
    """The plan's group g doubled: only Self-Extend's rows are wrong (the others have none)."""
    passed, wrong = rows_wrong_under(monkeypatch, lambda plan: dataclasses.replace(plan, group=plan.group * 2))
    assert not passed and wrong == {"self_extend"}


def test_a_kernel_whose_far_positions_start_at_the_window_fails_only_string_and_dual_chunk(monkeypatch):
    """The plan's far origin o set to the window w (where every other method has it): only
    STRING's rows, whose far positions start again at its local value, and dual-chunk's, whose
    far query stands at its chunk size, are wrong."""
    passed, wrong = rows_wrong_under(monkeypatch, lambda plan: dataclasses.replace(plan, far_origin=plan.window))
    assert not passed and wrong == {"string", "dual_chunk"}


def test_a_kernel_without_chunks_fails_only_dual_chunk(monkeypatch):
    """The plan's chunk length s set to 0: only dual-chunk's rows, whose far keys stand at
    ``n mod s`` and whose window follows the query, are wrong."""
    passed, wrong = rows_wrong_under(monkeypatch,
                                     lambda plan: dataclasses.replace(plan, chunk_length=plan.chunk_length * 0))
    assert not passed and wrong == {"dual_chunk"}


def test_a_dynamic_factor_that_never_steps_fails_only_its_rows(monkeypatch):
    """ntk_dynamic sized to the training length at every position (factor 1, plain RoPE's θ):
    only its rows, which run past training, are wrong."""
    monkeypatch.setattr(planner, "dynamic_length", lambda positions, train_length, step: train_length + 0 * positions)
    passed, wrong = rows_wrong_under(monkeypatch, lambda plan: plan)
    assert not passed and wrong == {"ntk_dynamic"}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN slots read by the interpreter
def test_a_cache_write_that_writes_nothing_fails(monkeypatch):
    monkeypatch.setattr(gpu, "write_cache", lambda *args: None)
    kernels = gpu_check.check_kernels(ONE_SHAPE, ["float32"], gpu_check.TOLERANCE, CPU)
    case = kernels["cases"][0]
    assert not kernels["passed"] and not case["cache_write_exact"] and case["max_error"] is None
    assert case["relative_error"] is None and all(row["max_error"] is None for row in case["rows"])
    json.dumps(kernels, allow_nan=False)  # the report stays strict JSON
    text = printed(kernels)
    assert "not finite" in text and "| wrong |" in text and "some cases failed" in text


def test_a_kernel_that_raises_is_a_failed_case_and_the_check_goes_on(monkeypatch):
    """As a bfloat16 dot would on a GPU without bfloat16: that case fails, saying why; the next runs."""
    real_prefill = gpu.prefill

    def prefill(query, *args, **kwargs):
        if query.dtype == torch.float16:
            raise RuntimeError("no float16 here")
        return real_prefill(query, *args, **kwargs)

    monkeypatch.setattr(gpu, "prefill", prefill)
    kernels = gpu_check.check_kernels(ONE_SHAPE, ["float16", "float32"], gpu_check.TOLERANCE, CPU)
    half, single = kernels["cases"]
    assert not kernels["passed"] and not half["passed"] and half["error"] == "RuntimeError: no float16 here"
    assert single["passed"] and "error" not in single
    json.dumps(kernels, allow_nan=False)
    assert "raised RuntimeError: no float16 here" in printed(kernels)


def test_without_cuda_or_interpret_it_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    message = capsys.readouterr().err
    assert "no CUDA device" in message and "--interpret" in message and not out.exists()
