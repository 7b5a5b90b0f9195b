"""Schemathesis hooks for bench/fuzz.py and its test (loaded through ``SCHEMATHESIS_HOOKS``): generated
bodies name the served model, so that they reach the engine instead of stopping at the model
check, and ask for a few tokens at most, so that a run stays within minutes."""

from __future__ import annotations

import os

import schemathesis

from rope_plugins.server.schemas import MAX_INT32, MAX_NAME_CHARS

MODEL = os.environ.get("FUZZ_MODEL", "SmolLM2-135M-Instruct")
MAX_TOKENS = 4


@schemathesis.hook
def map_body(context, body):
    """Only values the schema allows are replaced: a negative case must stay invalid."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str) and len(body["model"]) <= MAX_NAME_CHARS:
        body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None or (type(value) is int and MAX_TOKENS < value <= MAX_INT32):
            body[name] = MAX_TOKENS
    return body
