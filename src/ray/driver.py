"""gpuam's long-lived Ray driver (issue 28): run by `gpuam rm --backend ray --ray-launch driver`
(src/ray/driver.rs), one process per RM, connected to the Ray cluster with `ray.init(address=...)`.

Owns, on the Ray side, the containers the RM granted:
- per container a detached placement group `gpuam-<containerId>` of one bundle holding exactly
  the grant's resources on the granted node (`gpuam-node-<host>`: 0.001, `gpuam-gpu-<i>`: 1 or
  its share, custom resources by name), STRICT_PACK; the container starts only once Ray has
  reserved the bundle, and the group is removed once the container is dead;
- per Ray node one detached named actor `gpuam-node-<host>` (namespace `gpuam`, 0.001 of the
  node's resource, so it runs on that node only) that starts each container's bash script in
  a session of its own, with stdout and stderr in files of their own, stops it (TERM to the
  group, the grace, KILL), kills what its leader left behind, and keeps each exit until the
  driver has reported it. A restarted driver finds the actors and groups by name again.

Wire (one JSON object a line): the RM writes requests on stdin (`{"op": ..., "re": N, ...}`),
the driver answers on stdout (`{"ev": "reply", "re": N, ...}`) and reports
`{"ev": "exited", "id": ..., "how": "exit"|"stopped"|"refused"|"lost", "code": ..., "diag": ...}`
once per container, only when it is dead. stdin closed: the driver exits (containers keep
running; the next driver adopts them).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

NS = "gpuam"
BASE_ENV = ("PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME")
_out = threading.Lock()


def start_time(pid):
    """The start time of process `pid` (field 22 of /proc/PID/stat), "" when gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def emit(obj):
    line = json.dumps(obj)
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def say(msg):
    sys.stderr.write("gpuam-ray-driver: %s\n" % msg)
    sys.stderr.flush()


