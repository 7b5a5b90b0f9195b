"""Seeded sampling on vLLM 0.32's CPU runner at every prompt length (docs/upstream_cpu_seed.md).

A prompt longer than one step's token budget is prefilled in chunks. After each partial chunk
vLLM's runner samples a token for the row anyway, discards it, and rewinds the request's
``torch.Generator`` by its Philox offset (``GPUModelRunner._bookkeeping_sync``) so that the
discarded draw leaves no trace. A CPU generator (Mersenne Twister) has no offset: the rewind
raises, and the engine dies with every request in it.

:class:`SeededCPUModelRunner` reaches the same result without an offset: while a step samples
and books its tokens, the generators of the rows whose token is discarded are set aside, so
those rows draw from the engine's global generator (their token is thrown away) and their own
generator is not touched at all; there is then nothing to rewind. A seeded request therefore
draws from its generator exactly once per kept token, whatever the chunking, the batch or
the prefix cache: the same seed and prompt give the same tokens.

:class:`SeededCPUWorker` is vLLM's CPU worker with that runner; the engine names it through
``ParallelConfig.worker_cls`` (``--worker-cls``), vLLM's seam for a worker of one's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from rope_plugins.worker.memory import start_memory_log


def discarded_rows(discard_mask: np.ndarray, num_rows: int) -> list[int]:
    """The batch rows whose sampled token this step throws away (partial prefills)."""
    return [int(row) for row in np.nonzero(discard_mask[:num_rows])[0]]


@contextlib.contextmanager
def set_aside(generators: dict[int, torch.Generator], rows: list[int]) -> Iterator[None]:
    """``generators`` without the entries of ``rows`` while the block runs, then as before."""
    kept = {row: generators.pop(row) for row in rows if row in generators}
    try:
        yield
    finally:
        generators.update(kept)


class SeededCPUModelRunner(CPUModelRunner):
    """vLLM's CPU model runner whose discarded samples never touch a request's generator."""

    def _discarded_generators_set_aside(self):
        batch = self.input_batch
        return set_aside(batch.generators, discarded_rows(self.discard_request_mask.np, batch.num_reqs))

    def _sample(self, *args, **kwargs):
        with self._discarded_generators_set_aside():
            return super()._sample(*args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        with self._discarded_generators_set_aside():
            return super()._bookkeeping_sync(*args, **kwargs)


class SeededCPUWorker(CPUWorker):
    """vLLM's CPU worker running :class:`SeededCPUModelRunner` (its V1 runner; the V2 runner
    keeps no ``torch.Generator`` per request and is left as it is); it logs its memory when
    asked (:mod:`rope_plugins.worker.memory`)."""

    def init_device(self) -> None:
        super().init_device()
        if type(self.model_runner) is CPUModelRunner:
            # vLLM's worker builds its runner by name inside init_device; the seam is the worker
            # class, so the stock runner it built is replaced by ours, built the same way.
            self.model_runner = SeededCPUModelRunner(self.vllm_config, self.device)
        start_memory_log()
