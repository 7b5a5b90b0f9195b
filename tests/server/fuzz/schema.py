"""Fuzz the HTTP API from the server's own OpenAPI schema with schemathesis (``python -m tests.server.fuzz``;
``tests/server/test_server_robustness.py`` runs the same with a small budget).

Starts ``python -m rope_plugins.server`` on the real default model with small limits (a 512-token context,
4 running + 4 waiting sequences), so that every generated request that reaches the engine
ends in seconds, then runs schemathesis (examples, coverage and fuzzing phases; positive and
negative data) with the checks: no 5xx, every status, content type and body as documented,
schema-violating data refused. Generated bodies name the served model and ask for 4 tokens
at most (tests/server/fuzz/hooks.py) where the schema allows it. Writes bench/results/fuzz.json:
the requests sent, schemathesis' failures, the server's answers by status (from its log),
tracebacks in the log, and whether the engine still served at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parents[3]
MODEL = "SmolLM2-135M-Instruct"
SERVER_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-waiting", "4",
                "--max-request-bytes", str(1 << 20), "--max-logprob-entries", "5000"]
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "negative_data_rejection")


def schemathesis_run(base: str, api_key: str, *, examples: int, seed: int, report_dir: Path,
                     timeout: float = 3600) -> subprocess.CompletedProcess:
    """One schemathesis run against ``base``; its output says what failed."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json",
               "-H", f"Authorization: Bearer {api_key}", "--checks", CHECKS, "--max-examples", str(examples),
               "--seed", str(seed), "--workers", "1", "--phases", "examples,coverage,fuzzing",
               "--request-timeout", "120", "--no-color", "--generation-database", "none",
               "--report", "junit", "--report-dir", str(report_dir)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz.hooks", "FUZZ_MODEL": MODEL, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=report_dir, capture_output=True, text=True, timeout=timeout, env=env)


def generated_count(output: str) -> int:
    found = re.search(r"(\d+) generated", output)
    return int(found.group(1)) if found else 0


def answers_by_status(log: str) -> dict[str, int]:
    """The server's answers from its log: '-> 400 code' lines for refusals, the per-request
    line's outcome for what reached the engine."""
    counts: Counter[str] = Counter(f"{status} {code}" for status, code in re.findall(r"-> (\d{3}) ([\w ]+?):", log))
    engine_lines = r"^\S+ \S+ \S+: \S+ (ok|error|aborted) settings="  # time, level, logger: id outcome
    counts.update(f"engine {outcome}" for outcome in re.findall(engine_lines, log, re.M))
    return dict(counts.most_common())


def markdown(report: dict) -> str:
    """fuzz.json as bench/README.md shows it: the run, then the server's answers by status."""
    passed = "passed" if report["schemathesis_passed"] else "did not pass"
    healthy = "was healthy" if report["healthy_at_end"] else "was not healthy"
    lines = [f"Measured {report['date'][:10]} ({report['examples_per_operation']} examples per operation, seed "
             f"{report['seed']}): {report['requests_generated']:,} requests; every check {passed}; "
             f"{report['server_errors_5xx']} answered 5xx; {report['tracebacks_in_log']} tracebacks in the server's "
             f"log; the server {healthy} at the end. The server's answers, from its log:", "",
             "| answer | requests |", "| --- | --- |"]
    lines += [f"| {answer} | {count:,} |" for answer, count in report["answers_by_status"].items()]
    return "\n".join(lines)


def run(examples: int, seed: int, out: Path) -> int:
    """A schemathesis run of ``examples`` per operation against a fresh server; writes ``out``."""
    import httpx

    from rope_plugins.testing.launcher import running_server

    api_key = "fuzz-key"
    work = out.with_name(out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "server.log"
    with running_server(SERVER_FLAGS, log_path, env={"ROPE_EXTEND_API_KEY": api_key}) as server:
        print(f"fuzzing {server.base} with {examples} examples per operation (seed {seed}) ...", flush=True)
        result = schemathesis_run(server.base, api_key, examples=examples, seed=seed, report_dir=work)
        healthy = httpx.get(f"{server.base}/health").status_code == 200
    log = log_path.read_text()
    summary = result.stdout[-3000:]
    report = {
        "date": harness.now(),
        "server_flags": SERVER_FLAGS, "examples_per_operation": examples, "seed": seed, "checks": CHECKS,
        "requests_generated": generated_count(result.stdout), "schemathesis_passed": result.returncode == 0,
        "server_errors_5xx": sum(n for key, n in answers_by_status(log).items() if key.startswith("5")),
        "answers_by_status": answers_by_status(log), "tracebacks_in_log": log.count("Traceback"),
        "log_bytes": len(log), "healthy_at_end": healthy, "schemathesis_summary": summary,
    }
    harness.write_json(report, out)
    print(summary)
    print(f"{report['requests_generated']} requests, {report['server_errors_5xx']} answered 5xx, "
          f"{report['tracebacks_in_log']} tracebacks; wrote {out}")
    return 0 if report["schemathesis_passed"] and healthy else 1
