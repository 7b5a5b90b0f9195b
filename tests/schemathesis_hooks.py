"""Schemathesis hooks for the fuzz test (loaded through ``SCHEMATHESIS_HOOKS``): generated
bodies name the served model, so that they reach the engine instead of stopping at the model
check, and ask for a few tokens at most, so that a run stays within minutes."""

from __future__ import annotations

import os

import schemathesis

MODEL = os.environ.get("FUZZ_MODEL", "SmolLM2-135M-Instruct")
MAX_TOKENS = 4


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS):
            body[name] = MAX_TOKENS
    return body
