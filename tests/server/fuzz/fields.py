"""Generated requests that combine fields, valid and hostile, over prompt lengths up to the served
maximum and past it, sent at once from many threads: ``python -m tests.server.fuzz --long-prompts N``.

Every answer must be below 500 (a 400 naming a field, a 429 when full, a 200), a stream must
carry no server error, no traceback may reach the log, and the engine must serve at the end.
The prompts are windows of CPython's own sources (text no one here wrote) cut to an exact token
count, so that a length band means what it says; the served context is 1,024 tokens in steps of
128, so every prompt past 128 tokens is prefilled in chunks.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import harness

MODEL = "SmolLM2-135M-Instruct"
SERVED, STEP = 1024, 128
SERVER_FLAGS = ["--max-model-len", str(SERVED), "--max-num-batched-tokens", str(STEP), "--max-num-seqs", "8",
                "--max-waiting", "16", "--max-logprob-entries", "5000"]
THREADS = 12
# prompt length bands, in tokens: (name, lowest, highest); "past" is longer than the served context
BANDS = [("1-32", 1, 32), (f"33-{STEP}", 33, STEP), (f"{STEP + 1}-512", STEP + 1, 512),
         (f"513-{SERVED - 8}", 513, SERVED - 8), ("past the maximum", SERVED + 1, SERVED + 400)]
METHODS = ["none", "rerope", "leaky_rerope", "self_extend", "ntk_old", "ntk_fixed", "ntk_mixed", "ntk_dynamic",
           "pi", "yarn", "string", "dual_chunk", "auto"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
          "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "string"}}}}}
HOSTILE_GRAMMARS = [{"grammar": 'root ::= root "a"'}, {"regex": "(unclosed"}, {"choice": []},
                    {"regex": "|".join(f"w{i}" for i in range(20_000))}, {"json": {"type": "objekt"}}]


HOSTILE_SHARE = 0.12  # of each field's values: the rest are valid, so that most requests reach the engine


def pick(rng: random.Random, valid: list[Any], hostile: list[Any]) -> Any:
    return rng.choice(hostile) if hostile and rng.random() < HOSTILE_SHARE else rng.choice(valid)


def extension(rng: random.Random) -> dict[str, Any]:
    settings: dict[str, Any] = {"method": pick(rng, METHODS, ["warp", ""])}
    extras = {"window": ([16, 256, 512], [4096, 0, -3, 2**40]), "leaky_k": ([2.0, 16.0], [0.0]),
              "factor": ([1.0, 2.0, 4.0, "auto"], [0.5, float("nan")]), "group": ([2, 8], [0]),
              "log_n": ([True, False], ["yes"])}
    for name in rng.sample(sorted(extras), rng.randint(0, 2)):
        settings[name] = pick(rng, *extras[name])
    return settings


# field: (valid values, hostile values)
SAMPLING = {"seed": ([0, 7, 2**63 - 1, -5], [2**63]), "temperature": ([0.0, 0.7, 1.5, 2.0], [-1.0]),
            "top_p": ([0.1, 0.9, 1.0], [0.0]), "top_k": ([-1, 1, 40], [-2]), "min_p": ([0.0, 0.2], [1.5]),
            "presence_penalty": ([0.0, 1.5], [3.0]), "frequency_penalty": ([0.5, -2.0], []),
            "repetition_penalty": ([1.0, 1.3], [0.0]), "stop": ([["\n"], ["the", "def"]], [[""], "x" * 2000]),
            "ignore_eos": ([True, False], []), "min_tokens": ([0, 2], [10**6]), "cache_salt": (["tenant-a"], [""]),
            "stream": ([True, False], [])}
GRAMMARS = [{"json": SCHEMA}, {"regex": "[a-z]{1,6}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a" | "b"'}]


def sampling(rng: random.Random) -> dict[str, Any]:
    """Sampling fields for any route: a few of them, mostly valid."""
    body = {}
    for name in rng.sample([*SAMPLING, "context_extension", "structured_outputs"], rng.randint(1, 6)):
        if name == "context_extension":
            body[name] = extension(rng)
        elif name == "structured_outputs":
            body[name] = pick(rng, GRAMMARS, HOSTILE_GRAMMARS)
        else:
            body[name] = pick(rng, *SAMPLING[name])
    return body


def chat_body(rng: random.Random, text: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": pick(rng, [1, 4, 16], [10**6]),
            **sampling(rng)}
    roll = rng.random()
    if roll < 0.15:
        body.update(tools=[TOOL], tool_choice=rng.choice(["required", "none", {"type": "function",
                                                                               "function": {"name": "f"}}]))
    elif roll < 0.3:
        body["response_format"] = rng.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA}}, {"type": "xml"}])
    if rng.random() < 0.2:
        body.update(logprobs=True, top_logprobs=pick(rng, [0, 5, 20], [21]))
    if rng.random() < 0.2:
        body["n"] = rng.choice([2, 3])
    return body


def completion_body(rng: random.Random, text: str) -> dict[str, Any]:
    body = {"prompt": text, "max_tokens": rng.choice([1, 4, 16]), **sampling(rng)}
    if rng.random() < 0.2:
        body["logprobs"] = pick(rng, [0, 3], [21])
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.1:
        body["echo"] = True
    return body


def responses_body(rng: random.Random, text: str) -> dict[str, Any]:
    body = {"input": text, "max_output_tokens": rng.choice([1, 8, 16]), "stream": rng.random() < 0.4}
    for name in ("seed", "temperature", "context_extension"):
        value = sampling(rng).get(name)
        if value is not None:
            body[name] = value
    if rng.random() < 0.2:
        body["tools"] = [rng.choice([{"type": "function", "name": "f", "parameters": {"type": "object"}},
                                     {"type": "web_search_preview"}])]
    return body


ROUTES = [("/v1/chat/completions", chat_body, 0.6), ("/v1/completions", completion_body, 0.3),
          ("/v1/responses", responses_body, 0.1)]


class Texts:
    """Windows of CPython's sources cut to an exact number of the served model's tokens."""

    def __init__(self, model_dir: str) -> None:
        import argparse as source_a
        import concurrent.futures as source_b
        import json as source_c

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        text = "\n".join(inspect.getsource(module) for module in (source_a, source_b.thread, source_c.decoder))
        self.ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def window(self, rng: random.Random, tokens: int) -> str:
        start = rng.randrange(0, len(self.ids) - tokens)
        return self.tokenizer.decode(self.ids[start:start + tokens])


def generate(rng: random.Random, texts: Texts) -> tuple[str, str, dict[str, Any]]:
    """One request: its route, its prompt's length band, its body."""
    band, lowest, highest = rng.choice(BANDS)
    route, make, _ = rng.choices(ROUTES, weights=[weight for *_, weight in ROUTES])[0]
    return route, band, {"model": MODEL, **make(rng, texts.window(rng, rng.randint(lowest, highest)))}


