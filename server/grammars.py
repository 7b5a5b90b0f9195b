"""A request's grammar compiled and tried before the engine sees it, so that a grammar the engine
would fail on is a 400 naming its field rather than a 500 from inside the engine.

vLLM checks a grammar's syntax when it admits a request, but compiles it against the
vocabulary only in the engine, and learns there what the grammar allows: a compile that runs
past vLLM's bound (``VLLM_REGEX_COMPILATION_TIMEOUT_S``, for a regex) or a grammar that allows
no token at all (``root ::= root "a"``) ends the request with an error the API can only call
internal. Here the same compile (vLLM's own xgrammar backend, on the engine's tokenizer and
vocabulary) runs in front, held to :attr:`GrammarCheck.bound` seconds, and its first state must
allow a token. A grammar that passes is compiled again by the engine; the backend caches
compiled grammars, so a schema sent again costs nothing here.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.v1.structured_output.request import get_structured_output_key

# compiles at once: a grammar that never finishes compiling holds its thread until it does
COMPILE_THREADS = 4


class GrammarCheck:
    """Compiles each request's grammar with vLLM's xgrammar backend (the engine's default),
    within ``bound`` seconds of compile time, and tries its first step."""

    def __init__(self, vllm_config: Any, tokenizer: Any, vocab_size: int, bound: float) -> None:
        self.vllm_config, self.tokenizer, self.vocab_size, self.bound = vllm_config, tokenizer, vocab_size, bound
        self.executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-check")
        self._backend = None
        self._backend_lock = threading.Lock()

    def backend(self):
        with self._backend_lock:
            if self._backend is None:
                from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

                self._backend = XgrammarBackend(self.vllm_config, tokenizer=self.tokenizer,
                                                vocab_size=self.vocab_size)
            return self._backend

    async def check(self, params: Any) -> None:
        """Raises VLLMValidationError (whose message names the grammar) when ``params``' grammar
        does not compile within the bound or allows no token at its start."""
        constraint = getattr(params, "structured_outputs", None)
        if constraint is None or getattr(constraint, "_backend", None) != "xgrammar":
            return
        kind, spec = get_structured_output_key(constraint)
        started = threading.Event()
        loop = asyncio.get_running_loop()
        compiled = loop.run_in_executor(self.executor, self.compile, kind, spec, started)
        compiled.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, even if late
        # the bound counts compile time only, not a wait behind other requests' compiles
        while not started.is_set() and not compiled.done():
            await asyncio.sleep(0.01)
        try:
            grammar = await asyncio.wait_for(asyncio.shield(compiled), self.bound)
        except Exception as error:  # vLLM's own clock on a regex compile raises ValueError("... timed out ...")
            if isinstance(error, TimeoutError) or "timed out" in str(error):
                raise VLLMValidationError(f"the grammar did not compile within this server's bound of {self.bound:g} "
                                          "s (a regex's alternatives or repetitions that expand too far?)") from None
            raise VLLMValidationError(f"the grammar does not compile: {error}") from None
        if not allows_a_token(grammar, self.vocab_size):
            raise VLLMValidationError("the grammar allows no token at its start (left recursion, or a string no "
                                      "token can begin), so no text can satisfy it")

    def compile(self, kind: Any, spec: str, started: threading.Event):
        started.set()
        return self.backend().compile_grammar(kind, spec)


def allows_a_token(grammar: Any, vocab_size: int) -> bool:
    """Whether a compiled grammar's first state allows any token (its end included)."""
    import xgrammar

    if grammar.is_terminated():
        return True
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return bool(bitmask.any())
