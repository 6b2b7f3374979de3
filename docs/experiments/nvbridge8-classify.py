#!/usr/bin/env python3
"""Classifies the DIFF lines of the lockstep experiment (docs/experiments/README.md) on
nvbridge8: each side's node as (intact NV pairs free, lone GPUs free) and its choice as
(pairs taken whole, pairs broken, lone GPUs taken). Differences between equivalent nodes
(same classes on both sides) are counted apart. Reads standard input."""
import collections
import re
import sys

PAIRS = [(0, 2), (1, 3), (4, 5), (6, 7)]  # nvbridge8's NVLink bridges
LINE = re.compile(r"DIFF k=(\d+) gpuam free=(\d+) take=(\d+) \| hived free=(\d+) take=(\d+)")


def shape(free, take):
    pairs_free = sum(1 for a, b in PAIRS if free >> a & 1 and free >> b & 1)
    lone_free = bin(free).count("1") - 2 * pairs_free
    whole = sum(1 for a, b in PAIRS if take >> a & 1 and take >> b & 1)
    broken = sum(1 for a, b in PAIRS if (take >> a & 1) != (take >> b & 1) and free >> a & 1 and free >> b & 1)
    lone = bin(take).count("1") - 2 * whole - broken
    return (pairs_free, lone_free, whole, broken, lone)


counts = collections.Counter()
equivalent = 0
for line in sys.stdin:
    m = LINE.search(line)
    if not m:
        continue
    k = int(m.group(1))
    g = shape(int(m.group(2), 2), int(m.group(3), 2))
    h = shape(int(m.group(4), 2), int(m.group(5), 2))
    if g == h:
        equivalent += 1
    else:
        counts[(k, g, h)] += 1
print(f"differences between equivalent nodes: {equivalent}")
print("count  k  gpuam (pairsFree, loneFree, pairsTaken, pairsBroken, loneTaken)  hived (same)")
for (k, g, h), n in counts.most_common():
    print(f"{n:5}  {k}  {g}  {h}")
by_k = collections.Counter()
for (k, _, _), n in counts.items():
    by_k[k] += n
print("not equivalent, by task size:", dict(sorted(by_k.items())))
