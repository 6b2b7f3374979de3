"""Data-parallel training of a small MLP with JAX, one process per gpuam task.

Run by examples/jax-ddp.yaml (see README.md, "A real training job: JAX"). Every worker:

1. finds its rank and the coordinator (task 0's host and first port) only through the
   environment gpuam gives a gang job: GPUAM_TASK_INDEX and GPUAM_HOSTS_<ROLE>
   ("host:port,host:port,..." in task-index order), or OpenPAI's names
   (PAI_TASK_INDEX, PAI_TASK_ROLE_TASK_COUNT_<role>, PAI_HOST_IP_<role>_0,
   PAI_<role>_0_<label>_PORT) where gpuam's are absent;
2. joins jax.distributed with a bounded initialization timeout; the coordinator binds
   task 0's own address and port, never every interface;
3. trains a few steps on its own shard of a synthetic regression problem, gradients
   averaged over all workers (lax.pmean inside shard_map, gloo collectives on CPU);
4. prints one `step N loss X` line per step and `PARAMS_SHA256 <hex>` at the end: with
   the all-reduce in place every replica ends with the same parameters, so the same hash.

A peer that never comes makes the job fail within the timeout, with a message naming the
missing task and its address, rather than hang; a peer that dies during training ends the
others at their next step, each naming the task that left. Exit codes: 0 done; 3 bad environment; 4 the rendezvous failed
(a peer missing or unreachable); 5 a peer left during training.
"""

import argparse
import hashlib
import os
import select
import socket
import sys
import threading
import time

# Proxy variables can hang gRPC's start-up (the coordinator is reached through them);
# the rendezvous is always direct. Cleared before JAX is imported.
for _name in list(os.environ):
    if _name.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy"):
        del os.environ[_name]


def say(msg):
    print(msg, flush=True)


def fail(code, msg):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def env_int(name):
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        fail(3, f"{name}={v!r} is not an integer")


def peers_from_env(role, port_label):
    """(rank, ["host:port", ...] in task-index order, where they came from)."""
    env_role = "".join(c.upper() if c.isalnum() else "_" for c in role)
    hosts = os.environ.get(f"GPUAM_HOSTS_{env_role}")
    rank = env_int("GPUAM_TASK_INDEX")
    if hosts and rank is not None:
        peers = [h.strip() for h in hosts.split(",") if h.strip()]
        for p in peers:
            if not p.rpartition(":")[2].isdigit():
                fail(3, f"GPUAM_HOSTS_{env_role} entry {p!r} has no port: give the role a port in the job spec "
                        f"(resourcePerInstance.ports: {{{port_label}: 1}})")
        return rank, peers, f"GPUAM_HOSTS_{env_role}"
    # OpenPAI names (protocol v2 jobs).
    rank = env_int("PAI_TASK_INDEX")
    count = env_int(f"PAI_TASK_ROLE_TASK_COUNT_{role}")
    ip0 = os.environ.get(f"PAI_HOST_IP_{role}_0")
    port0 = os.environ.get(f"PAI_{role}_0_{port_label}_PORT")
    if rank is not None and count and ip0 and port0:
        # Only task 0's address matters for the rendezvous; the others are named by index.
        peers = [f"{ip0}:{port0}"] + [f"{os.environ.get(f'PAI_HOST_IP_{role}_{i}', '?')}:-" for i in range(1, count)]
        return rank, peers, "PAI_* variables"
    fail(3, f"no peer list: expected GPUAM_HOSTS_{env_role} and GPUAM_TASK_INDEX (a gang job run by gpuam), "
            f"or PAI_TASK_INDEX, PAI_TASK_ROLE_TASK_COUNT_{role}, PAI_HOST_IP_{role}_0 and "
            f"PAI_{role}_0_{port_label}_PORT")


def address_of(host):
    """The IP address of a peer's host: gpuam gives the node's IP where the node has one
    (IPv6 in brackets), else a host name, resolved here (IPv4 first). A name that does not
    resolve is one of the simulated hosts of `gpuam run`'s demo cluster, whose containers
    all run on this machine."""
    host = host.strip("[]")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0], True
        except (socket.gaierror, IndexError):
            pass
    return "127.0.0.1", False


def host_port(ip, port):
    """`ip:port`, with an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Departures:
    """Which peers have left, learnt from the roll-call connections, which stay open while
    the job runs: a process that dies closes its end at once. Task 0 watches every peer's
    connection and tells the others `left K`; the others watch theirs to task 0."""

    def __init__(self):
        self.left = []
        self.changed = threading.Event()

    def record(self, k):
        if k not in self.left:
            self.left.append(k)
        self.changed.set()

    def wait(self, seconds):
        """The peers known to have left, waiting up to `seconds` for the first news."""
        self.changed.wait(seconds)
        return list(self.left)


def watch_peers(conns, departures):
    """Task 0: a peer's connection ending means that peer left; tell the rest."""
    def run():
        live = dict(conns)
        while live:
            ready, _, _ = select.select(list(live.values()), [], [])
            for k, c in list(live.items()):
                if c not in ready:
                    continue
                try:
                    data = c.recv(64)
                except OSError:
                    data = b""
                if data:
                    continue
                del live[k]
                c.close()
                departures.record(k)
                for other in live.values():
                    try:
                        other.sendall(f"left {k}\n".encode())
                    except OSError:
                        pass
    threading.Thread(target=run, daemon=True).start()


