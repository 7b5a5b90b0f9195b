"""Schemathesis hooks for tests/server/fuzz/schema.py and its test (loaded through ``SCHEMATHESIS_HOOKS``): generated
bodies name the served model, so that they reach the engine instead of stopping at the model
check, and ask for a few tokens at most, so that a run stays within minutes."""

from __future__ import annotations

import os

import schemathesis

from rope_plugins.server.schemas import MAX_INT32, MAX_NAME_CHARS

MODEL = os.environ.get("FUZZ_MODEL", "SmolLM2-135M-Instruct")
MAX_TOKENS = 4


# Each operation's own bound on the tokens generated: the other names would be unknown fields there.
TOKEN_BOUND = {"/v1/chat/completions": ("max_completion_tokens", "max_tokens"), "/v1/completions": ("max_tokens",),
               "/v1/responses": ("max_output_tokens",)}


@schemathesis.hook
def before_call(context, case, kwargs):
    """Every phase's bodies (the coverage phase's too, which a ``map_body`` hook never sees). Only
    values the schema allows are replaced: a negative case must stay invalid."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and len(body["model"]) <= MAX_NAME_CHARS:
        body["model"] = MODEL
    names = TOKEN_BOUND.get(case.operation.path, ())
    given = [name for name in names if name in body] or list(names[-1:])
    for name in given:
        value = body.get(name)
        if value is None or (type(value) is int and MAX_TOKENS < value <= MAX_INT32):
            body[name] = MAX_TOKENS
