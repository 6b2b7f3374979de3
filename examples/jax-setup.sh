#!/usr/bin/env bash
# Prepares what examples/jax-ddp.yaml needs, idempotently:
#   1. a Python virtual environment at target/jax-venv (next to cargo's build output, so
#      `cargo clean` removes it) with JAX for CPU, pinned;
#   2. the link $HOME/.cache/gpuam/jax-example -> this repository, through which the job's
#      commands find the venv's python and examples/jax_ddp.py (a container runs in its
#      own working directory and gets only PATH, HOME and LANG from the caller's
#      environment, so the job cannot know where the repository is otherwise).
# Run it again after moving the repository, or to point the example at another clone.
#
# On a machine with NVIDIA GPUs: JAX_EXTRA=cuda12 bash examples/jax-setup.sh installs
# jax[cuda12] instead, and each worker then uses the GPUs of its CUDA_VISIBLE_DEVICES.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/target/jax-venv"
jax_version="0.10.2"
extra="${JAX_EXTRA:-cpu}"
python="${PYTHON:-python3}"

have_jax() {
  [ -x "$venv/bin/python" ] &&
    "$venv/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$jax_version')" 2>/dev/null
}

if have_jax && [ "$(cat "$venv/.gpuam-extra" 2>/dev/null)" = "$extra" ]; then
  echo "jax $jax_version ($extra) is ready in $venv"
else
  echo "== creating $venv with jax[$extra]==$jax_version (about 140 MB to download for cpu)"
  mkdir -p "$repo/target"
  command -v "$python" >/dev/null 2>&1 ||
    { echo "error: $python not found: install Python 3.10 or newer (or set PYTHON=...)" >&2; exit 1; }
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" ||
    { echo "error: $python -m venv failed: on Debian/Ubuntu install python3-venv" >&2; exit 1; }
  # Proxies, if the environment needs them, are for pip only; the job clears its own.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --cache-dir "$repo/target/pip-cache" "jax[$extra]==$jax_version"
  echo "$extra" > "$venv/.gpuam-extra"
  have_jax || { echo "error: jax $jax_version did not install into $venv" >&2; exit 1; }
fi

link_dir="$HOME/.cache/gpuam"
mkdir -p "$link_dir"
ln -sfn "$repo" "$link_dir/jax-example"
echo "linked $link_dir/jax-example -> $repo"
echo "now: gpuam run examples/jax-ddp.yaml"
