"""The fuzz runs against the real server, long: ``python -m tests.server.fuzz``.

    .venv/bin/python -m tests.server.fuzz                      # schemathesis, 500 examples per operation, seed 0
    .venv/bin/python -m tests.server.fuzz --examples 2000 --seed 7
    .venv/bin/python -m tests.server.fuzz --long-prompts 3000  # field combinations over long prompts, 12 at once

Each writes its report under bench/results/ (fuzz.json, fuzz_long.json), which bench/README.md
shows; the suite runs the schemathesis fuzz with a small budget (tests/server/test_server_robustness.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.server.fuzz import fields, schema

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=500, help="schemathesis examples per operation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-prompts", type=int, metavar="N",
                        help="send N generated requests with long prompts instead (tests/server/fuzz/fields.py)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.long_prompts:
        return fields.run_long_prompts(args.long_prompts, args.seed, args.out or RESULTS / "fuzz_long.json")
    return schema.run(args.examples, args.seed, args.out or RESULTS / "fuzz.json")


if __name__ == "__main__":
    sys.exit(main())