def watch_coordinator(reader, departures):
    """Tasks 1..n-1: `left K` lines from task 0; the connection ending means task 0 left."""
    def run():
        try:
            for line in reader:
                parts = line.split()
                if len(parts) == 2 and parts[0] == "left" and parts[1].isdigit():
                    departures.record(int(parts[1]))
        except (OSError, ValueError):
            pass
        departures.record(0)
    threading.Thread(target=run, daemon=True).start()


def roll_call(rank, peers, bind_ip, coord_ip, port, seconds, departures):
    """Before JAX starts: every task checks in with task 0 over TCP on the coordinator's
    port, so that a peer that never comes is named (JAX itself aborts without naming it).

    Task 0 listens on its own address, waits up to `seconds` for tasks 1..n-1 to send
    their index, then answers each `go` (or `missing i,j`) and stops listening, freeing
    the port for JAX's coordinator. The others connect (retrying while task 0 is not up
    yet), send their index and wait for the answer. The connections stay open to report
    departures (see Departures). Ends the process (exit 4) on failure."""
    deadline = time.monotonic() + seconds
    n = len(peers)
    if rank == 0:
        srv = socket.socket(socket.AF_INET6 if ":" in bind_ip else socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((bind_ip, port))
        except OSError as e:
            fail(4, f"task 0 cannot listen on {bind_ip}:{port} (its granted port): {e}")
        srv.listen(n)
        joined = {}
        while len(joined) < n - 1 and time.monotonic() < deadline:
            srv.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                break
            conn.settimeout(5)
            try:
                k = int(conn.recv(32).decode().strip())
            except (OSError, ValueError):
                conn.close()
                continue
            if 0 < k < n:
                if k in joined:
                    joined[k].close()
                joined[k] = conn
            else:
                conn.close()
        srv.close()
        missing = [k for k in range(1, n) if k not in joined]
        answer = "go" if not missing else "missing " + ",".join(map(str, missing))
        for conn in joined.values():
            try:
                conn.sendall((answer + "\n").encode())
            except OSError:
                pass
            conn.settimeout(None)
        if missing:
            who = ", ".join(f"task {k} ({peers[k]})" for k in missing)
            fail(4, f"missing peer: {who} did not join within {seconds} s")
        watch_peers(joined, departures)
        return
    while True:
        try:
            conn = socket.create_connection((coord_ip, port), timeout=2)
            break
        except OSError:
            if time.monotonic() >= deadline:
                fail(4, f"missing peer: the coordinator, task 0 at {peers[0]} ({coord_ip}:{port}), "
                        f"did not answer within {seconds} s")
            time.sleep(0.2)
    conn.sendall(f"{rank}\n".encode())
    conn.settimeout(max(1.0, deadline - time.monotonic() + 10))
    reader = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")
    try:
        answer = reader.readline().strip()
    except OSError:
        answer = ""
    if answer == "go":
        conn.settimeout(None)
        watch_coordinator(reader, departures)
        return
    if answer and not answer.startswith("missing "):
        # Something else (JAX's gRPC coordinator) holds the port: the rendezvous is over.
        fail(4, f"the coordinator, task 0 at {peers[0]}, is past its roll call: the other workers have "
                f"started already, and a restarted worker cannot rejoin a running JAX job")
    if answer.startswith("missing "):
        ks = [int(k) for k in answer.split()[1].split(",") if k.isdigit()]
        who = ", ".join(f"task {k} ({peers[k]})" for k in ks if k < n)
        fail(4, f"missing peer: {who} did not join within {seconds} s (reported by task 0)")
    fail(4, f"the coordinator, task 0 at {peers[0]}, ended the roll call without an answer")


def gloo_on(ip):
    """Makes JAX's CPU collectives (gloo over TCP) listen on `ip`, this task's own address.

    Left alone, gloo listens on the address of gethostname(), which is loopback on many
    machines (Debian's /etc/hosts maps the host name to 127.0.1.1; containers and network
    namespaces see the machine's name too) and then tells its peers on other hosts to
    connect to 127.0.x.x: the first all-reduce fails with "Connection refused". JAX 0.10 has
    no public option for gloo's address, so the CPU backend is registered again, before it
    is first used, with gloo given `ip`."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=ip)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default=os.environ.get("GPUAM_TASK_ROLE", "worker"))
    ap.add_argument("--port-label", default="coord", help="the port label the coordinator listens on")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="examples per worker per step")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to wait after each step (lets a person watch the loss fall)")
    ap.add_argument("--init-timeout", type=int, default=60,
                    help="seconds to wait for every peer at the rendezvous")
    ap.add_argument("--no-allreduce", action="store_true",
                    help="skip the gradient all-reduce (the replicas then drift apart: shows that the "
                         "PARAMS_SHA256 check can fail)")
    args = ap.parse_args()

    rank, peers, source = peers_from_env(args.role, args.port_label)
    n = len(peers)
    if not 0 <= rank < n:
        fail(3, f"task index {rank} is outside the {n} peers of {source}")
    coord_host, coord_port = peers[0].rsplit(":", 1)
    coord_ip, resolved = address_of(coord_host)
    coordinator = host_port(coord_ip, coord_port)
    # This task's own address: its entry in the peer list (what the others reach it at).
    my_ip, _ = address_of(peers[rank].rsplit(":", 1)[0])
    # On NVIDIA machines with jax[cuda12], JAX uses exactly these GPUs: gpuam's granted mask.
    say(f"worker {rank}/{n}: GPUs {os.environ.get('CUDA_VISIBLE_DEVICES', '(not set)') or '(none)'}"
        f" (CUDA_VISIBLE_DEVICES, granted by gpuam)")
    say(f"worker {rank}/{n}: coordinator task 0 at {peers[0]} -> {coordinator}"
        f"{'' if resolved else ' (simulated host: this machine)'}; peers from {source}")
    say(f"worker {rank}/{n}: on host {os.environ.get('GPUAM_HOST', '?')} at {my_ip}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    departures = Departures()
    roll_call(rank, peers, my_ip, coord_ip, int(coord_port), args.init_timeout, departures)
    gloo_on(my_ip)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=n,
        process_id=rank,
        # Task 0 binds its own address and the port gpuam granted it, not 0.0.0.0.
        coordinator_bind_address=coordinator if rank == 0 else None,
        # Everyone has checked in already; this bounds a peer dying in between.
        initialization_timeout=args.init_timeout,
        # A dead peer is noticed in seconds, not the default 100 s.
        heartbeat_timeout_seconds=10,
        shutdown_timeout_seconds=10,
    )
    say(f"worker {rank}/{n}: joined; {jax.device_count()} devices in all, {jax.local_device_count()} here "
        f"({jax.devices()[0].platform})")

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    by_worker = NamedSharding(mesh, P("data"))

    # Synthetic regression: y = tanh(x @ w_true), every worker drawing its own shard.
    dim, hidden = 16, 32
    true_w = np.random.default_rng(1234).normal(size=(dim, 1)).astype(np.float32)
    local_rng = np.random.default_rng(1000 + rank)

    def local_batch():
        x = local_rng.normal(size=(args.batch * jax.local_device_count(), dim)).astype(np.float32)
        y = np.tanh(x @ true_w).astype(np.float32)
        return x, y

    # The same initial parameters everywhere (same seed), placed as replicated arrays.
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    init = {
        "w1": np.asarray(jax.random.normal(k1, (dim, hidden)) * 0.3, dtype=np.float32),
        "b1": np.zeros((hidden,), np.float32),
        "w2": np.asarray(jax.random.normal(k2, (hidden, 1)) * 0.3, dtype=np.float32),
        "b2": np.zeros((1,), np.float32),
    }
    params = {k: jax.make_array_from_process_local_data(replicated, v) for k, v in init.items()}

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    def step_on_shard(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        # The all-reduce: without it every replica would follow its own data.
        if not args.no_allreduce:
            grads = jax.lax.pmean(grads, "data")
        loss = jax.lax.pmean(loss, "data")
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    # check_vma=False: JAX would otherwise sum the gradients of the replicated parameters
    # by itself; here the all-reduce is the explicit pmean above.
    train_step = jax.jit(jax.shard_map(
        step_on_shard, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()),
        check_vma=False))

    for step in range(1, args.steps + 1):
        x, y = local_batch()
        gx = jax.make_array_from_process_local_data(by_worker, x)
        gy = jax.make_array_from_process_local_data(by_worker, y)
        try:
            params, loss = train_step(params, gx, gy)
            value = float(np.asarray(loss.addressable_data(0)))
        except Exception as e:  # JAX's runtime errors (a gloo peer gone) have no common base
            # Which peer: the roll-call connections say within moments.
            gone = [k for k in departures.wait(3.0) if k != rank]
            who = ", ".join(f"task {k} ({peers[k]})" for k in gone) or "a peer"
            fail(5, f"training stopped at step {step}: {who} left the job (died or was stopped; its own "
                    f"log says why): {str(e).splitlines()[0]}")
        say(f"step {step} loss {value:.6f}")
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(np.asarray(params[name].addressable_data(0))).tobytes())
    say(f"PARAMS_SHA256 {digest.hexdigest()}")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
