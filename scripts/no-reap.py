#!/usr/bin/env python3
"""Runs a command the way CI runs it: under an init that never reaps orphans.

Usage: python3 scripts/no-reap.py CMD [ARGS...]   (e.g. cargo test --test ray)

CI's PID 1 does not wait for orphans, so a killed task's children stay zombies there, and
`kill -0` succeeds on them. This wrapper becomes a child subreaper (prctl
PR_SET_CHILD_SUBREAPER: orphans of the command are re-parented to it instead of to this
machine's init, which reaps them), waits only for the command itself, and reports how many
orphans it left as zombies. Exits with the command's status. Linux only."""
import ctypes
import os
import sys

PR_SET_CHILD_SUBREAPER = 36

if len(sys.argv) < 2:
    sys.exit(__doc__)
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit(f"no-reap: prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as e:
        print(f"no-reap: cannot run {sys.argv[1]}: {e}", file=sys.stderr)
        os._exit(127)
_, status = os.waitpid(pid, 0)
me = os.getpid()
zombies = 0
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    try:
        with open(f"/proc/{entry}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if fields[0] == "Z" and int(fields[1]) == me:
        zombies += 1
code = os.waitstatus_to_exitcode(status)
print(f"no-reap: exit {code}, {zombies} orphans left as zombies", file=sys.stderr)
sys.exit(code if code >= 0 else 128 - code)
