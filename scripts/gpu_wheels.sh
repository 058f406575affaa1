#!/usr/bin/env bash
# Fetch the NIXL wheels the device check carries (scripts/gpu_check.sh) and repack the big one.
#
#   scripts/gpu_wheels.sh [FOLDER]        (default gpu_wheels/, git-ignored: wheels are never committed)
#
# The device machine has Python 3.12, PyTorch 2.11 (CUDA 13) and numpy, but no NIXL and no network,
# and at most 64 MiB travel per call (the working tree included). It needs:
#   nixl-1.5.1-py3-none-any.whl      the `nixl` meta package (11 KB): `import nixl` picks nixl_cu13 from
#                                    torch's CUDA major;
#   nixl_cu13-1.5.1-cp312-...whl     the CUDA 13 build (bindings, UCX 1.23 with cuda_ipc/cuda_copy, plugins).
#                                    56 MiB as published, 27 MiB of it the `nixl_ep_cu13` expert-parallel
#                                    extensions (one per torch 2.12/2.13/2.14: none fits the device's 2.11, and
#                                    raypd never imports them). Repacked without `nixl_ep_cu13/` (RECORD updated).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_wheels}
PY=${PYTHON:-python3}  # any Python with pip: the download names the device's tags explicitly
VERSION=1.5.1
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 "nixl-cu13==$VERSION" "nixl==$VERSION" -d "$tmp"
cp "$tmp/nixl-$VERSION-py3-none-any.whl" "$OUT/"
"$PY" - "$tmp/nixl_cu13-$VERSION-cp312-cp312-manylinux_2_28_x86_64.whl" "$OUT" <<'PY'
import sys, zipfile
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
drop = ("nixl_ep_cu13/",)
dst = out / src.name
kept = dropped = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            dropped += info.file_size
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not l.startswith(drop)).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        kept += 1
with zipfile.ZipFile(dst) as z:
    assert not [n for n in z.namelist() if n.startswith(drop)]
    assert "nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so" in z.namelist()
    assert any(n.endswith("ucx/libuct_cuda.so.0.0.0") for n in z.namelist())
print(f"{dst}: {kept} files, {dst.stat().st_size / 2**20:.1f} MiB (was {src.stat().st_size / 2**20:.1f} MiB; "
      f"dropped {dropped / 2**20:.1f} MiB uncompressed of {', '.join(drop)})")
PY
ls -l "$OUT"
