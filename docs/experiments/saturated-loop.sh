#!/bin/bash
# The saturated loop of issue 27 (docs/BENCHMARKS.md, "Where queues form"): 16 nodes, 3000
# jobs x 40 seeds, four presets x loads 0.8, 0.9 x mixes A, B, two settings at a time.
# Usage: BIN=path/to/gpuam saturated-loop.sh OUTDIR POLICIES   (e.g. gpuam,hived,besteffort)
# EXTRA='--run-limits 1-3' adds flags to every run.
set -e
out=$1; pol=$2; mkdir -p $out
for t in pcie8 dgx1v nvbridge8x pcie4; do for l in 0.8 0.9; do for m in A B; do
  ${BIN:-target/release/gpuam} sim --workload synthetic --nodes 16 --jobs 3000 --seeds 40 --load $l --topology $t --mix $m --json --policies $pol $EXTRA > $out/$t-$l-$m.json 2>/dev/null &
  while [ $(jobs -r | wc -l) -ge 2 ]; do sleep 0.5; done
done; done; done
wait
