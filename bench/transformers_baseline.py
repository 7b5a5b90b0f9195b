"""The straightforward ReRoPE people use today, against the plugin, end to end.

    .venv/bin/python bench/transformers_baseline.py                     # 16k prompt + 256 tokens
    .venv/bin/python bench/transformers_baseline.py --length 2048 --new-tokens 16

The baseline is transformers' Llama with a ReRoPE patch in the reference implementation's
style: keys are cached unrotated; prefill builds the two full score matrices (rotated, and
``R(w) q`` against raw keys) and selects between them (one query head at a time, so 16k fits
in memory); every decode step re-rotates the whole key cache by the clipped relative
positions. The plugin runs the same prompt through vLLM. Both greedy, float32; the script
checks the tokens are identical and writes bench/results/transformers_baseline.json.

The baseline shares no rotary code with the plugin: it computes the checkpoint's plain RoPE
frequencies itself and rotates with transformers' ``rotate_half``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from rope_plugins.testing.reference import UnrotatedRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as a script too

from bench import harness  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ATTENTION_NAME = "rerope_reference_style"
TARGET_SPEEDUP = 10  # the target for the plugin against this baseline


def rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """transformers' Llama rotation of ``x [..., d]`` by ``angle [..., d/2]``."""
    from transformers.models.llama.modeling_llama import rotate_half

    angle = torch.cat((angle, angle), dim=-1)
    return x * angle.cos().to(x.dtype) + rotate_half(x) * angle.sin().to(x.dtype)


class ReferenceStyleReRoPE:
    """Attention function for transformers' AttentionInterface; q/k arrive unrotated."""

    def __init__(self, theta: torch.Tensor, window: int):
        self.theta, self.window = theta, window

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _, heads, q_len, _ = query.shape
        k_len, group = key.shape[2], heads // key.shape[1]
        query_pos = torch.arange(k_len - q_len, k_len, dtype=torch.float64)
        key_pos = torch.arange(k_len, dtype=torch.float64)
        out = torch.empty_like(query)
        if q_len == 1:  # decode: re-rotate every cached key by its clipped relative position
            relative = (query_pos[:, None] - key_pos[None, :]).clamp(max=self.window)  # [1, K]
            rotated_keys = rotate(key[0], -relative[0][:, None] * self.theta)  # [kv, K, d]
            for h in range(heads):
                scores = (query[0, h] @ rotated_keys[h // group].T) * scaling
                out[0, h] = scores.softmax(-1) @ value[0, h // group]
            return out.transpose(1, 2), None
        distance = query_pos[:, None] - key_pos[None, :]
        near_q = rotate(query[0], query_pos[:, None] * self.theta)  # R(m) q
        far_q = rotate(query[0], self.window * self.theta.expand(q_len, -1))  # R(w) q
        near_k = rotate(key[0], key_pos[:, None] * self.theta)  # R(n) k
        for h in range(heads):  # two full score matrices per head
            near = near_q[h] @ near_k[h // group].T
            far = far_q[h] @ key[0, h // group].T
            scores = torch.where(distance < self.window, near, far) * scaling
            scores = scores.masked_fill(distance < 0, float("-inf"))
            out[0, h] = scores.softmax(-1) @ value[0, h // group]
        return out.transpose(1, 2), None


@torch.no_grad()
def baseline_generate(model_dir: str, ids: list[int], new_tokens: int, window: int) -> tuple[list[int], float]:
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    probe = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = probe.config
    base, pairs = float(config.rope_parameters["rope_theta"]), torch.arange(0, config.head_dim, 2, dtype=torch.float64)
    theta = base ** (-pairs / config.head_dim)  # the checkpoint's plain RoPE, in float64
    AttentionInterface.register(ATTENTION_NAME, ReferenceStyleReRoPE(theta, window))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation=ATTENTION_NAME)
    model.model.rotary_emb = UnrotatedRotaryEmbedding(config.head_dim)
    model.eval()
    began = time.perf_counter()
    cache = DynamicCache()
    logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    tokens = [int(logits.argmax())]
    for _ in range(new_tokens - 1):
        logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens, time.perf_counter() - began


def plugin_generate(model_dir: str, ids: list[int], new_tokens: int, window: int) -> tuple[list[int], float]:
    from vllm import LLM, SamplingParams

    from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs, extension_request
    from rope_plugins.rules.settings import engine_defaults

    max_len = 1 << (len(ids) + new_tokens).bit_length()
    compute_on_every_core()
    llm = LLM(**engine_kwargs(model_dir, defaults={"method": "rerope", "window": window},
                              max_model_len=max(max_len, 8192), dtype="float32", kv_cache_memory_bytes=3 << 30,
                              max_num_batched_tokens=max(max_len, 8192)))
    defaults = engine_defaults(llm.llm_engine.vllm_config.model_config.hf_config)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompt, params = extension_request({"prompt_token_ids": ids}, params, defaults)
    llm.generate([{"prompt_token_ids": [5] * 16, "cache_salt": "warm-up"}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    began = time.perf_counter()
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - began
    llm.llm_engine.engine_core.shutdown()
    return list(output.outputs[0].token_ids), elapsed


def markdown(report: dict) -> str:
    """transformers_baseline.json as bench/README.md shows it."""
    met = "met" if report["speedup"] >= TARGET_SPEEDUP else "not met"
    tokens = ("identical" if report["identical_tokens"]
              else f"the same up to token {report['first_difference']}")
    return (f"Measured {report['date'][:10]}: a {report['length']:,}-token prompt and {report['new_tokens']} new "
            f"tokens, window {report['window']:,}, float32, greedy: transformers {report['baseline_seconds']:.1f} s, "
            f"the plugin {report['plugin_seconds']:.1f} s, {report['speedup']:.1f}x faster "
            f"(target {TARGET_SPEEDUP}x: {met}); the {report['new_tokens']} greedy tokens are {tokens}.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS / "transformers_baseline.json")
    args = parser.parse_args(argv)

    from rope_plugins.server.provision import provision_default_model

    model_dir = str(provision_default_model())
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(args.length)]
    print(f"plugin: {args.length} prompt tokens + {args.new_tokens} new ...", flush=True)
    plugin_tokens, plugin_seconds = plugin_generate(model_dir, ids, args.new_tokens, args.window)
    print(f"plugin: {plugin_seconds:.1f} s; transformers reference style ...", flush=True)
    baseline_tokens, baseline_seconds = baseline_generate(model_dir, ids, args.new_tokens, args.window)
    same = next((i for i, (a, b) in enumerate(zip(plugin_tokens, baseline_tokens)) if a != b), None)
    report = {
        "date": harness.now(),
        "length": args.length, "new_tokens": args.new_tokens, "window": args.window,
        "plugin_seconds": plugin_seconds, "baseline_seconds": baseline_seconds,
        "speedup": baseline_seconds / plugin_seconds,
        "identical_tokens": same is None, "first_difference": same,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    harness.write_json(report, args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
