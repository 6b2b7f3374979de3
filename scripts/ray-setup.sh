#!/usr/bin/env bash
# Installs Ray into target/ray-venv (idempotent: a venv whose Ray is already the supported
# version is kept as it is). Used by .ci/run and by integration/ray.rs.
# Usage: scripts/ray-setup.sh [VENV_DIR]   (default: target/ray-venv under the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
# The Ray version gpuam's Ray backend is tested with (docs/RAY.md).
RAY_VERSION=2.60.0
venv=${1:-target/ray-venv}
if [ -x "$venv/bin/ray" ] && [ "$("$venv/bin/python" -c 'import ray; print(ray.__version__)' 2>/dev/null)" = "$RAY_VERSION" ]; then
  echo "ray $RAY_VERSION already in $venv"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir "ray[default]==$RAY_VERSION"
echo "ray $("$venv/bin/python" -c 'import ray; print(ray.__version__)') installed in $venv"