def server_error_in(events: list[str]) -> bool:
    """Whether a stream's events carry an error of the server's own (5xx)."""
    for line in events:
        if line.startswith("data: {") and '"error"' in line:
            error = json.loads(line[len("data: "):]).get("error") or {}
            if error.get("type") == "server_error" or str(error.get("code", "")).startswith("5"):
                return True
    return False


def send(client, route: str, body: dict[str, Any]) -> tuple[int, bool]:
    """The answer's status, and whether it (or its stream) was a server error."""
    content = json.dumps(body).encode()  # NaN as JSON writes it: the server must refuse it
    headers = {"content-type": "application/json"}
    if body.get("stream"):
        with client.stream("POST", route, content=content, headers=headers) as response:
            events = list(response.iter_lines())
            return response.status_code, response.status_code >= 500 or server_error_in(events)
    response = client.post(route, content=content, headers=headers)
    return response.status_code, response.status_code >= 500


def fire(base: str, api_key: str, requests: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every request from THREADS threads at once; one record per answer."""
    import httpx
    from tqdm import tqdm

    def one(request):
        route, band, body = request
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {api_key}"}, timeout=600) as client:
            began = time.monotonic()
            try:
                status, server_error = send(client, route, body)
            except httpx.HTTPError as error:
                status, server_error = -1, True
                body = {**body, "transport_error": repr(error)}
        return {"route": route, "band": band, "status": status, "server_error": server_error,
                "seconds": round(time.monotonic() - began, 2), "body": body if server_error else None}

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return list(tqdm(pool.map(one, requests), total=len(requests), desc="long-prompt fuzz", unit="req"))


def summarize(records: list[dict[str, Any]], log: str, healthy: bool, seed: int, seconds: float) -> dict[str, Any]:
    by_band = {band: dict(Counter(str(r["status"]) for r in records if r["band"] == band).most_common())
               for band, *_ in BANDS}
    return {"date": harness.now(), "seed": seed, "threads": THREADS,
            "server_flags": SERVER_FLAGS, "requests": len(records), "seconds": round(seconds),
            "answers_by_status": dict(Counter(str(r["status"]) for r in records).most_common()),
            "answers_by_prompt_tokens": by_band,
            "server_errors": [r for r in records if r["server_error"]],
            "tracebacks_in_log": log.count("Traceback"), "healthy_at_end": healthy}


def run_long_prompts(count: int, seed: int, out: Path) -> int:
    import httpx

    from rope_plugins.models.catalog import DEFAULT_MODEL
    from rope_plugins.models.provision import provision
    from rope_plugins.testing.launcher import running_server

    rng, api_key = random.Random(seed), "fuzz-key"
    texts = Texts(str(provision(DEFAULT_MODEL)))
    requests = [generate(rng, texts) for _ in range(count)]
    work = out.with_name(out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    with running_server(SERVER_FLAGS, work / "server.log", env={"ROPE_EXTEND_API_KEY": api_key}) as server:
        began = time.monotonic()
        records = fire(server.base, api_key, requests)
        healthy = httpx.get(f"{server.base}/health").status_code == 200
        seconds = time.monotonic() - began
    report = summarize(records, (work / "server.log").read_text(), healthy, seed, seconds)
    harness.write_json(report, out, default=str)
    print(f"{report['requests']} requests in {report['seconds']} s: {report['answers_by_status']}; "
          f"{len(report['server_errors'])} server errors, {report['tracebacks_in_log']} tracebacks; wrote {out}")
    return 0 if not report["server_errors"] and not report["tracebacks_in_log"] and healthy else 1


def markdown(report: dict[str, Any]) -> str:
    """fuzz_long.json as bench/README.md shows it."""
    statuses = sorted({status for counts in report["answers_by_prompt_tokens"].values() for status in counts})
    healthy = "served" if report["healthy_at_end"] else "did not serve"
    lines = [f"Measured {report['date'][:10]} (seed {report['seed']}, {report['threads']} threads, "
             f"{report['requests']:,} requests in {report['seconds']:,} s): {len(report['server_errors'])} answered "
             f"5xx; {report['tracebacks_in_log']} tracebacks in the server's log; the engine {healthy} at the end. "
             "Answers by prompt length (tokens) and status:", "",
             "| prompt tokens | " + " | ".join(statuses) + " |", "| --- |" + " --- |" * len(statuses)]
    for band, counts in report["answers_by_prompt_tokens"].items():
        lines.append(f"| {band} | " + " | ".join(f"{counts.get(status, 0):,}" for status in statuses) + " |")
    return "\n".join(lines)

