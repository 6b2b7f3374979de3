#!/usr/bin/env bash
# scripts/gpu-check.sh OUTDIR: checks gpuam on a real NVIDIA machine in one go (about 1-3
# minutes, never more than GPU_CHECK_BUDGET_SEC + 60 s) and writes the findings as one
# plain-text report, OUTDIR/gpu-check-report.txt, with the raw outputs under OUTDIR/raw/.
#
# Runs as root, from the repository root, on a machine with NVIDIA's driver. Needs only the
# gpuam binary ($GPUAM_BIN, default target/gpu/gpuam, built by scripts/gpu-build.sh) and the
# machine's own Python with PyTorch or JAX ($GPU_CHECK_PYTHON, default: the first of
# python3/python on PATH that imports torch or jax); no Rust, no network.
#
# Steps (each bounded with `timeout`; a failed step is recorded and the next one runs):
#   1. nvidia-smi's own view: -L, --query-gpu, topo -m.
#   2. a local `gpuam rm` (loopback, agents only, its work dir under a fresh /tmp dir) and
#      `gpuam node --gpus auto --topology auto`; what the node registered (the RM's node
#      listing) next to nvidia-smi's view.
#   3. can the task user run the machine's Python? (if not, the directories above the
#      interpreter get o+x, said in the report)
#   4. a job granted GPU 0 runs a short real training step on it (PyTorch, else JAX),
#      timed after warm-up, and the same step on the CPU.
#   5. a task granted no GPU clears CUDA_VISIBLE_DEVICES, opens /dev/nvidia*, asks the
#      framework for a GPU: what it saw (REACHED / OPENED / BLOCKED).
#   6. two tasks of gpu: 0.5 at the same time, with `nvidia-smi --query-compute-apps`
#      sampled while they hold the GPU.
#   7. each GPU's health through NVML (pynvml) if it imports, else `nvidia-smi -q`; Xid
#      lines of the kernel log.
#   8. everything started is stopped by pid (RM first, which stops its jobs, then the
#      node); no process of the task user or under the work dir may be left.
#
# Exit 0 only when all MUST-PASS checks passed: registration.count, registration.type,
# registration.topology (when nvidia-smi prints a matrix), train, shares.granted,
# shares.on_gpu, cleanup. Reported, not required: no_gpu.* (device isolation is another
# issue's work: the report says what the task saw), shares.compute_apps (inside a container
# nvidia-smi may not list the tasks' pids), health.*. Exit 1 otherwise; 64 on bad usage.
set -u -o pipefail

# ---- today's gpuam command lines, in one place (adapt here when the flags change) -------
GPUAM_BIN=${GPUAM_BIN:-target/gpu/gpuam}
RM_PORT=${GPU_CHECK_RM_PORT:-18088}
NODE_PORT=${GPU_CHECK_NODE_PORT:-18042}
NODE_HOST=${GPU_CHECK_HOST:-gpu-check}
# Tasks run as a uid of their submitter's own (node.task_uids), which no account names; the
# check of step 3 runs as `nobody`, an unprivileged uid like those.
TASK_USER=nobody
RM_URL="http://127.0.0.1:$RM_PORT"
# Credentials: the node's own token (`gpuam node-token new`, its digest in the RM's nodes
# file); jobs are submitted with the admin
# token the RM writes into its work dir.
make_credentials() { "$GPUAM_BIN" node-token new --host "$NODE_HOST" --nodes-file "$W/nodes.yaml" --out "$W/node.token" >/dev/null; }
rm_args() { echo rm --listen "127.0.0.1:$RM_PORT" --work-dir "$W/rm" --nodes-file "$W/nodes.yaml" --in-memory; }
admin_token_file() { echo "$W/rm/admin.token"; }
node_args() {
    echo node --rm "$RM_URL" --host "$NODE_HOST" --listen "127.0.0.1:$NODE_PORT" \
        --advertise "http://127.0.0.1:$NODE_PORT" --node-token-file "$W/node.token" \
        --gpus auto --topology auto --ports 21000-21099 --work-dir "$W/node"
}
submit_args() { echo submit "$1" --rm "$RM_URL" --token-file "$(admin_token_file)" --admin-token-file "$(admin_token_file)" --wait; }
# ------------------------------------------------------------------------------------------

