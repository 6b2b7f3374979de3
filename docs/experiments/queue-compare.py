#!/usr/bin/env python3
"""Paired comparison of two queue-simulation builds over the ten windows of
queue-windows.sh: per queue, the time-weighted mean |used - deserved| (GPUs), the
shortfall (GPU-hours below the deserved share by more than one GPU) and preemptions;
mean paired difference with its 95 % interval (Student's t, 9 degrees of freedom)."""
import json
import statistics as st
import sys


def measure(path):
    d = json.load(open(path + "/queues.json"))
    out = {}
    for q in d["queues"]:
        pts = q["points"]  # [time s, used GPUs, deserved GPUs]
        gap = short = total = 0.0
        for a, b in zip(pts, pts[1:]):
            dt = b[0] - a[0]
            total += dt
            gap += abs(a[1] - a[2]) * dt
            short += max(0.0, a[2] - a[1] - 0.999) * dt
        out[q["name"]] = (gap / total, short / 3600, q.get("preemptions"))
    return out


A, B = sys.argv[1], sys.argv[2]
rows = []
for load in (1, 2):
    for jobs in (1000, 1500, 2000, 2500, 3000):
        a, b = measure(f"/tmp/qs-{A}-{load}-{jobs}"), measure(f"/tmp/qs-{B}-{load}-{jobs}")
        rows.append((a, b))
        print(load, jobs, " ".join(
            f"{q}: gap {a[q][0]:.2f}->{b[q][0]:.2f} short {a[q][1]:.0f}->{b[q][1]:.0f} "
            f"preempt {a[q][2]}->{b[q][2]}" for q in ("prod", "research")))
for q in ("prod", "research"):
    for k, name in ((0, "|gap| GPUs"), (1, "shortfall GPU-h"), (2, "preemptions")):
        d = [b[q][k] - a[q][k] for a, b in rows]
        half = 2.262 * st.stdev(d) / len(d) ** 0.5
        base = st.mean(a[q][k] for a, _ in rows)
        print(f"{q} {name}: {st.mean(d):+.2f} +- {half:.2f} (base mean {base:.2f})")
