"""Soak: the server as ``make run`` starts it (under its supervisor), an hour of clients using
everything at once: nothing may fail, restart or leak.

    .venv/bin/python -m bench soak                  # 60 minutes: bench/results/soak.{json,png}
    .venv/bin/python -m bench soak --minutes 3 --out /tmp/soak.json

Four clients per running sequence send request after request: prompts of 1,024 tokens up to the
served maximum (density ∝ 1/length², as rare as they are dear), every method and ``auto``, chat
and completions, seeds, JSON schemas, forced tool calls, streams (a quarter dropped midway).
``--warm-up`` first sends one prompt at the served maximum per kernel path, so that the far-key
tables the engine keeps by design are full before the clock. The report: answers by status (no
5xx), the supervisor's restarts (none), each process's RSS slope over the second half with its
95% interval (and the worker's anonymous memory's, and its live heap as its allocator counts it), TTFT
and time per output token at p50 and p99, plotted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import harness
from rope_plugins.rules.settings import METHOD_NAMES

RESULTS = harness.RESULTS
MODEL = "SmolLM2-135M-Instruct"
RUNNING = 8  # make run's --max-num-seqs
CLIENTS = 4 * RUNNING
SERVED = 32768  # make run's --max-model-len
OUTPUT_TOKENS = 24
METHODS = ["auto", *METHOD_NAMES]
SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 24}}, "required": ["topic"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"term": {"type": "string", "maxLength": 24}}, "required": ["term"]}}}
WINDOW_MINUTES = 5
WARM_UP_METHODS = ["none", "rerope", "leaky_rerope", "self_extend", "string", "dual_chunk", "ntk_mixed"]
# The span over which the memory samples' residuals stay correlated (the committed soak's
# decorrelate well within it): the lags of the slope's Newey-West errors.
CORRELATED_SECONDS = 60
PROCESS_NAMES = {"python": "API server", "VLLM::EngineCore": "engine core", "VLLM::Worker": "worker"}


def prompt_length(rng: random.Random, shortest: int = 1024, longest: int = SERVED - 128) -> int:
    """A length with density proportional to 1/length² on [shortest, longest]: the inverse of its CDF."""
    return int(shortest / rng.uniform(shortest / longest, 1.0))


def draw_request(rng: random.Random, tokens: list[int], tokenizer) -> tuple[str, dict[str, Any], bool, int]:
    """(route, body, abandon midway, prompt tokens) of one client's next request."""
    length = prompt_length(rng)
    start = rng.randrange(0, len(tokens) - length)
    text = tokenizer.decode(tokens[start:start + length])
    extension = {"method": rng.choice(METHODS), **({"log_n": True} if rng.random() < 0.3 else {})}
    body: dict[str, Any] = {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "temperature": rng.choice([0.0, 0.8]),
                            "context_extension": extension, "stream": rng.random() < 0.8}
    if body["temperature"] and rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    abandon = body["stream"] and rng.random() < 0.25
    if rng.random() < 0.3:
        return "/v1/completions", {**body, "prompt": text}, abandon, length
    body["messages"] = [{"role": "user", "content": text + "\n\nWhat is this text about?"}]
    roll = rng.random()
    if roll < 0.2:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "about", "schema": SCHEMA}}
    elif roll < 0.35:
        body.update(tools=[TOOL], tool_choice="required", max_tokens=48)
    return "/v1/chat/completions", body, abandon, length


def measure(client, route: str, body: dict[str, Any], abandon: bool) -> dict[str, Any]:
    """One request: its status, whether the server failed it, TTFT and time per output token (streams)."""
    began = time.monotonic()
    record = {"t_s": None, "route": route, "method": body["context_extension"]["method"], "stream": body["stream"],
              "abandoned": False, "status": None, "server_error": False, "ttft_s": None, "tpot_s": None}
    if not body["stream"]:
        status = client.post(route, json=body).status_code
        return {**record, "status": status, "server_error": status >= 500}
    chunks = []  # when each one came
    with client.stream("POST", route, json=body) as response:
        record["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                record["server_error"] = event["error"].get("type") == "server_error"
                break
            if event.get("choices"):
                chunks.append(time.monotonic())
                if abandon and len(chunks) >= 3:
                    record["abandoned"] = True
                    break
        record["server_error"] = record["server_error"] or response.status_code >= 500
    if chunks:
        record["ttft_s"] = round(chunks[0] - began, 3)
        record["tpot_s"] = round((chunks[-1] - chunks[0]) / (len(chunks) - 1), 4) if len(chunks) > 1 else None
    return record


def client_loop(base: str, seed: int, deadline: float, began: float, tokens, tokenizer, records: list) -> None:
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=7200) as client:
        while time.monotonic() < deadline:
            route, body, abandon, length = draw_request(rng, tokens, tokenizer)
            sent = time.monotonic() - began
            try:
                record = measure(client, route, body, abandon)
            except httpx.HTTPError as error:
                record = {"route": route, "status": None, "server_error": True, "error": repr(error)}
            records.append({**record, "t_s": round(sent, 1), "prompt_tokens": length})


