"""gpu-check task: one short real training step (an MLP regression with SGD) on the GPU
gpuam granted (CUDA_VISIBLE_DEVICES), timed after warm-up, and the same step on the CPU.
PyTorch when it imports, else JAX; with both, JAX's step follows PyTorch's (under "also").
Writes $GPU_CHECK_OUT/train.json."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

WARMUP = 3
GPU_STEPS = 50
CPU_STEPS = 5
BATCH, DIM, HIDDEN = 512, 1024, 4096


def torch_steps(torch, device, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, DIM, device=device)
    y = torch.randn(BATCH, DIM, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(WARMUP):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    ms = (time.perf_counter() - t0) * 1000 / steps
    return ms, float(loss.item()), str(x.device)


def jax_steps(jax, device, steps):
    import jax.numpy as jnp  # noqa: PLC0415

    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k1, (DIM, HIDDEN)) * 0.02,
        "w2": jax.random.normal(k2, (HIDDEN, DIM)) * 0.02,
    }
    x = jax.random.normal(k3, (BATCH, DIM))
    y = jax.random.normal(k4, (BATCH, DIM))
    params, x, y = jax.device_put((params, x, y), device)

    def loss_fn(p):
        return jnp.mean((jnp.maximum(x @ p["w1"], 0) @ p["w2"] - y) ** 2)

    @jax.jit
    def step(p):
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 1e-3 * b, p, g), loss

    for _ in range(WARMUP):
        params, loss = step(params)
    loss.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        params, loss = step(params)
    loss.block_until_ready()
    ms = (time.perf_counter() - t0) * 1000 / steps
    return ms, float(loss), str(list(loss.devices())[0])


def run(name, fw):
    """The step on the first GPU the framework sees, then on the CPU; fields for the report."""
    res = {"framework": f"{name} {fw.__version__}"}
    try:
        if name == "torch":
            res["gpus_visible"] = fw.cuda.device_count() if fw.cuda.is_available() else 0
            if res["gpus_visible"] > 0:
                props = fw.cuda.get_device_properties(0)
                res["gpu_name"] = props.name
                res["gpu_memory_mib"] = props.total_memory // (1 << 20)
                res["gpu_uuid"] = str(getattr(props, "uuid", ""))
                res["cuda"] = fw.version.cuda
                ms, loss, dev = torch_steps(fw, "cuda:0", GPU_STEPS)
                res.update(gpu_step_ms=round(ms, 3), gpu_loss=loss, device=dev)
            ms, loss, dev = torch_steps(fw, "cpu", CPU_STEPS)
            res.update(cpu_step_ms=round(ms, 3), cpu_loss=loss, cpu_device=dev)
        else:
            gpus = common.jax_gpus(fw)
            res["gpus_visible"] = len(gpus)
            if gpus:
                res["gpu_name"] = gpus[0].device_kind
                ms, loss, dev = jax_steps(fw, gpus[0], GPU_STEPS)
                res.update(gpu_step_ms=round(ms, 3), gpu_loss=loss, device=dev)
            cpu = fw.devices("cpu")[0]
            ms, loss, dev = jax_steps(fw, cpu, CPU_STEPS)
            res.update(cpu_step_ms=round(ms, 3), cpu_loss=loss, cpu_device=dev)
    except Exception as e:  # noqa: BLE001 - the report says what failed
        res["error"] = f"{type(e).__name__}: {e}"[:800]
    if res.get("gpu_step_ms") and res.get("cpu_step_ms"):
        res["cpu_over_gpu"] = round(res["cpu_step_ms"] / res["gpu_step_ms"], 1)
    return res


def main():
    res = common.base_facts()
    res["shape"] = f"MLP {DIM}-{HIDDEN}-{DIM}, batch {BATCH}, SGD, fp32"
    name, fw = common.framework()
    if name is None:
        res["framework"] = None
        res["error"] = f"neither PyTorch nor JAX imports: {fw}"
        common.write_result("train", res)
        return 1
    res.update(run(name, fw))
    # The other framework too, when it imports (PyTorch first, then JAX): both on one run.
    if name == "torch":
        try:
            import jax  # noqa: PLC0415

            res["also"] = run("jax", jax)
        except Exception as e:  # noqa: BLE001
            res["also"] = {"framework": None, "error": f"jax: {type(e).__name__}: {e}"[:300]}
    common.write_result("train", res)
    return 0 if "device" in res and "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
