#!/usr/bin/env bash
# scripts/gpu-build.sh: builds the gpuam binary carried to a GPU machine: the release build
# without debug info, stripped (cargo profile `gpu` in Cargo.toml), at target/gpu/gpuam
# (target/ is ignored by git). Fails when the binary is 40 MiB or more (the device machine
# takes at most 64 MiB of carried files). Then: scripts/gpu-check.sh, see docs/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --profile gpu --bin gpuam
bin=target/gpu/gpuam
size=$(stat -c %s "$bin")
echo "$bin: $((size / 1024 / 1024)) MiB ($size bytes)"
if [ "$size" -ge $((40 * 1024 * 1024)) ]; then
    echo "error: $bin is 40 MiB or more; the GPU machine takes at most 64 MiB of carried files" >&2
    exit 1
fi
