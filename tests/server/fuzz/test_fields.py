"""tests/server/fuzz/fields.py: the generated requests cover the length bands and routes, and the report renders."""

from __future__ import annotations

import random

from tests.server.fuzz import fields as fuzz_fields


class WordTexts:
    """Stands in for the tokenizer's windows: one word per token."""

    def window(self, rng, tokens):
        return " ".join("w" for _ in range(tokens))


def test_generated_requests_span_every_band_and_route_and_mix_valid_and_hostile_values():
    rng = random.Random(0)
    requests = [fuzz_fields.generate(rng, WordTexts()) for _ in range(400)]
    assert {band for _, band, _ in requests} == {band for band, *_ in fuzz_fields.BANDS}
    assert {route for route, _, _ in requests} == {route for route, *_ in fuzz_fields.ROUTES}
    for _, band, body in requests:
        lowest, highest = next((low, high) for name, low, high in fuzz_fields.BANDS if name == band)
        text = body.get("prompt") or body.get("input") or body["messages"][0]["content"]
        assert lowest <= len(text.split()) <= highest and body["model"] == fuzz_fields.MODEL
    fields = [name for _, _, body in requests for name in body]
    assert {"seed", "stream", "context_extension", "structured_outputs", "tools"} <= set(fields)
    assert any(body.get("seed") == 2**63 for _, _, body in requests), "hostile values are drawn too"


def test_a_stream_with_a_server_error_event_counts_as_one():
    assert fuzz_fields.server_error_in(['data: {"error": {"type": "server_error", "code": null}}'])
    assert not fuzz_fields.server_error_in(['data: {"error": {"type": "invalid_request_error", "code": 400}}',
                                            "data: [DONE]"])


def test_the_report_renders_its_bands():
    records = [{"band": "1-32", "status": 200, "server_error": False}, {"band": "1-32", "status": 400,
                                                                        "server_error": False}]
    report = fuzz_fields.summarize(records, "", True, 3, 10.0)
    text = fuzz_fields.markdown(report)
    assert "0 answered 5xx" in text and "| 1-32 | 1 | 1 |" in text and "the engine served" in text
