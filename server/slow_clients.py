"""Read deadlines for slow clients: uvicorn's httptools protocol with two timers more.

uvicorn has no timeout while it reads a request (its one timer, ``timeout_keep_alive``, covers
only the idle time between requests), so a client that sends its headers a byte at a time, or
stops half-way through its body, holds its connection for as long as it likes, and a few
hundred such clients hold the server's sockets (a "slowloris"). This protocol, given to
``uvicorn.Config(http=...)``, arms its timers the way uvicorn arms the keep-alive one:

- headers: a request's headers must be complete within ``read_timeout`` of the connection's
  opening, or of the first byte of a later request on a kept-alive connection; else 408, after
  which the connection is half-closed and read (its bytes dropped) for a while before it closes,
  so a client still sending can read the 408 (or just closing, if a response is being written
  on the connection);
- body: each read of the body must come within ``read_timeout`` of the previous one; else the
  connection is closed, and the app, waiting for the body, is told the client disconnected.

httptools' protocol is the one uvicorn picks here: vLLM requires ``fastapi[standard]``, which
installs ``uvicorn[standard]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rope_plugins.server.errors import error_body

logger = logging.getLogger(__name__)
# seconds a connection answered 408 is still read, its bytes dropped, before it is closed
LINGER_SECONDS = 2.0


class ReadDeadlineProtocol(HttpToolsProtocol):
    read_timeout: float = 30.0  # seconds; set by read_deadline_protocol

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_deadline: asyncio.TimerHandle | None = None
        self.waiting_for: Literal["headers", "body"] = "headers"
        self.lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.start_deadline("headers")  # a connection that never sends a byte is held too

    def data_received(self, data: bytes) -> None:
        if not self.lingering:  # after a 408 the rest of the request is dropped unread
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_deadline()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self.cancel_deadline()  # the connection is the WebSocket protocol's now
        super().handle_websocket_upgrade()

    # httptools' parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.read_deadline is None:  # a later request on a kept-alive connection: from its first byte
            self.start_deadline("headers")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.start_deadline("body")  # a request without a body completes at once, which cancels it

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self.start_deadline("body")

    def on_message_complete(self) -> None:
        self.cancel_deadline()
        super().on_message_complete()

    def start_deadline(self, waiting_for: Literal["headers", "body"]) -> None:
        self.cancel_deadline()
        self.waiting_for = waiting_for
        self.read_deadline = self.loop.call_later(self.read_timeout, self.read_timed_out)

    def cancel_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def read_timed_out(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing():
            return
        # not the client's delay: the server stopped reading (a full body buffer, a queued pipelined
        # request), or the client waits for the "100 Continue" the app sends when it reads the body
        if self.flow.read_paused or (self.waiting_for == "body" and self.cycle.waiting_for_100_continue):
            self.start_deadline(self.waiting_for)
            return
        answer = self.waiting_for == "headers" and (self.cycle is None or self.cycle.response_complete)
        logger.info("%s%s not received in %g s: %sconnection closed", "%s:%d: " % self.client if self.client else "",
                    "request headers" if self.waiting_for == "headers" else "the body's next part",
                    self.read_timeout, "408, " if answer else "")
        if answer:  # nothing is being answered on the connection, so the client can read why
            self.send_408_response()
            self.close_lingering()
        else:
            self.transport.close()

    def close_lingering(self) -> None:
        """Half-close after the 408 and drop what still arrives for LINGER_SECONDS, then close (a
        "lingering close", as nginx does): a client still sending its request to a closed socket
        gets a reset, which can discard the 408 before the client has read it."""
        self.lingering = True
        self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def send_408_response(self) -> None:
        """Written as uvicorn writes its own 400, with the OpenAI error body the server's answers have."""
        body = json.dumps(error_body(408, f"the request was not received within {self.read_timeout:g} s")).encode()
        head = [b"HTTP/1.1 408 Request Timeout\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)


def read_deadline_protocol(read_timeout: float) -> type[ReadDeadlineProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, which builds it with its own arguments."""
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), {"read_timeout": read_timeout})
