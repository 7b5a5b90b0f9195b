"""make run's supervisor (server/supervisor.py): when it starts the server again, and how long it waits."""

from __future__ import annotations

import json

from rope_plugins.server.supervisor import (
    LONGEST_DELAY,
    START_FAILURES,
    STEADY_SECONDS,
    USAGE_ERROR,
    Backoff,
    Exit,
    describe,
    read_report,
)


def test_the_wait_doubles_to_its_bound_and_starts_over_after_a_steady_run():
    backoff = Backoff()
    waits = [backoff.next(Exit(3, 10.0)) for _ in range(8)]
    assert waits == [1, 2, 4, 8, 16, LONGEST_DELAY, LONGEST_DELAY, LONGEST_DELAY]
    assert backoff.next(Exit(3, STEADY_SECONDS)) == 1
    assert backoff.next(Exit(-9, 5.0)) == 2, "a server killed (the OOM killer, say) is started again too"


def test_a_clean_exit_or_bad_flags_are_not_restarted():
    assert Backoff().next(Exit(0, 1.0)) is None
    assert Backoff().next(Exit(USAGE_ERROR, 1.0)) is None


def test_an_engine_that_never_starts_is_given_up_after_a_few_tries_but_deaths_after_serving_never_are():
    backoff = Backoff()
    tries = [backoff.next(Exit(3, 30.0, "the engine failed: no memory", served=False)) for _ in range(START_FAILURES)]
    assert None not in tries[:-1] and tries[-1] is None
    backoff = Backoff()
    assert all(backoff.next(Exit(3, 30.0, "the engine failed", served=True)) is not None for _ in range(50))


def test_the_servers_report_and_its_absence(tmp_path):
    report = tmp_path / "exit.json"
    report.write_text(json.dumps({"reason": "the engine failed: engine died", "served": True}))
    assert read_report(report) == ("the engine failed: engine died", True)
    report.write_text("")
    assert read_report(report) == ("", True)
    assert describe(3) == "exited with status 3" and describe(-9) == "was killed by SIGKILL"
