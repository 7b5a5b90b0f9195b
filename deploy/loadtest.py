"""Load test for long prompts against a running rope-extend server (loopback only).

    rope-extend-loadtest --requests 16 --concurrency 2 \\
        --prompt-lengths 1024,4096,8192,16384 --output-tokens 64 \\
        --mix rerope=2,ntk_mixed=1,auto=1

Sends real text (CPython's documentation, cut to exact token counts through the server's
/tokenize) as token-id prompts to /v1/completions, streamed, with each request's
``context_extension`` drawn from the mix; bounded by ``--requests`` and ``--duration`` (it stops
by itself: no new requests after the duration, and in-flight ones get ``--request-timeout``).
Reports as ``vllm bench serve`` does: completed / failed, TTFT, TPOT, ITL and end-to-end
latency (mean, median, p90, p99), output and total tokens per second, error rate; writes a
JSON file and a PNG summary.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RequestResult:
    prompt_tokens: int
    method: str
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ok and self.output_tokens > 1 and self.ttft is not None:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return None


def parse_mix(text: str) -> list[tuple[dict, float]]:
    """'rerope=2,ntk_mixed=1,auto=1' or JSON '[[{"method": "rerope", "window": 1024}, 2], ...]'."""
    if text.strip().startswith("["):
        return [(dict(settings), float(weight)) for settings, weight in json.loads(text)]
    mix = []
    for part in text.split(","):
        method, _, weight = part.partition("=")
        mix.append(({"method": method.strip()}, float(weight or 1)))
    return mix


def require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        sys.exit(f"loadtest: refusing {host!r}: this tool only loads a server on this machine (loopback)")


def nearest_rank(ordered: list[float], q: float) -> float:
    """The value at quantile ``q`` of sorted, non-empty ``ordered``, by nearest rank."""
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p90": nearest_rank(ordered, 0.9), "p99": nearest_rank(ordered, 0.99)}


async def one_request(client, model: str, prompt: list[int], settings: dict, output_tokens: int,
                      timeout: float) -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt), method=settings.get("method", "default"))
    began = time.perf_counter()
    last = None
    try:
        async with asyncio.timeout(timeout):
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=output_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "context_extension": settings})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if result.ttft is None:
                        result.ttft = now - began
                    elif last is not None:
                        result.itl.append(now - last)
                    last = now
                if chunk.usage is not None:
                    result.output_tokens = chunk.usage.completion_tokens
        result.e2e = time.perf_counter() - began
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except Exception as error:  # counted and reported, never raised: the run goes on
        result.error = f"{type(error).__name__}: {str(error)[:200]}"
    return result


async def run(args) -> dict:
    require_loopback(args.url)
    card, tokens = await server_and_corpus(args)
    rng = random.Random(args.seed)
    plan = draw_plan(args, tokens, rng)
    results, elapsed = await send(args, card["id"], plan, rng)
    return report_of(args, card, len(plan), results, elapsed)


async def server_and_corpus(args) -> tuple[dict, list[int]]:
    """The served model's card, and the corpus as its token ids (through /tokenize, in pieces,
    until there are twice the longest prompt's); exits if the prompts cannot fit or the corpus is short."""
    import httpx

    from rope_plugins.deploy.corpus import load_corpus

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as http:
        card = (await http.get("/v1/models")).raise_for_status().json()["data"][0]
        longest, served = max(args.prompt_lengths), card["max_model_len"]
        if longest + args.output_tokens > served:
            sys.exit(f"loadtest: prompts up to {longest} + {args.output_tokens} tokens exceed the server's "
                     f"maximum {served}")
        text = load_corpus(args.corpus)
        tokens: list[int] = []
        for start in range(0, len(text), 200_000):  # /tokenize in pieces
            if len(tokens) > 2 * longest:
                break
            piece = await http.post("/tokenize", json={"prompt": text[start:start + 200_000],
                                                       "add_special_tokens": False})
            tokens += piece.raise_for_status().json()["tokens"]
    if len(tokens) < longest + 1:
        sys.exit(f"loadtest: the corpus has {len(tokens)} tokens, fewer than the longest prompt ({longest})")
    return card, tokens


def draw_plan(args, tokens: list[int], rng: random.Random) -> list[tuple[list[int], dict]]:
    """``--requests`` (prompt, settings) pairs: a length drawn from ``--prompt-lengths``, a real
    passage of that many tokens, settings drawn from the mix by weight."""
    mix = parse_mix(args.mix)
    plan = []
    for _ in range(args.requests):
        length = rng.choice(args.prompt_lengths)
        start = rng.randrange(0, len(tokens) - length)  # a different real passage each time
        settings = rng.choices([s for s, _ in mix], weights=[w for _, w in mix])[0]
        plan.append((tokens[start:start + length], settings))
    return plan