@ray.remote
class NodeProxy:
    """gpuam's hand on one Ray node: starts, stops and watches its containers."""

    def __init__(self, host):
        self.host = host
        tmp = os.environ.get("TMPDIR") or "/tmp"
        # The containers' own directories (the node script makes them), and this host's
        # records: `run/<id>` (the process group and its leader's start time) and
        # `logs/<id>/{stdout,stderr}`, per host (several Ray nodes may share a /tmp).
        self.work = os.path.join(tmp, "gpuam-ray")
        self.home = os.path.join(tmp, "gpuam-ray-node", host)
        self.run = os.path.join(self.home, "run")
        os.makedirs(self.run, exist_ok=True)
        self.procs = {}
        # id -> (how, code, diag, when, sequence number), until its driver acknowledges it.
        self.ended = {}
        self.seq = 0
        self.refused = set()
        self.stopping = set()
        self.cv = threading.Condition()
        # Containers a dead predecessor left running: nobody watches them, so they are
        # killed (their ends are then reported as lost). Only a group whose leader is the
        # recorded process (same pid and start time) is killed, never a reused pid.
        for name in os.listdir(self.run):
            path = os.path.join(self.run, name)
            try:
                with open(path) as f:
                    pgid, started = f.read().split()
                pgid = int(pgid)
                if pgid > 1 and start_time(pgid) == started:
                    os.killpg(pgid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
            try:
                os.unlink(path)
            except OSError:
                pass

    def start(self, cid, script, env):
        with self.cv:
            if cid in self.refused:
                return "refused"
            if cid in self.procs or cid in self.ended:
                return "again"
            logs = os.path.join(self.home, "logs", cid)
            os.makedirs(logs, exist_ok=True)
            full = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
            full.update(env)
            try:
                with open(os.path.join(logs, "stdout"), "ab") as out, open(os.path.join(logs, "stderr"), "ab") as err:
                    p = subprocess.Popen(["bash", "-c", script], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=full, cwd="/", start_new_session=True, close_fds=True)
            except OSError as e:
                self.seq += 1
                self.ended[cid] = ("exit", 127, "cannot start bash: %s" % e, time.time(), self.seq)
                self.cv.notify_all()
                return "failed"
            with open(os.path.join(self.run, cid), "w") as f:
                f.write("%d %s" % (p.pid, start_time(p.pid)))
            self.procs[cid] = p
        threading.Thread(target=self._wait, args=(cid, p), daemon=True).start()
        return "started"

    def _wait(self, cid, p):
        rc = p.wait()
        # What the leader left behind in its group dies with it.
        for _ in range(50):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except OSError:
                break
            time.sleep(0.1)
        if rc < 0:
            code, diag = 128 - rc, "killed by signal %d" % -rc
        else:
            code, diag = rc, ("" if rc == 0 else "exited with %d" % rc)
        # The task's own directory goes with it, as on gpuam's own nodes (its logs stay).
        shutil.rmtree(os.path.join(self.work, cid), ignore_errors=True)
        with self.cv:
            how = "stopped" if cid in self.stopping else "exit"
            if how == "stopped":
                diag = "stopped by request" + ("" if not diag else " (%s)" % diag)
            self.procs.pop(cid, None)
            self.seq += 1
            self.ended[cid] = (how, code, diag, time.time(), self.seq)
            try:
                os.unlink(os.path.join(self.run, cid))
            except OSError:
                pass
            self.cv.notify_all()

    def stop(self, cid, grace):
        with self.cv:
            p = self.procs.get(cid)
            if p is None:
                if cid not in self.ended:
                    self.refused.add(cid)
                    return "refused"
                return "ended"
            self.stopping.add(cid)
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass
        until = time.time() + grace
        with self.cv:
            while cid in self.procs and time.time() < until:
                self.cv.wait(0.1)
            if cid not in self.procs:
                return "ended"
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        until = time.time() + 10
        with self.cv:
            while cid in self.procs and time.time() < until:
                self.cv.wait(0.1)
        return "ended" if cid not in self.procs else "alive"

    def wait_ended(self, ack, after, timeout):
        """Forgets the ends in `ack` (reported by their driver); returns the ends recorded
        after sequence number `after` (waiting up to `timeout` for one) and the last number."""
        with self.cv:
            for a in ack:
                self.ended.pop(a, None)
            # Ends no driver claimed for an hour (their RM is gone) are dropped.
            old = time.time() - 3600
            for cid in [c for c, v in self.ended.items() if v[3] < old]:
                del self.ended[cid]
            if self.seq <= after:
                self.cv.wait(timeout)
            return {k: list(v[:3]) for k, v in self.ended.items() if v[4] > after}, self.seq

    def ack(self, ids):
        with self.cv:
            for a in ids:
                self.ended.pop(a, None)

    def known(self):
        with self.cv:
            return sorted(self.procs), {k: list(v[:3]) for k, v in self.ended.items()}

    def claim(self, ids):
        """After a driver restart: which of `ids` run or ended here; any other is refused
        for good (a start still on its way from the dead driver never runs)."""
        with self.cv:
            out = {}
            for cid in ids:
                if cid in self.procs:
                    out[cid] = "running"
                elif cid in self.ended:
                    out[cid] = ["ended"] + list(self.ended[cid][:3])
                else:
                    self.refused.add(cid)
                    out[cid] = "unknown"
            return out

    def read_log(self, cid, stream, tail):
        path = os.path.join(self.home, "logs", cid, "stderr" if stream == "stderr" else "stdout")
        try:
            with open(path, "rb") as f:
                if tail is not None:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - int(tail)))
                data = f.read(64 << 20)
        except FileNotFoundError:
            return None
        return data.decode("utf-8", "replace")


