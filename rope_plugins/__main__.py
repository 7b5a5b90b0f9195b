"""Command line: ``python -m rope_plugins base-bound --length 8192 --head-dim 128``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .base_bound import BaseBound, base_bound, base_bound_row


def _describe(result: BaseBound) -> str:
    if result.evaluations == 1 and result.base < 1.5:
        return (f"L = {result.length:>8}: any base > 1 works (rotary fraction {result.rotary_fraction}: "
                "the unrotated pairs keep the sum non-negative)")
    return (f"L = {result.length:>8}: b* = {result.base:.4g}   asymptotic L/x0 = {result.asymptotic:.4g}"
            f"   ({result.evaluations} bases checked)")


def _base_bound_command(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    if args.length:
        results = [base_bound(args.length, args.head_dim, args.rotary_fraction, args.resolution)]
    else:
        results = base_bound_row(args.row, args.head_dim, args.rotary_fraction, args.resolution)
    if args.json:
        print(json.dumps([vars(result) for result in results], indent=2))
    else:
        print(f"smallest RoPE base with sum_i cos(m b^(-2i/d)) >= 0 for all m < L, d = {args.head_dim}")
        for result in results:
            print(_describe(result))
        print(f"({time.perf_counter() - began:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_plugins")
    commands = parser.add_subparsers(dest="command", required=True)
    bound = commands.add_parser("base-bound", help="the RoPE base lower bound of seed 002")
    what = bound.add_mutually_exclusive_group()
    what.add_argument("--length", type=int, help="training length L")
    what.add_argument("--row", type=int, nargs="+", default=[1024 * 2**i for i in range(11)],
                      help="several lengths (default: the seed's row, 1k .. 1M)")
    bound.add_argument("--head-dim", type=int, default=128)
    bound.add_argument("--rotary-fraction", type=float, default=1.0,
                       help="share of the head dims that are rotated (GPT-NeoX partial rotation)")
    bound.add_argument("--resolution", type=float, default=1e-6,
                       help="smallest relative step where no larger step is certified")
    bound.add_argument("--json", action="store_true", help="print the results as JSON")
    bound.set_defaults(handler=_base_bound_command)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
