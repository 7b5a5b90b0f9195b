"""bench/gpu_kernel_speed.py's launch bookkeeping (the timing itself needs a GPU): which decode
launches it times, and how results written before a launch choice existed are read."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import gpu_kernel_speed
from rope_plugins.ops import gpu

RESULTS = Path(gpu_kernel_speed.__file__).parent / "results"


def test_the_decode_sweep_times_the_shipped_launch_first_and_the_old_decode_last():
    args = argparse.Namespace(decode_key_tiles=[32, 64], decode_warps=[4, 8])
    launches = gpu_kernel_speed.decode_launches(args)
    shipped = dict(key_tile=gpu.DECODE_KEY_TILE, num_warps=gpu.DECODE_WARPS, dot=gpu.DECODE_DOT,
                   tile_angles=gpu.DECODE_TILE_ANGLES)
    assert launches[0] == shipped
    assert launches[-1] == dict(key_tile=32, num_warps=4, dot=False, tile_angles=False)
    assert len({tuple(sorted(launch.items())) for launch in launches}) == len(launches) == 2 * 2 * 2 + 1


def test_results_from_before_the_launch_choices_read_as_the_broadcast_decode():
    report = json.loads((RESULTS / "gpu_kernel_speed_tile_angles.json").read_text())
    decode = gpu_kernel_speed.best_launches(report)["decode_best"]
    assert {(e["num_warps"], e["dot"], e["tile_angles"]) for e in decode.values()} == {(4, False, False)}
    assert "broadcast sums | per key |" in gpu_kernel_speed.markdown(report)