class Driver:
    def __init__(self):
        self.lock = threading.Lock()
        # cid -> {"host", "pg", "state": waiting|starting|running|done, "stop": bool}
        self.c = {}
        self.proxies = {}
        self.waits = {}  # ObjectRef -> (kind, payload)
        self.wake = threading.Event()

    def proxy(self, host):
        with self.lock:
            p = self.proxies.get(host)
            if p is not None:
                return p
            p = NodeProxy.options(name="gpuam-node-%s" % host, namespace=NS, lifetime="detached",
                                  get_if_exists=True, num_cpus=0, max_concurrency=1000, max_restarts=0,
                                  resources={"gpuam-node-%s" % host: 0.001}).remote(host)
            self.proxies[host] = p
        threading.Thread(target=self.watch, args=(host, p), daemon=True).start()
        return p

    def add_wait(self, ref, kind, payload):
        with self.lock:
            self.waits[ref] = (kind, payload)
        self.wake.set()

    def report(self, cid, how, code, diag):
        with self.lock:
            e = self.c.get(cid)
            if e is None or e["state"] == "done":
                return False
            pg = e.get("pg")
            del self.c[cid]
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as ex:  # already gone
                say("remove group of %s: %s" % (cid, ex))
        emit({"ev": "exited", "id": cid, "how": how, "code": code, "diag": diag})
        return True

    # --- requests -------------------------------------------------------------------------
    def start(self, r):
        cid, host = r["id"], r["host"]
        with self.lock:
            if cid in self.c:
                return {"ok": True, "again": True}
        pg = placement_group([r["bundle"]], strategy="STRICT_PACK", name="gpuam-" + cid, lifetime="detached")
        with self.lock:
            self.c[cid] = {"host": host, "pg": pg, "state": "waiting", "stop": False,
                           "script": r["script"], "env": r["env"]}
        self.proxy(host)
        self.add_wait(pg.ready(), "ready", cid)
        return {"ok": True}

    def stop(self, r):
        cid = r["id"]
        with self.lock:
            e = self.c.get(cid)
            if e is None:
                return {"ok": True, "state": "unknown"}
            e["stop"] = True
            state = e["state"]
            host = e["host"]
        if state == "waiting":
            self.report(cid, "refused", None, "stopped before it started")
            return {"ok": True, "state": "ended"}
        ref = self.proxy(host).stop.remote(cid, float(r.get("grace", 3)))
        self.add_wait(ref, "stop", (cid, r["re"]))
        return None  # answered when the proxy has stopped it

    def log(self, r):
        ref = self.proxy(r["host"]).read_log.remote(r["id"], r["stream"], r.get("tail"))
        self.add_wait(ref, "log", r["re"])
        return None

    def prepare(self, r):
        """Creates the actors of the hosts gpuam knows now, so the first containers do not
        wait for them."""
        for host in r["hosts"]:
            self.proxy(host)
        return {"ok": True}

    def adopt(self, r):
        """Containers the RM knows as live (after a driver or RM restart): watched again, or
        reported lost when their node's actor does not know them."""
        by_host = {}
        for item in r["containers"]:
            by_host.setdefault(item["host"], []).append(item["id"])
        for host, ids in by_host.items():
            for cid in ids:
                try:
                    pg = get_placement_group("gpuam-" + cid)
                except Exception:
                    pg = None
                with self.lock:
                    self.c.setdefault(cid, {"host": host, "pg": pg, "state": "running", "stop": False})
            try:
                found = ray.get(self.proxy(host).claim.remote(ids), timeout=30)
            except Exception as ex:
                for cid in ids:
                    self.report(cid, "lost", None, "the gpuam actor of %s cannot be reached: %s" % (host, short(ex)))
                continue
            reported = []
            for cid in ids:
                f = found.get(cid)
                if f == "unknown":
                    self.report(cid, "lost", None, "not found on %s after the driver restarted" % host)
                elif isinstance(f, list) and self.report(cid, f[1], f[2], f[3]):
                    reported.append(cid)
            if reported:
                self.proxy(host).ack.remote(reported)
        return {"ok": True}

    # --- background -----------------------------------------------------------------------
    def watch(self, host, proxy):
        """Reports the ends of `host`'s containers as its actor tells them."""
        ack, after = [], 0
        while True:
            try:
                ended, after = ray.get(proxy.wait_ended.remote(ack, after, 1.0), timeout=60)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception as ex:
                self.proxy_died(host, proxy, ex)
                return
            # Only what this driver reported is acknowledged: another driver (another RM on
            # the same cluster) shares the node's actor and must see its own containers' ends.
            ack = [cid for cid, (how, code, diag) in ended.items() if self.report(cid, how, code, diag)]

    def proxy_died(self, host, proxy, ex):
        with self.lock:
            if self.proxies.get(host) is proxy:
                del self.proxies[host]
            ids = [cid for cid, e in self.c.items() if e["host"] == host and e["state"] != "waiting"]
        why = "the Ray node of %s was lost (its gpuam actor died: %s)" % (host, short(ex))
        if ids:
            # A new actor kills what the dead one left running (its __init__); if the node
            # itself is gone, nothing of it runs anyway.
            try:
                ray.get(self.proxy(host).known.remote(), timeout=20)
            except Exception:
                pass
        for cid in ids:
            self.report(cid, "lost", None, why)

    def loop(self):
        """Waits on placement groups, starts, stops and log reads; acts as each completes."""
        while True:
            with self.lock:
                refs = list(self.waits)
            if not refs:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            if not ready:
                continue
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                with self.lock:
                    kind, payload = self.waits.pop(ref)
                try:
                    value, err = ray.get(ref), None
                except Exception as ex:
                    value, err = None, ex
                try:
                    self.completed(kind, payload, value, err)
                except Exception:
                    say(traceback.format_exc())

    def completed(self, kind, payload, value, err):
        if kind == "ready":
            cid = payload
            with self.lock:
                e = self.c.get(cid)
                if e is None or e["state"] != "waiting":
                    return
                stop = e["stop"]
                if not stop and err is None:
                    e["state"] = "starting"
                    script, env, host = e.pop("script"), e.pop("env"), e["host"]
            if stop:
                self.report(cid, "refused", None, "stopped before it started")
            elif err is not None:
                self.report(cid, "lost", None, "its placement group failed: %s" % short(err))
            else:
                self.add_wait(self.proxy(host).start.remote(cid, script, env), "start", cid)
        elif kind == "start":
            cid = payload
            if err is not None:
                self.report(cid, "lost", None, "the gpuam actor could not start it: %s" % short(err))
            elif value == "refused":
                self.report(cid, "refused", None, "stopped before it started")
            else:
                with self.lock:
                    e = self.c.get(cid)
                    if e is not None and e["state"] == "starting":
                        e["state"] = "running"
        elif kind == "stop":
            cid, re = payload
            emit({"ev": "reply", "re": re, "ok": err is None, "state": value,
                  "error": None if err is None else short(err)})
            if value == "refused":
                self.report(cid, "refused", None, "stopped before it started")
        elif kind == "log":
            emit({"ev": "reply", "re": payload, "ok": err is None, "text": value,
                  "error": None if err is None else short(err)})


def short(ex):
    s = str(ex).strip().splitlines()
    return (s[-1] if s else type(ex).__name__)[:300]


def main():
    address = sys.argv[1]
    ray.init(address=address, namespace=NS, logging_level="ERROR", log_to_driver=False)
    d = Driver()
    threading.Thread(target=d.loop, daemon=True).start()
    emit({"ev": "ready", "ray": ray.__version__})
    ops = {"start": d.start, "stop": d.stop, "log": d.log, "adopt": d.adopt, "prepare": d.prepare}
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        r = {}
        try:
            r = json.loads(line)
            answer = ops[r["op"]](r)
        except Exception as ex:
            say(traceback.format_exc())
            answer = {"ok": False, "error": short(ex)}
        if answer is not None:
            answer.update({"ev": "reply", "re": r.get("re")})
            emit(answer)
    os._exit(0)


if __name__ == "__main__":
    main()