def warm_up(base: str, pid: int, tokens: list[int], tokenizer, methods: list[str]) -> dict[str, Any]:
    """One completion per method at the served maximum, all at once; what they took, and the
    memory of the server (``pid``) before and after."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    length = SERVED - 4 * OUTPUT_TOKENS
    prompt = tokenizer.decode(tokens[:length])
    before, began = memory_sample(pid, 0.0)["rss_mib"], time.monotonic()
    with httpx.Client(base_url=base, timeout=7200) as client, ThreadPoolExecutor(len(methods)) as pool:
        statuses = list(pool.map(lambda method: client.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "context_extension": {"method": method}}).status_code, methods))
    return {"methods": methods, "prompt_tokens": length, "statuses": statuses,
            "seconds": round(time.monotonic() - began, 1), "rss_before_mib": before,
            "rss_after_mib": memory_sample(pid, 0.0)["rss_mib"]}


def memory_sample(pid: int, t_s: float) -> dict:
    """Resident memory of the supervisor (``pid``) and each of its descendants, in MiB by process
    name (vLLM names its engine core's process): all of it, and the part that is no file's
    (``anon``: what a leak grows; mapped libraries and shared memory are the rest)."""
    import psutil

    rss, anon = Counter(), Counter()
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            name = "supervisor" if process.pid == pid else process.name()
            memory = process.memory_info()
            rss[name] += memory.rss / 2**20
            anon[name] += (memory.rss - memory.shared) / 2**20
    by_process, anon_by_process = ({name: round(size, 1) for name, size in sizes.items()} for sizes in (rss, anon))
    return {"t_s": round(t_s, 1), "rss_mib": round(sum(by_process.values()), 1), "by_process": by_process,
            "anon_by_process": anon_by_process}


def worker_allocator(log_text: str, began: float) -> list[dict]:
    """The worker's own memory lines (``ROPE_EXTEND_MEMORY_LOG_S``) as samples from ``began``
    (the epoch's seconds): what its allocator counts live (``allocated``) beside what it holds."""
    from rope_plugins.worker.memory import parse_memory_line

    lines = [parse_memory_line(line) for line in log_text.splitlines()]
    return [{"t_s": round(line.pop("time") - began, 1), "allocator": line} for line in lines
            if line is not None and line["time"] >= began]


def rss_slope(samples: list[dict], process: str | None = None, kind: str = "by_process") -> dict[str, float]:
    """Least-squares slope of RSS (the tree's, or one ``process``'s ``kind`` of memory) over the second
    half of the run (after warm-up), MiB per hour, with its 95% interval from Newey-West errors:
    successive samples are correlated (the memory follows the prompts in flight), and errors that
    took them as independent would give an interval too narrow."""
    import statsmodels.api as sm

    half = [s for s in samples
            if s["t_s"] >= samples[-1]["t_s"] / 2 and (process is None or process in s.get(kind, {}))]
    hours = [s["t_s"] / 3600 for s in half]
    spacing = (half[-1]["t_s"] - half[0]["t_s"]) / max(1, len(half) - 1)
    fit = sm.OLS([s[kind][process] if process else s["rss_mib"] for s in half], sm.add_constant(hours)).fit(
        cov_type="HAC", cov_kwds={"maxlags": max(1, round(CORRELATED_SECONDS / max(spacing, 1e-9)))})
    low, high = fit.conf_int(0.05)[1]
    low, high = (low, high) if math.isfinite(low) and math.isfinite(high) else (fit.params[1], fit.params[1])
    # + 0.0: a slope of -0.0 reads as +0
    return {"mib_per_hour": round(float(fit.params[1]), 1) + 0.0, "low": round(float(low), 1) + 0.0,
            "high": round(float(high), 1) + 0.0, "samples": len(half)}


def slopes_by_process(samples: list[dict], kind: str = "by_process") -> dict[str, dict[str, float]]:
    """Each process's slope of one kind of memory (none where the samples name no processes)."""
    return {name: rss_slope(samples, name, kind) for name in samples[-1].get(kind, {})}


def windows(records: list[dict], minutes: float) -> list[dict]:
    """TTFT and time per output token at p50 and p99, by WINDOW_MINUTES of sending time."""
    from rope_plugins.deploy.loadtest import nearest_rank

    rows = []
    for start in range(0, int(math.ceil(minutes)), WINDOW_MINUTES):
        inside = [r for r in records if start * 60 <= r["t_s"] < (start + WINDOW_MINUTES) * 60]
        row = {"from_min": start, "requests": len(inside)}
        for name in ("ttft", "tpot"):
            values = sorted(r[f"{name}_s"] for r in inside if r.get(f"{name}_s") is not None)
            row |= {f"{name}_p{round(100 * q)}": nearest_rank(values, q) if values else None for q in (0.5, 0.99)}
        rows.append(row)
    return rows


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()

    figure, (memory, ttft, tpot) = plt.subplots(1, 3, figsize=(14, 4.2))
    samples, slope = report["rss"], report["rss_slope"]
    series = [("RSS, all processes", samples, lambda s: s["rss_mib"]),
              ("worker RSS", samples, lambda s: s["by_process"].get("VLLM::Worker")),
              ("worker live heap", report["worker_allocator"], lambda s: s["allocator"].get("allocated"))]
    for label, points, size in series:
        points = [(p["t_s"] / 60, size(p)) for p in points if size(p) is not None]
        if points:
            memory.plot([t for t, _ in points], [m - points[0][1] for _, m in points], label=label, linewidth=0.8)
    memory.legend(fontsize=8)
    memory.set(xlabel="minutes", ylabel="MiB since the start", title=f"RSS: {slope['mib_per_hour']:+.0f} MiB/h "
               f"[{slope['low']:+.0f}, {slope['high']:+.0f}] (second half)")
    middle = [w["from_min"] + WINDOW_MINUTES / 2 for w in report["windows"]]
    for axis, name, title in ((ttft, "ttft", "time to first token"), (tpot, "tpot", "time per output token")):
        for q, style in (("p50", "-o"), ("p99", "--o")):
            axis.plot(middle, [w[f"{name}_{q}"] for w in report["windows"]], style, label=q)
        axis.set(xlabel="minutes", ylabel="s", title=title)
        axis.legend()
    for axis in (memory, ttft, tpot):
        axis.grid(alpha=0.3)
    figure.suptitle(f"soak: {report['minutes']:.0f} min, {report['clients']} clients, {report['requests']} requests, "
                    f"{report['server_errors']} 5xx, {report['restarts']} restarts")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def shown_slope(slope: dict[str, float], unit: str = " MiB/h") -> str:
    return f"{slope['mib_per_hour']:+.0f}{unit} [{slope['low']:+.0f}, {slope['high']:+.0f}]"


def markdown(report: dict) -> str:
    """soak.json as bench/README.md shows it."""
    slope, warm, samples = report["rss_slope"], report["warm_up"], report["rss"]
    statuses = ", ".join(f"{status}: {count:,}" for status, count in report["answers_by_status"].items())
    rows = [("before the clock", f"one prompt of {warm['prompt_tokens']:,} tokens per kernel path "
                                 f"({', '.join(warm['methods'])}), {warm['seconds'] / 60:.0f} min")] if warm else []
    rows += [("requests sent", f"{report['requests']:,} in {report['minutes']:.0f} min ({statuses}); "
                               f"{report['abandoned']} streams dropped midway on purpose"),
             ("longest prompt sent", f"{max(report['prompt_tokens']):,} tokens (served maximum {SERVED:,})"),
             ("answered 5xx", f"{report['server_errors']}"), ("engine restarts", f"{report['restarts']}"),
             ("tracebacks in the server's log", f"{report['tracebacks_in_log']}"),
             ("RSS, supervisor + server + engine",
              f"{report['rss_start_mib']:.0f} MiB at the start, {report['rss_peak_mib']:.0f} peak, "
              f"{report['rss_end_mib']:.0f} at the end"),
             ("RSS slope, second half", f"{slope['mib_per_hour']:+.0f} MiB/h, 95% interval [{slope['low']:+.0f}, "
                                        f"{slope['high']:+.0f}] ({slope['samples']} samples)")]
    if by_process := slopes_by_process(samples):
        rows.append(("RSS slope by process", ", ".join(f"{PROCESS_NAMES.get(name, name)} {shown_slope(each, '')}"
                                                       for name, each in by_process.items())))
    if anonymous := slopes_by_process(samples, "anon_by_process").get("VLLM::Worker"):
        rows.append(("the worker's anonymous memory", shown_slope(anonymous)))
    if report["allocated_slope"]:
        rows.append(("the worker's live heap (its allocator's count)", shown_slope(report["allocated_slope"])))
    return (f"Measured {report['date'][:10]} ({MODEL}, make run's defaults under its supervisor): {report['clients']} "
            "clients, prompts of 1,024 tokens to the served maximum (density ∝ 1/length²), every method, seeds, JSON "
            "schemas, forced tool calls, streams (a quarter dropped midway):\n\n"
            + harness.markdown_table(["measured", "value"], rows))


def follow(pid: int, threads: list[threading.Thread], records: list[dict], began: float, minutes: float,
           every: float, drain_s: float = 900) -> list[dict]:
    """Start the clients and sample the server's memory (``pid``) every ``every`` seconds until they end
    (the sending time, then up to ``drain_s`` for the answers in flight), under a progress bar."""
    from tqdm import tqdm

    samples = [memory_sample(pid, 0.0)]
    for thread in threads:
        thread.start()
    with tqdm(total=round(minutes), desc="soak", unit="min") as bar:
        while any(t.is_alive() for t in threads) and time.monotonic() < began + minutes * 60 + drain_s:
            time.sleep(every)
            samples.append(memory_sample(pid, time.monotonic() - began))
            bar.n = min(round(minutes), int((time.monotonic() - began) / 60))
            bar.set_postfix(answered=len(records), server_errors=sum(r["server_error"] for r in records),
                            rss_mib=samples[-1]["rss_mib"], clients=sum(t.is_alive() for t in threads))
    return samples


def run(minutes: float, clients: int, sample_seconds: float, out: Path, warm: bool) -> dict:
    from transformers import AutoTokenizer

    from rope_plugins.deploy.corpus import load_corpus
    from rope_plugins.models.catalog import DEFAULT_MODEL
    from rope_plugins.models.provision import provision
    from rope_plugins.testing.launcher import start_server
    from rope_plugins.worker.memory import INTERVAL_VARIABLE

    tokenizer = AutoTokenizer.from_pretrained(str(provision(DEFAULT_MODEL)))
    tokens = tokenizer(load_corpus("pydoc"), add_special_tokens=False)["input_ids"]
    log = out.with_name(out.stem + "_server.log")
    head = harness.header()  # the commit the server runs, before anything can change the checkout
    server = start_server(["--log-level", "warning"], log, supervised=True,
                          env={INTERVAL_VARIABLE: str(sample_seconds)})
    warmed = warm_up(server.base, server.process.pid, tokens, tokenizer, WARM_UP_METHODS) if warm else None
    print(f"warm-up: {warmed or 'none (--no-warm-up)'}", flush=True)
    records: list[dict] = []
    began, began_epoch = time.monotonic(), time.time()
    threads = [threading.Thread(target=client_loop, args=(server.base, seed, began + minutes * 60, began, tokens,
                                                          tokenizer, records), daemon=True) for seed in range(clients)]
    samples = follow(server.process.pid, threads, records, began, minutes, sample_seconds)
    unfinished = sum(thread.is_alive() for thread in threads)
    server.stop()
    text = log.read_text()
    allocator = worker_allocator(text, began_epoch)
    return {**head, "minutes": minutes, "clients": clients, "warm_up": warmed,
            "requests": len(records), "prompt_tokens": [r["prompt_tokens"] for r in records],
            "answers_by_status": dict(Counter(str(r["status"]) for r in records)),
            "server_errors": sum(r["server_error"] for r in records),
            "abandoned": sum(r.get("abandoned", False) for r in records),
            "unfinished_at_the_end": unfinished, "restarts": text.count("starting it again"),
            "tracebacks_in_log": text.count("Traceback"), "rss_start_mib": samples[0]["rss_mib"],
            "rss_peak_mib": max(s["rss_mib"] for s in samples), "rss_end_mib": samples[-1]["rss_mib"],
            "rss_slope": rss_slope(samples),
            "allocated_slope": rss_slope(allocator, "allocated", "allocator") if allocator else None,
            "worker_allocator": allocator, "windows": windows(records, minutes), "rss": samples, "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="before the clock: one prompt at the served maximum per kernel path (WARM_UP_METHODS)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = run(args.minutes, args.clients, args.sample_seconds, args.out, args.warm_up)
    harness.write_json(report, args.out)
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))
    return 0 if not report["server_errors"] and not report["restarts"] and not report["tracebacks_in_log"] else 1