if [ $# -ne 1 ]; then
    echo "usage: [GPUAM_BIN=target/gpu/gpuam] [GPU_CHECK_PYTHON=python3] bash scripts/gpu-check.sh OUTDIR" >&2
    exit 64
fi
OUTDIR=$1
HERE=$(cd "$(dirname "$0")" && pwd)
BUDGET=${GPU_CHECK_BUDGET_SEC:-270}
HOLD_SEC=${GPU_CHECK_HOLD_SEC:-8}
START=$(date +%s)
mkdir -p "$OUTDIR/raw" || exit 64
OUTDIR=$(cd "$OUTDIR" && pwd)
REPORT="$OUTDIR/gpu-check-report.txt"
case "$GPUAM_BIN" in /*) ;; *) GPUAM_BIN="$PWD/$GPUAM_BIN" ;; esac
W=$(mktemp -d /tmp/gpu-check.XXXXXX) || exit 70
chmod 755 "$W"
mkdir -p "$W/bin" "$W/shared"
chmod 1777 "$W/shared"
cp "$HERE"/gpu_check/*.py "$W/bin/" && chmod 644 "$W"/bin/*.py
# Task sizes: gpuam enforces memory (cgroup); CUDA and a framework need a few GiB of host
# memory. A quarter of this machine's memory (at most 16 GiB) for the training task, half
# that for the others; half its CPUs (at most 8) for the training task's CPU step.
MEM_MB=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
TASK_MB=$((MEM_MB / 4))
[ "$TASK_MB" -gt 16384 ] && TASK_MB=16384
[ "$TASK_MB" -lt 1024 ] && TASK_MB=1024
SMALL_MB=$((TASK_MB / 2))
TRAIN_CPU=$(($(nproc) / 2))
[ "$TRAIN_CPU" -gt 8 ] && TRAIN_CPU=8
[ "$TRAIN_CPU" -lt 1 ] && TRAIN_CPU=1
SECTIONS=() # section files, in report order
RM_PID="" NODE_PID="" SHARES_PID="" WATCHDOG_PID="" FINISHED=""

left() { echo $((START + BUDGET - $(date +%s))); }
# bounded T: T seconds, or what is left of the budget (at least 5 s).
bounded() {
    local t=$1 l
    l=$(left)
    [ "$l" -lt "$t" ] && t=$l
    [ "$t" -lt 5 ] && t=5
    echo "$t"
}
section() { # section N TITLE: starts section N; later output goes there with `say`
    CUR="$W/section-$1.txt"
    SECTIONS+=("$CUR")
    printf '\n== %s ==\n' "$2" >"$CUR"
}
say() { printf '%s\n' "$*" >>"$CUR"; }
verdict() { # verdict KIND NAME TEXT: a summary line (also in the current section)
    printf '%s %s: %s\n' "$1" "$2" "$3" >>"$W/summary.txt"
    say "$1 $2: $3"
}
# run TITLE TIMEOUT CMD...: runs CMD bounded, its output into the section; returns its code.
run() {
    local title=$1 t rc
    t=$(bounded "$2")
    shift 2
    say "\$ $title"
    timeout -k 5 "$t" "$@" >"$W/run.out" 2>&1
    rc=$?
    cat "$W/run.out" >>"$CUR"
    [ $rc -eq 124 ] && say "(timed out after ${t}s)"
    [ $rc -ne 0 ] && say "(exit code $rc)"
    return $rc
}
# verdicts CMD ARGS...: the Python verdict helper; its PASS/FAIL/SEEN lines go to the summary.
verdicts() {
    timeout -k 5 60 "$PYV" "$W/bin/verdicts.py" "$@" >"$W/verdicts.out" 2>&1
    local rc=$?
    grep -E '^(PASS|FAIL|SEEN) ' "$W/verdicts.out" >>"$W/summary.txt"
    cat "$W/verdicts.out" >>"$CUR"
    return $rc
}

write_report() {
    local result=$1
    {
        echo "gpuam GPU check report (scripts/gpu-check.sh)"
        echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "machine: $(hostname) · $(uname -sr) · $(nproc) CPUs"
        echo "gpuam:   $GPUAM_BIN ($("$GPUAM_BIN" --version 2>/dev/null | head -1))"
        echo "python:  ${PY:-none} ${PY_FACTS:-}"
        echo "elapsed: $(($(date +%s) - START)) s"
        echo
        echo "== summary =="
        cat "$W/summary.txt" 2>/dev/null
        echo
        echo "RESULT: $result (must pass: registration.count, registration.type, registration.topology, train, shares.granted, shares.on_gpu, cleanup)"
        for s in "${SECTIONS[@]}"; do cat "$s"; done
    } >"$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
}

result_of() {
    local name
    grep -qE '^FAIL (registration\.|train|shares\.granted|shares\.on_gpu|cleanup)' "$W/summary.txt" && {
        echo FAIL
        return
    }
    for name in registration.count registration.type train shares.granted shares.on_gpu cleanup; do
        grep -qE "^PASS $name:" "$W/summary.txt" || {
            echo FAIL
            return
        }
    done
    echo PASS
}

# stop PID WHAT SIGNAL GRACE: signal, wait up to GRACE s, then SIGKILL; says what happened.
stop() {
    local pid=$1 what=$2 sig=$3 grace=$4 i
    [ -n "$pid" ] || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kill "-$sig" "$pid" 2>/dev/null
    for ((i = 0; i < grace * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || {
            wait "$pid" 2>/dev/null
            say "stopped $what (pid $pid) with SIG$sig"
            return 0
        }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    say "killed $what (pid $pid): SIG$sig did not stop it within ${grace}s"
}

# Processes left behind, to report (never killed from this list: only pids this script
# recorded are signalled): those whose command line names the work dir or whose working
# directory is in it (the tasks run in their container directories under it).
leftovers() {
    local p cmd
    case "$W" in /tmp/gpu-check.??????) ;; *) return 0 ;; esac
    for p in /proc/[0-9]*; do
        [ "${p#/proc/}" = "$$" ] && continue
        cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline")
        case "$cmd $(readlink "$p/cwd" 2>/dev/null)/" in *"$W"/*) echo "${p#/proc/} $cmd" ;; esac
    done
}

finish() {
    [ -n "$FINISHED" ] && return
    FINISHED=1
    trap - EXIT INT TERM
    section 8 "8. cleanup: every process started is stopped by pid"
    stop "$SHARES_PID" "gpuam submit (shares)" INT 15
    stop "$RM_PID" "gpuam rm" TERM 20
    stop "$NODE_PID" "gpuam node" TERM 10
    stop "$WATCHDOG_PID" "watchdog" TERM 2
    stop "$(cat "$W/watchdog.sleep" 2>/dev/null)" "watchdog's sleep" TERM 2
    local left_over i
    for ((i = 0; i < 50; i++)); do
        left_over=$(leftovers)
        [ -z "$left_over" ] && break
        sleep 0.2
    done
    if [ -z "$left_over" ]; then
        verdict PASS cleanup "nothing left running (no process naming $W or working in it)"
    else
        verdict FAIL cleanup "processes left after stopping the RM and the node (not killed: stop them by pid)"
        say "$left_over"
    fi
    # Raw outputs: logs, job outputs, the tasks' results and their stdout/stderr.
    cp "$W"/*.log "$W"/*.yaml "$W"/submit-*.out "$W"/shares-samples.txt "$OUTDIR/raw/" 2>/dev/null
    cp "$W"/shared/*.json "$OUTDIR/raw/" 2>/dev/null
    for d in "$W"/node/containers/*/; do
        [ -d "$d" ] || continue
        for f in stdout stderr; do [ -f "$d$f" ] && cp "$d$f" "$OUTDIR/raw/$(basename "$d").$f"; done
    done
    say "raw outputs: $OUTDIR/raw/"
    local result
    result=$(result_of)
    write_report "$result"
    rm -rf "$W"
    echo "gpu-check: $result; report: $REPORT"
    [ "$result" = PASS ] && exit 0
    exit 1
}
trap finish EXIT
trap 'verdict FAIL run "interrupted (signal)"; finish' INT TERM
# A watchdog: the whole check never runs much past its budget.
# Stopped in `finish`: the subshell first (so it never signals), then its sleep.
(
    sleep $((BUDGET + 30)) &
    echo $! >"$W/watchdog.sleep"
    wait $! && kill -TERM $$
) >/dev/null 2>&1 &
WATCHDOG_PID=$!
: >"$W/summary.txt"

