"""The C++ decode kernel (``csrc/decode_attention.cpp``), built on first use with PyTorch's
extension builder and cached (``scripts/install.sh`` builds it once ahead of time).

If it cannot be built here (no compiler), attention falls back to the PyTorch path,
which computes the same thing and is the kernel's reference in the tests.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
# Reassociation lets the compiler vectorise the dot products; inf/nan semantics are kept.
# ROPE_EXTEND_MARCH: the target CPU (images built for other machines set e.g. x86-64-v3).
MARCH_ENV = "ROPE_EXTEND_MARCH"
MARCH = os.environ.get(MARCH_ENV, "native")
# -fopenmp: ATen's parallel_for is an inline OpenMP region, so without it the kernel's
# chunks run one after another on one core (tests/test_attention.py checks the build).
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]


@functools.cache
def decode_kernel():
    """The compiled module, or None when it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        return load(name=f"rope_plugins_decode_{MARCH.replace('-', '_')}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS, verbose=False)
    except Exception as error:  # a missing compiler must not take serving down
        logger.warning("rope_plugins: C++ decode kernel unavailable (%s); using the PyTorch path", error)
        return None


if __name__ == "__main__":
    print("decode kernel:", "ready" if decode_kernel() is not None else "unavailable")
