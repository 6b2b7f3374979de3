#!/usr/bin/env python3
"""Writes the eleventh audit pass's OpenPAI placeholder bomb (docs/RELIABILITY.md §2e):
one parameter of SIZE bytes referenced COUNT times in one command.

    python3 docs/experiments/spec-bomb.py 262144 4096 > bomb.yaml     # 332 KB, ~1 GiB expanded
    python3 docs/experiments/spec-bomb.py 491520 32000 > bomb1m.yaml  # 1 MB, ~15.7 GB expanded
    /usr/bin/time -f "%e s %M KB" gpuam validate bomb.yaml
"""
import sys

size, count = int(sys.argv[1]), int(sys.argv[2])
refs = "<%$parameters.p%>" * count
sys.stdout.write(
    "protocolVersion: 2\nname: bomb\ntype: job\nprerequisites:\n"
    "  - {name: img, type: dockerimage, uri: example/x:latest}\n"
    "parameters:\n  p: \"" + "A" * size + "\"\n"
    "taskRoles:\n  worker:\n    instances: 1\n    dockerImage: img\n"
    "    resourcePerInstance: {cpu: 1, memoryMB: 256, gpu: 0}\n"
    "    commands:\n      - \"true " + refs + "\"\n"
)
