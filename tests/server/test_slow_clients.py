"""Slow clients against the real server (real engine, default model, real HTTP on loopback),
started with ``--read-timeout 2`` (server/slow_clients.py).

In one wave: 300 connections that send their headers a byte at a time are each answered 408
and closed between 2 s and 2 s + slack after they opened; a body that stalls half-way has its
connection closed; meanwhile /health (polled, answered within half a second as a rule), a
completion, a body sent in two parts within the deadline and a keep-alive connection left idle
past the deadline are all answered.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from tests.server.test_server import API_KEY, MODEL, start_server

READ_TIMEOUT = 2.0
SLACK = 3.0  # a loaded two-core machine: the event loop, 300 timers, the engine's processes
TRICKLERS = 300
TRICKLE_EVERY = 0.5  # seconds between bytes: their headers would take 30 s
SLOW_HEADERS = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: one-byte-at-a-time\r\n\r\n"
COMPLETION = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}).encode()
POST_HEAD = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {API_KEY}\r\n"
             f"content-type: application/json\r\ncontent-length: {len(COMPLETION)}\r\n\r\n").encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("slow_clients") / "server.log", "--max-model-len", "512",
                          "--read-timeout", str(READ_TIMEOUT))
    yield server
    server.stop()


async def trickle(port: int) -> tuple[float, bytes]:
    """Send SLOW_HEADERS a byte at a time until the server closes: the seconds from asking to
    connect to the close, and what the server sent. The server's deadline runs from its accept,
    which comes after the ask; with 300 connections opening at once on a loaded machine, this
    loop can see its connection a second after the server did, so the clock starts before it."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.create_task(reader.read())  # up to the server's close
    for byte in SLOW_HEADERS:
        writer.write(bytes([byte]))
        await asyncio.wait([answer], timeout=TRICKLE_EVERY)
        if answer.done():
            break
    try:
        received = await asyncio.wait_for(answer, 10)  # the headers complete: the server's answer
    except ConnectionResetError:  # a byte arrived after the server closed
        received = b""
    closed = time.monotonic() - start
    writer.close()
    return closed, received


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
    return int(head.split()[1]), await reader.readexactly(int(fields[b"content-length"]))


async def stalled_body(port: int) -> tuple[float, bytes]:
    """Headers, half the body, then nothing: the seconds until the server closes, and what it sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(POST_HEAD + COMPLETION[: len(COMPLETION) // 2])
    received = await asyncio.wait_for(reader.read(), READ_TIMEOUT + SLACK + 10)
    writer.close()
    return time.monotonic() - start, received


async def body_in_two_parts(port: int) -> int:
    """Half the body, a pause shorter than the deadline, the rest: answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(POST_HEAD + COMPLETION[: len(COMPLETION) // 2])
    await asyncio.sleep(READ_TIMEOUT / 2)
    writer.write(COMPLETION[len(COMPLETION) // 2:])
    status, _ = await read_response(reader)
    writer.close()
    return status


async def idle_keep_alive(port: int) -> list[int]:
    """Two requests on one connection, idle between them past the read deadline but within
    uvicorn's keep-alive (5 s): the deadline runs from a request's first byte, not while idle."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    statuses = []
    for pause in (0, READ_TIMEOUT + 1):
        await asyncio.sleep(pause)
        writer.write(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        statuses.append((await read_response(reader))[0])
    writer.close()
    return statuses


async def wave(base: str, port: int) -> dict:
    tricklers = [asyncio.create_task(trickle(port)) for _ in range(TRICKLERS)]
    others = asyncio.gather(stalled_body(port), body_in_two_parts(port), idle_keep_alive(port))
    health: list[tuple[int, float, float]] = []  # status, when asked (s into the wave), seconds to answer
    wave_start = time.monotonic()
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        completion = asyncio.create_task(http.post("/v1/completions", content=COMPLETION,
                                                   headers={"content-type": "application/json"}))
        while not all(task.done() for task in tricklers):  # /health every 0.2 s until the last is closed
            start = time.monotonic()
            health.append(((await http.get("/health")).status_code, start - wave_start, time.monotonic() - start))
            await asyncio.sleep(0.2)
        completion = await completion
    stalled, two_parts, keep_alive = await others
    return {"tricklers": [task.result() for task in tricklers], "health": health, "completion": completion,
            "stalled": stalled, "two_parts": two_parts, "keep_alive": keep_alive}


def test_slow_clients_are_cut_at_the_read_deadline_while_the_server_keeps_answering(server):
    port = int(server.base.rsplit(":", 1)[1])
    started = time.monotonic()
    result = asyncio.run(wave(server.base, port))
    wall = time.monotonic() - started

    closed = sorted(seconds for seconds, _ in result["tricklers"])
    slowest_health = max(seconds for _, _, seconds in result["health"])
    print(f"\n{TRICKLERS} slow connections closed {closed[0]:.2f} .. {closed[-1]:.2f} s after opening; wave "
          f"{wall:.1f} s; /health polled {len(result['health'])} times, slowest {slowest_health:.2f} s; "
          f"stalled body closed after {result['stalled'][0]:.2f} s")
    assert READ_TIMEOUT - 0.2 <= closed[0] and closed[-1] <= READ_TIMEOUT + SLACK
    answers = [received for _, received in result["tricklers"]]
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), {answer[:40] for answer in answers}
    assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"

    print("/health polls (asked at s: took s):", ", ".join(f"{at:.2f}: {took:.2f}" for _, at, took in result["health"]))
    assert {status for status, _, _ in result["health"]} == {200} and len(result["health"]) >= 5
    # answered promptly as a rule; a single poll may wait out a stall of the loaded machine (CI saw one of
    # 2.3 s that no rerun here showed, polls asked in the storm of 300 timeouts take 0.06-0.08 s here)
    assert statistics.median(seconds for _, _, seconds in result["health"]) < 0.5
    assert slowest_health < SLACK
    assert result["completion"].status_code == 200, result["completion"].text
    assert result["completion"].json()["choices"][0]["text"]
    assert result["two_parts"] == 200
    assert result["keep_alive"] == [200, 200]

    seconds, received = result["stalled"]
    assert READ_TIMEOUT - 0.2 <= seconds <= READ_TIMEOUT + SLACK and received == b""

    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
    assert "Traceback" not in server.log.read_text()
