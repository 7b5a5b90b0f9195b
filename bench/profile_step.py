"""Where a prefill (and a few decode steps) spends its time: torch.profiler over one request.

    .venv/bin/python bench/profile_step.py --length 8192 --config rerope
    .venv/bin/python bench/profile_step.py --length 8192 --config stock

    .venv/bin/python bench/profile_step.py --length 16384 --config rerope --cached --new-tokens 33
    .venv/bin/python bench/profile_step.py --length 2048 --config mixed --batch 8 --new-tokens 64

Runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the profiler sees the
model's operators; prints the top operators by self CPU time and writes the table to
bench/results/profile_<config>_<length>.txt (``--dtype bfloat16`` adds ``_bfloat16``; ``--cached``:
the prompt is in the prefix cache before the profiled request, and the profile covers its decode
steps alone (``--new-tokens`` - 1 of them), in profile_<config>_<length>_decode.txt;
``--batch 8``: that many requests at once, each with its own prompt, and ``--config mixed`` gives them
bench/speed.py's mix of settings, in profile_<config>_<length>_batch8.txt).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--config", default="rerope", help="stock, or a method name")
    parser.add_argument("--new-tokens", type=int, default=1)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--cached", action="store_true", help="profile decode: run the prompt once before")
    parser.add_argument("--batch", type=int, default=1, help="requests at once (speed.py's batch of 8)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (float32, bfloat16)")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    from vllm import LLM, SamplingParams

    from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs, extension_request
    from rope_plugins.rules.settings import engine_defaults, parse_settings
    from rope_plugins.server.provision import provision_default_model

    model = str(provision_default_model())
    max_len = 1 << (args.length + args.new_tokens + 64 - 1).bit_length()
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=(2 << 30) * max(1, max_len // 32768), max_model_len=max_len,
                  max_num_batched_tokens=max(max_len // 2, 8192), enable_prefix_caching=args.cached)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.length)]} for _ in range(args.batch)]
    compute_on_every_core()  # the same cores for stock and plugin
    if args.config == "stock":
        llm = LLM(model=model, hf_overrides={"max_position_embeddings": max_len}, **common)
        requests = prompts, [params] * len(prompts)
    else:
        llm = LLM(**engine_kwargs(model, defaults={"method": "rerope"}, **common))
        defaults = engine_defaults(llm.llm_engine.vllm_config.model_config.hf_config)
        settings = [{"method": args.config}] * len(prompts)
        if args.config == "mixed":
            from bench.speed import BATCH_MIX  # this script's folder is on the path

            settings = [BATCH_MIX[i % len(BATCH_MIX)] for i in range(len(prompts))]
        built = [extension_request(p, params, parse_settings(s, defaults)) for p, s in zip(prompts, settings)]
        requests = [b[0] for b in built], [b[1] for b in built]
    llm.generate(*requests, use_tqdm=False)  # warm (and, with --cached, fill the prefix cache)
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    if args.cached:
        decode_steps(llm, *requests, profile)
    else:
        profile.start()
        llm.generate(*requests, use_tqdm=False)
    profile.stop()
    table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    suffix = ("_decode" if args.cached else "") + (f"_batch{args.batch}" if args.batch > 1 else "")
    suffix += f"_{args.dtype}" if args.dtype != "float32" else ""
    (RESULTS / f"profile_{args.config}_{args.length}{suffix}.txt").write_text(table)


def decode_steps(llm, prompts: list, params: list, profile) -> None:
    """The requests step by step: the first step (the prompt's last block, past the prefix
    cache, and the first token) unprofiled, then ``profile`` over the decode steps alone."""
    engine = llm.llm_engine
    for index, (prompt, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(f"profiled-{index}", prompt, sampling)
    engine.step()
    profile.start()
    steps, began = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    print(f"{steps} decode steps profiled: {(time.perf_counter() - began) / steps * 1e3:.1f} ms each (profiler on)")


if __name__ == "__main__":
    main()
