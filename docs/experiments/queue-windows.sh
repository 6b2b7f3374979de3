#!/bin/bash
# The queue simulation (docs/BENCHMARKS.md, "Queues") over ten trace windows: loads 1 and 2
# x 1000..3000 Philly jobs, queues research=3, prod=1. Run from the repository root.
# Usage: queue-windows.sh BIN TAG   (writes /tmp/qs-TAG-LOAD-JOBS/queues.json)
# Then: python3 docs/experiments/queue-compare.py BASE_TAG NEW_TAG
for l in 1 2; do for j in 1000 1500 2000 2500 3000; do
  timeout 600 "$1" sim --workload philly --queues research=3,prod=1 --jobs $j --load $l \
    --out /tmp/qs-$2-$l-$j >/dev/null 2>&1 || echo "fail $l $j"
done; done