async def send(args, model: str, plan: list[tuple[list[int], dict]],
               rng: random.Random) -> tuple[list[RequestResult], float]:
    """The plan's requests, at most ``--concurrency`` at a time, none started after ``--duration``;
    their results in the order they finished, and the seconds the whole took."""
    from openai import AsyncOpenAI
    from tqdm import tqdm

    client = AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "unused", max_retries=0,
                         timeout=args.request_timeout)
    results: list[RequestResult] = []
    began = time.perf_counter()
    deadline = began + args.duration
    bar = tqdm(total=len(plan), desc="load test", unit="req")
    semaphore = asyncio.Semaphore(args.concurrency)

    async def worker(prompt, settings):
        async with semaphore:
            if time.perf_counter() > deadline:
                return
            result = await one_request(client, model, prompt, settings, args.output_tokens, args.request_timeout)
            results.append(result)
            bar.update()
            bar.set_postfix(failed=sum(not r.ok for r in results))

    tasks = []
    for prompt, settings in plan:
        tasks.append(asyncio.create_task(worker(prompt, settings)))
        if args.rate:  # Poisson arrivals; otherwise all queue at once behind the concurrency limit
            await asyncio.sleep(rng.expovariate(args.rate))
        if time.perf_counter() > deadline:
            break
    await asyncio.gather(*tasks)
    bar.close()
    elapsed = time.perf_counter() - began
    await client.close()
    return results, elapsed


def report_of(args, card: dict, planned: int, results: list[RequestResult], elapsed: float) -> dict:
    """The JSON report: the run's settings, counts, throughput and latency percentiles, each request."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    total = output + sum(r.prompt_tokens for r in done)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": card["id"], "served_max": card["max_model_len"], "train_length": card["train_length"],
        "config": {"requests": args.requests, "concurrency": args.concurrency, "rate": args.rate,
                   "duration_limit_s": args.duration, "prompt_lengths": args.prompt_lengths,
                   "output_tokens": args.output_tokens, "mix": args.mix, "corpus": args.corpus, "seed": args.seed},
        "duration_s": elapsed,
        "completed": len(done), "failed": len(results) - len(done), "not_sent": planned - len(results),
        "error_rate": (len(results) - len(done)) / len(results) if results else 0.0,
        "output_tokens_per_s": output / elapsed, "total_tokens_per_s": total / elapsed,
        "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_s": percentiles([gap for r in done for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in done]),
        "errors": sorted({r.error for r in results if r.error}),
        "requests": [{**asdict(r), "tpot": r.tpot, "itl": None} for r in results],
    }


def draw_tpot(axis, requests: list[dict]) -> None:
    """Time per output token against prompt length, one colour per method (the done requests)."""
    done = [r for r in requests if r["ok"]]
    for method in sorted({r["method"] for r in done}):
        mine = [r for r in done if r["method"] == method]
        axis.scatter([r["prompt_tokens"] for r in mine], [r["tpot"] * 1000 if r["tpot"] else None for r in mine],
                     label=method)
    axis.set(xlabel="prompt tokens", ylabel="ms per output token", title="time per output token")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report["requests"] if r["ok"]]
    figure, (ttft, e2e) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in sorted({r["method"] for r in done}):
        mine = [r for r in done if r["method"] == method]
        ttft.scatter([r["prompt_tokens"] for r in mine], [r["ttft"] for r in mine], label=method)
    ttft.set(xlabel="prompt tokens", ylabel="seconds", title="time to first token")
    draw_tpot(e2e, report["requests"])
    for axis in (ttft, e2e):
        axis.axvline(report["train_length"], color="grey", linestyle=":", label="training length")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    c = report["config"]
    figure.suptitle(f"{report['model']}, {report['machine']}: {report['completed']} done, {report['failed']} failed, "
                    f"concurrency {c['concurrency']}, {report['output_tokens_per_s']:.1f} output tok/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def summary(report: dict) -> str:
    lines = [f"completed {report['completed']}, failed {report['failed']}, not sent {report['not_sent']} "
             f"(error rate {report['error_rate']:.1%}) in {report['duration_s']:.0f} s",
             f"output {report['output_tokens_per_s']:.2f} tok/s, "
             f"total (prompt + output) {report['total_tokens_per_s']:.1f} tok/s",
             f"{'':6} {'mean':>9} {'median':>9} {'p90':>9} {'p99':>9}"]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        row = report[name]
        cells = " ".join(f"{row[k]:>9.3f}" if row[k] is not None else f"{'-':>9}"
                         for k in ("mean", "median", "p90", "p99"))
        lines.append(f"{name[:-2].upper():6} {cells}  (s)")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """The summary as bench/README.md shows a run (bench/readme.py): what was run where, then :func:`summary`."""
    c = report["config"]
    lengths = ", ".join(f"{n:,}" for n in c["prompt_lengths"])
    return (f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}, {report['served_max']:,} "
            f"tokens served): prompts of {lengths} tokens, {c['output_tokens']} output tokens each, "
            f"{c['concurrency']} at a time, mix `{c['mix']}`.\n\n```\n{summary(report)}\n```")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("ROPE_EXTEND_API_KEY"))
    parser.add_argument("--requests", type=int, default=16, help="at most this many requests")
    parser.add_argument("--duration", type=float, default=1800, help="no new requests after this many seconds")
    parser.add_argument("--request-timeout", type=float, default=1800)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.0, help="requests per second (Poisson); 0 = all at once")
    parser.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 4096, 8192, 16384], help="comma-separated token counts, drawn uniformly")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--mix", default="auto=1,rerope=1,leaky_rerope=1,ntk_mixed=1",
                        help="extension settings and weights: 'rerope=2,ntk_mixed=1' or a JSON list")
    parser.add_argument("--corpus", default="pydoc", help="pydoc, stdlib, or a text file / directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("loadtest.json"),
                        help="the JSON report (the PNG goes beside it); default: in the current directory")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(summary(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