# ---- 1. nvidia-smi's view ----------------------------------------------------------------
section 1 "1. nvidia-smi's own view"
run "nvidia-smi -L" 20 nvidia-smi -L
run "nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id,uuid --format=csv" 20 \
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id,uuid --format=csv
cp "$W/run.out" "$W/query.csv"
run "nvidia-smi topo -m" 20 nvidia-smi topo -m
cp "$W/run.out" "$W/topo.txt"
run "nvidia-smi | head -4 (driver, CUDA version)" 20 bash -c 'nvidia-smi | head -4'

# ---- the machine's Python ------------------------------------------------------------------
pick_python() {
    local c p
    if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
        echo "$GPU_CHECK_PYTHON"
        return
    fi
    for c in python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python; do
        p=$(command -v "$c") || continue
        timeout 60 "$p" -c 'import torch' >/dev/null 2>&1 && { echo "$p"; return; }
        timeout 60 "$p" -c 'import jax' >/dev/null 2>&1 && { echo "$p"; return; }
    done
    command -v python3 || command -v python
}
PY=$(pick_python)
# The interpreter itself (not a pyenv shim or a wrapper): the task user runs this one.
[ -n "$PY" ] && PY=$(timeout 30 "$PY" -c 'import sys; print(sys.executable)' 2>/dev/null || echo "$PY")
PYV=${PY:-python3}
PY_FACTS=$(timeout 120 "$PYV" "$W/bin/verdicts.py" python 2>&1 | tail -1)

