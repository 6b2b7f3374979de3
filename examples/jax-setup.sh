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
# Node agents (`gpuam node`) run tasks as another user (gpuam-task, or --run-as) whose HOME
# is the container's own directory, so the link above does not reach them: start each
# agent with `--task-env JAX_EXAMPLE_DIR=<this repository>` instead. This script checks
# that the task user can reach the venv and the training script (set TASK_USER=... for a
# user other than gpuam-task); it changes no permission itself.
#
# On a machine with NVIDIA GPUs: JAX_EXTRA=cuda12 bash examples/jax-setup.sh installs
# jax[cuda12] instead, and each worker then uses the GPUs of its CUDA_VISIBLE_DEVICES.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/target/jax-venv"
jax_version="0.10.2"
extra="${JAX_EXTRA:-cpu}"
python="${PYTHON:-python3}"

# Node agents run tasks as another user, and a venv runs its base interpreter (a link to
# it): that interpreter must be one every user can run, not one in a private directory
# such as a pyenv under /root.
others_can_run() {  # every directory on the way to the real file, and the file, let others in
  local p
  p="$(readlink -f "$1" 2>/dev/null)" && [ -n "$p" ] && [ -x "$p" ] || return 1
  while :; do
    case "$(stat -c %A "$p")" in *x|*t) ;; *) return 1 ;; esac
    [ "$p" = / ] && return 0
    p="$(dirname "$p")"
  done
}
base_of() { "$1" -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null; }
chosen_because=""
if [ -z "${PYTHON:-}" ] && ! others_can_run "$(base_of python3)"; then
  for candidate in /usr/bin/python3 /usr/local/bin/python3; do
    if others_can_run "$candidate" &&
      "$candidate" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      chosen_because="$candidate, since other users (node agents' task user) cannot run $(base_of python3)"
      python="$candidate"
      break
    fi
  done
fi
if [ -x "$venv/bin/python" ] && ! others_can_run "$venv/bin/python" && others_can_run "$(base_of "$python")"; then
  echo "== $venv runs $(readlink -f "$venv/bin/python"), which other users cannot run: making it again with $python"
  rm -rf "$venv"
fi

have_jax() {
  [ -x "$venv/bin/python" ] &&
    "$venv/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$jax_version')" 2>/dev/null
}

if have_jax && [ "$(cat "$venv/.gpuam-extra" 2>/dev/null)" = "$extra" ]; then
  echo "jax $jax_version ($extra) is ready in $venv"
else
  echo "== creating $venv with jax[$extra]==$jax_version (about 140 MB to download for cpu)"
  [ -z "$chosen_because" ] || echo "   on $chosen_because"
  mkdir -p "$repo/target"
  command -v "$python" >/dev/null 2>&1 ||
    { echo "error: $python not found: install Python 3.11 or newer (JAX 0.10 needs it), or set PYTHON=..." >&2; exit 1; }
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" ||
    { echo "error: $python -m venv failed: on Debian/Ubuntu install python3-venv" >&2; exit 1; }
  # Proxies, if the environment needs them, are for pip only; the job clears its own.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-cache-dir "jax[$extra]==$jax_version"
  echo "$extra" > "$venv/.gpuam-extra"
  have_jax || { echo "error: jax $jax_version did not install into $venv" >&2; exit 1; }
fi

link_dir="$HOME/.cache/gpuam"
mkdir -p "$link_dir"
ln -sfn "$repo" "$link_dir/jax-example"
echo "linked $link_dir/jax-example -> $repo"

task_user="${TASK_USER:-gpuam-task}"
if [ "$(id -u)" = 0 ] && id "$task_user" >/dev/null 2>&1; then
  if setpriv --reuid="$task_user" --regid="$task_user" --clear-groups \
      test -x "$venv/bin/python" -a -r "$repo/examples/jax_ddp.py" 2>/dev/null; then
    echo "for node agents: gpuam node ... --task-env JAX_EXAMPLE_DIR=$repo (user $task_user can read it)"
  else
    echo "warning: user $task_user (who runs node agents' tasks) cannot reach $venv/bin/python or" >&2
    echo "  $repo/examples/jax_ddp.py: the example runs under gpuam run, not on node agents, until every" >&2
    echo "  directory on the way lets others in (x) and the files are readable (r), or a copy is" >&2
    echo "  where $task_user can read it" >&2
  fi
fi
echo "now: gpuam run examples/jax-ddp.yaml"
