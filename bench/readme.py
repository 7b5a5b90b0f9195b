"""The generated blocks of the documents (DOCUMENTS): each is a results file as its benchmark's
``markdown(report)`` renders it (tables and the sentences that read them), between markers.

    .venv/bin/python -m bench readme            # rewrite every block from bench/results/
    .venv/bin/python -m bench readme --check    # name the blocks that differ from their results

A block starts with ``<!-- NAME.json: bench/readme.py -->`` and ends with
``<!-- end of NAME.json -->``; the prose around the blocks holds no measured number.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from bench import harness

ROOT, RESULTS = harness.ROOT, harness.RESULTS
DOCUMENT = ROOT / "bench" / "README.md"
# beside what they measure: the fp8 choice, the GPU's results, the fuzzer's, the fp8 cache's costs
DOCUMENTS = (DOCUMENT, ROOT / "README.md", *(ROOT / "docs" / name for name in ("gpu.md", "layout.md", "usage.md")))
# results file stem: (module, function) rendering it as markdown; written by renderer, each with its stems
RENDERERS = {stem: renderer for renderer, stems in {
    ("bench.speed", "markdown"): ("speed", "speed_bfloat16", "speed_bfloat16_amx_rounded", "speed_bfloat16_fp8"),
    ("bench.speed", "cached_markdown"): ("tpot_bfloat16_rounded", "tpot_bfloat16_fp8", "tpot_bfloat16_fp8_epyc"),
    ("bench.attention_kernels", "markdown"): ("attention_kernels",),
    ("bench.llama_cpp_speed", "markdown"): ("llama_cpp_speed",),
    ("bench.quality", "markdown"): ("eval", "eval_digits", "eval_new_methods"),
    ("bench.ruler", "markdown"): ("ruler",),
    ("rope_plugins.deploy.loadtest", "markdown"): ("loadtest",),
    ("bench.step_budget", "markdown"): ("step_budget", "reserved_cores"),
    ("bench.soak", "markdown"): ("soak",),
    ("tests.server.fuzz.schema", "markdown"): ("fuzz",),
    ("tests.server.fuzz.fields", "markdown"): ("fuzz_long",),
    ("bench.dtype_check", "markdown"): ("dtype",),
    ("bench.dtype_check", "stock_markdown"): ("dtype_stock",),
    ("bench.dtype_check", "fp8_markdown"): ("dtype_fp8",),
    ("bench.dtype_check", "choice_markdown"): ("fp8_choice",),
    ("tests.ops.gpu_check", "markdown"): ("gpu_check",),
    ("bench.gpu_kernel_speed", "prefill_markdown"): ("gpu_kernel_speed_tile_angles",),
    ("bench.gpu_kernel_speed", "markdown"): ("gpu_kernel_speed_decode_dot",),
}.items() for stem in stems}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}.json: bench/readme.py -->", f"<!-- end of {name}.json -->"


def block_names(text: str) -> list[str]:
    return [line[5:].split(".json: ", 1)[0] for line in text.splitlines()
            if line.startswith("<!-- ") and line.endswith(".json: bench/readme.py -->")]


def block(text: str, name: str) -> str:
    begin, end = markers(name)
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def replace_block(text: str, name: str, content: str) -> str:
    begin, end = markers(name)
    if begin not in text or end not in text:
        raise SystemExit(f"no {begin} ... {end} block to replace")
    before, rest = text.split(begin, 1)
    return f"{before}{begin}\n{content}\n{end}{rest.split(end, 1)[1]}"


def generated(name: str, results: Path = RESULTS) -> str:
    """The block ``name`` as its results file renders it now."""
    module, function = RENDERERS[name]
    render = getattr(importlib.import_module(module), function)
    return render(json.loads((results / f"{name}.json").read_text()))


def document_of(name: str) -> Path:
    """The document that shows the block ``name``."""
    return next((d for d in DOCUMENTS if markers(name)[0] in d.read_text()), DOCUMENT)


def shown(name: str) -> str:
    """The block ``name`` as its document shows it."""
    return block(document_of(name).read_text(), name)


def write_block(name: str, content: str, document: Path | None = None) -> None:
    document = document or document_of(name)
    document.write_text(replace_block(document.read_text(), name, content))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    stale = []
    for document in DOCUMENTS:
        text = document.read_text()
        rendered = {name: generated(name) for name in block_names(text)}
        names = [name for name, content in rendered.items() if block(text, name) != content]
        stale += names
        if not args.check:
            for name in names:
                text = replace_block(text, name, rendered[name])
            document.write_text(text)
    if args.check:
        print("\n".join(f"stale: {name}" for name in stale) or "every block is its results file's")
        return 1 if stale else 0
    print(f"rewrote {len(stale)} block(s): {', '.join(stale) or 'none stale'}")
    return 0

