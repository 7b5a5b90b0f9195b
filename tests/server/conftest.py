"""The server that test_server.py and the playground's browser tests share: a server start is
the dearest thing in these tests, and their flags agree."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    from tests.server.test_server import STEP_TOKENS, start_server

    server = start_server(tmp_path_factory.mktemp("server") / "server.log", "--max-num-seqs", "2",
                          "--max-waiting", "1", "--shutdown-timeout", "60", "--max-num-batched-tokens",
                          str(STEP_TOKENS))
    yield server
    server.stop()