task_env_args() {
    echo --task-env "GPU_CHECK_PYTHON=$PY" --task-env "GPU_CHECK_DIR=$W/bin" \
        --task-env "GPU_CHECK_OUT=$W/shared" --task-env "GPU_CHECK_HOLD_SEC=$HOLD_SEC"
    [ -n "${LD_LIBRARY_PATH:-}" ] && echo --task-env "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}

# ---- 2. RM and node ----------------------------------------------------------------------
section 2 "2. what gpuam node --gpus auto --topology auto registered"
say "rm:   $GPUAM_BIN $(rm_args)"
say "node: $GPUAM_BIN $(node_args) $(task_env_args)"
up="" gpus=""
if [ ! -x "$GPUAM_BIN" ]; then
    verdict FAIL registration.count "no gpuam binary at $GPUAM_BIN (build it with scripts/gpu-build.sh)"
else
    make_credentials
    # shellcheck disable=SC2046 # the argument lists above are word lists without spaces
    "$GPUAM_BIN" $(rm_args) >"$W/rm.log" 2>&1 &
    RM_PID=$!
    until_t=$(($(date +%s) + 30))
    while [ ! -s "$(admin_token_file)" ] && [ "$(date +%s)" -lt "$until_t" ]; do sleep 0.1; done
    # shellcheck disable=SC2046
    "$GPUAM_BIN" $(node_args) $(task_env_args) >"$W/node.log" 2>&1 &
    NODE_PID=$!
    until_t=$(($(date +%s) + 60))
    while [ "$(date +%s)" -lt "$until_t" ]; do
        timeout 5 "$PYV" -c '
import json, sys, urllib.request
v = json.load(urllib.request.urlopen(sys.argv[1] + "/ws/v1/cluster/nodes", timeout=3))
n = [x for x in v["nodes"]["node"] if x["nodeHostName"] == sys.argv[2] and x["state"] == "RUNNING"]
sys.exit(0 if n else 1)' "$RM_URL" "$NODE_HOST" 2>/dev/null && { up=1; break; }
        kill -0 "$NODE_PID" 2>/dev/null || break
        kill -0 "$RM_PID" 2>/dev/null || break
        sleep 0.1
    done
    timeout 10 "$PYV" -c '
import json, sys, urllib.request
json.dump(json.load(urllib.request.urlopen(sys.argv[1] + "/ws/v1/cluster/nodes", timeout=5)), sys.stdout, indent=1)' \
        "$RM_URL" >"$W/nodes.json" 2>"$W/nodes.err"
    if [ -n "$up" ]; then
        verdicts registration "$NODE_HOST" "$W/nodes.json" "$W/query.csv" "$W/topo.txt"
        # Jobs asking for a GPU would wait for ever on a node without one.
        grep -q '^PASS registration.count' "$W/summary.txt" && gpus=1
    else
        verdict FAIL registration.count "the node did not register as RUNNING within 60 s"
        say "--- rm.log (tail)"
        tail -20 "$W/rm.log" >>"$CUR"
        say "--- node.log (tail)"
        tail -20 "$W/node.log" >>"$CUR"
    fi
fi
write_report RUNNING

# ---- 3. can the task user run the machine's Python? ------------------------------------
section 3 "3. the task user and the machine's Python"
say "python: $PY ($PY_FACTS)"
if [ -n "$up" ] && id "$TASK_USER" >/dev/null 2>&1; then
    # The words that run a command as the task user, from /.
    if command -v setpriv >/dev/null; then
        AS_TASK=(setpriv --reuid="$TASK_USER" --regid="$(id -g "$TASK_USER")" --clear-groups env -C /)
    else
        AS_TASK=(runuser -u "$TASK_USER" -- env -C /)
    fi
    probe='import sys; print(sys.executable, sys.version.split()[0])'
    if ! run "as $TASK_USER: $PY -c '$probe'" 30 "${AS_TASK[@]}" "$PY" -c "$probe"; then
        # Let the task user reach the interpreter: o+x (search only) on the directories
        # above the interpreter and its prefixes. Said in the report.
        for p in $("$PYV" -c 'import os, sys; print(" ".join({os.path.realpath(x) for x in (sys.executable, sys.prefix, sys.base_prefix)}))'); do
            d=$(dirname "$p")
            while [ "$d" != / ]; do
                if [ -d "$d" ] && [ "$(stat -c %A "$d" | cut -c10)" != x ] && [ "$(stat -c %A "$d" | cut -c10)" != t ]; then
                    chmod o+x "$d" && say "chmod o+x $d (the task user could not reach $PY)"
                fi
                d=$(dirname "$d")
            done
        done
        run "as $TASK_USER, again" 30 "${AS_TASK[@]}" "$PY" -c "$probe"
    fi
    if run "as $TASK_USER: the framework imports" 120 "${AS_TASK[@]}" "$PY" -c \
        'import importlib.util as u; m=[n for n in ("torch","jax") if u.find_spec(n)]; print("found:", m); import sys; sys.exit(0 if m else 1)'; then
        verdict SEEN python "$TASK_USER runs $PY ($PY_FACTS)"
    else
        verdict SEEN python "$TASK_USER cannot import torch or jax with $PY ($PY_FACTS): train and shares will fail"
    fi
else
    say "skipped: no node or no task user"
fi
write_report RUNNING

# run_job NAME YAML_TEXT TIMEOUT: submits and waits; on timeout SIGINT makes
# `gpuam submit --wait` kill the job. Returns submit's exit code.
run_job() {
    local name=$1 t rc
    t=$(bounded "$3")
    printf '%s\n' "$2" >"$W/$name.yaml"
    say "\$ gpuam $(submit_args "$W/$name.yaml")   (timeout ${t}s)"
    # shellcheck disable=SC2046
    timeout -s INT -k 15 "$t" "$GPUAM_BIN" $(submit_args "$W/$name.yaml") >"$W/submit-$name.out" 2>&1
    rc=$?
    tail -5 "$W/submit-$name.out" >>"$CUR"
    say "(gpuam submit exit code $rc)"
    return $rc
}
task_cmd() { echo "'\"\$GPU_CHECK_PYTHON\" \"\$GPU_CHECK_DIR/$1\"'"; }

# ---- 4. a training step on granted GPU 0 --------------------------------------------------
section 4 "4. a training step on the GPU gpuam granted (gpu: 1 → GPU 0)"
if [ -n "$gpus" ] && [ "$(left)" -gt 20 ]; then
    run_job train "name: gpu-check-train
taskRoles:
  train:
    instances: 1
    resourcePerInstance: {cpu: $TRAIN_CPU, memoryMB: $TASK_MB, gpu: 1}
    commands:
      - $(task_cmd train.py)" 150
    verdicts train "$W/shared/train.json"
else
    verdict FAIL train "not run (no node with the machine's GPUs, or out of time)"
fi
write_report RUNNING

# ---- 5. a task granted no GPU tries anyway ------------------------------------------------
section 5 "5. a task granted no GPU (gpu: 0) that tries to use one anyway"
if [ -n "$up" ] && [ "$(left)" -gt 20 ]; then
    run_job no_gpu "name: gpu-check-no-gpu
taskRoles:
  nogpu:
    instances: 1
    resourcePerInstance: {cpu: 1, memoryMB: $SMALL_MB, gpu: 0}
    commands:
      - $(task_cmd no_gpu.py)" 90
    verdicts no_gpu "$W/shared/no_gpu.json"
else
    verdict SEEN no_gpu.ran "not run (no node, or out of time)"
fi
write_report RUNNING

# ---- 6. two 0.5 shares of GPU 0 at once ---------------------------------------------------
section 6 "6. two tasks of gpu: 0.5 on GPU 0 at the same time"
if [ -n "$gpus" ] && [ "$(left)" -gt 30 ]; then
    printf '%s\n' "name: gpu-check-shares
taskRoles:
  share:
    instances: 2
    resourcePerInstance: {cpu: 1, memoryMB: $SMALL_MB, gpu: 0.5}
    commands:
      - $(task_cmd share.py)" >"$W/shares.yaml"
    t=$(bounded 120)
    say "\$ gpuam $(submit_args "$W/shares.yaml")   (timeout ${t}s), sampling nvidia-smi --query-compute-apps each second"
    # shellcheck disable=SC2046
    timeout -s INT -k 15 "$t" "$GPUAM_BIN" $(submit_args "$W/shares.yaml") >"$W/submit-shares.out" 2>&1 &
    SHARES_PID=$!
    n=0
    : >"$W/shares-samples.txt"
    while kill -0 "$SHARES_PID" 2>/dev/null; do
        n=$((n + 1))
        {
            echo "--- sample $n at +$(($(date +%s) - START)) s"
            timeout 10 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1
        } >>"$W/shares-samples.txt"
        sleep 1
    done
    wait "$SHARES_PID"
    say "(gpuam submit exit code $?)"
    SHARES_PID=""
    tail -5 "$W/submit-shares.out" >>"$CUR"
    verdicts shares "$W/shared" "$W/shares-samples.txt"
    say "--- the samples that list GPU processes (all $n in raw/shares-samples.txt):"
    awk '/^--- sample/ { h = $0; next } /^ *[0-9]+ *,/ { if (h != "") { print h; h = "" } print }' \
        "$W/shares-samples.txt" | head -40 >>"$CUR"
else
    verdict FAIL shares.granted "not run (no node with the machine's GPUs, or out of time)"
fi
write_report RUNNING

# ---- 7. GPU health --------------------------------------------------------------------------
section 7 "7. GPU health"
timeout -k 5 30 "$PYV" "$W/bin/health.py" >"$W/health.json" 2>"$W/health.err"
rc=$?
if [ $rc -eq 0 ]; then
    say "read through NVML (pynvml)"
    verdicts health "$W/health.json"
else
    say "pynvml not usable ($(tail -c 300 "$W/health.json" "$W/health.err" | tr '\n' ' ')); read through nvidia-smi -q instead"
    if run "nvidia-smi -q -d TEMPERATURE,ECC,ROW_REMAPPER,PAGE_RETIREMENT,POWER,PERFORMANCE" 30 \
        nvidia-smi -q -d TEMPERATURE,ECC,ROW_REMAPPER,PAGE_RETIREMENT,POWER,PERFORMANCE; then
        verdict SEEN health "read through nvidia-smi -q (pynvml does not import); see section 7"
    else
        verdict FAIL health "neither NVML nor nvidia-smi -q answered"
    fi
fi
xid=$(timeout 10 dmesg 2>/dev/null | grep -i 'NVRM: Xid' | tail -20)
if [ -n "$xid" ]; then
    verdict SEEN health.xid "$(echo "$xid" | wc -l) Xid lines in the kernel log (last 20 below)"
    say "$xid"
else
    verdict SEEN health.xid "no Xid line in the kernel log (or dmesg not readable)"
fi
write_report RUNNING

finish
