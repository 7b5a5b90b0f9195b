"""One entry for every benchmark: ``python -m bench <suite> [its flags]``.

    .venv/bin/python -m bench                    # the suites
    .venv/bin/python -m bench soak --minutes 5   # one of them; --help for its flags
"""

from __future__ import annotations

import importlib
import sys

# suite: (module, what it measures)
SUITES = {
    "speed": ("speed", "prefill and decode against stock vLLM (--cached: the decode alone)"),
    "kernels": ("attention_kernels", "the attention kernels against vLLM's"),
    "llama-cpp": ("llama_cpp_speed", "against llama.cpp on the same CPU"),
    "dtype": ("dtype_check", "which dtype answers correctly, each method's loss in both"),
    "quality": ("quality", "long-context loss and passkeys of every method"),
    "ruler": ("ruler", "RULER through lm-eval"),
    "load": ("step_budget", "the load test per step budget"),
    "soak": ("soak", "an hour of every field at every length under the supervisor"),
    "gpu-kernels": ("gpu_kernel_speed", "on a GPU: the kernels against FlashAttention"),
    "readme": ("readme", "bench/README.md's generated blocks from the results"),
}


def usage() -> str:
    width = max(map(len, SUITES))
    return "usage: python -m bench <suite> [flags]\n\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, (_, what) in SUITES.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"bench.{SUITES[argv[0]][0]}")
    sys.argv = [f"python -m bench {argv[0]}", *argv[1:]]
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
