"""Bounded admission: the sequences in flight, from before a request's prompt is tokenized until
its answer is done, held within the running + waiting capacity."""

from __future__ import annotations

from rope_plugins.server.errors import request_too_large, server_full
from rope_plugins.server.metrics import Metrics


class Capacity:
    """The server's sequences in flight, against ``--max-num-seqs`` + ``--max-waiting``."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit, self.metrics = limit, metrics
        self.in_flight = 0

    def admit(self, count: int, param: str) -> Admission:
        """A claim on ``count`` sequences (prompts x n): beyond the capacity, 429 with
        Retry-After; a request that could never fit, 400 naming ``param``. Release the returned
        ticket when the request is done (idempotent)."""
        if count > self.limit:
            raise request_too_large(param, count, self.limit)
        if self.in_flight + count > self.limit:
            raise server_full(self.in_flight, self.limit)
        self.in_flight += count
        self.metrics.in_flight.set(self.in_flight)
        return Admission(self, count)


class Admission:
    """One request's claim on ``count`` sequences of the capacity."""

    def __init__(self, capacity: Capacity, count: int) -> None:
        self.capacity, self.count = capacity, count

    def release(self) -> None:
        if self.count:
            self.capacity.in_flight -= self.count
            self.capacity.metrics.in_flight.set(self.capacity.in_flight)
            self.count = 0
