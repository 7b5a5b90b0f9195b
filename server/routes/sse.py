"""Server-sent events as the OpenAI streaming API sends them: ``data: {json}`` lines, then
``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


def sse_event(data: dict[str, Any] | str, raw: bool = False) -> str:
    return f"data: {data if raw else json.dumps(data, separators=(',', ':'))}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    async for event in events:
        yield event
    yield "data: [DONE]\n\n"
