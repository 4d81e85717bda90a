"""Timing helpers the benchmark scripts share (device time of a call, kernels of a call from torch's
profiler, copy bandwidth) and the run metadata every results JSON carries."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np


def run_info() -> dict:
    """Device, versions, date and commit of this run (the header of every results JSON)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table (what each benchmark prints at the end, ready for a results summary)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def ms(seconds: float | None, digits: int = 3) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def device_time(fn, args, reps=20):
    """Seconds per call on the device: `reps` dependent calls inside one jitted scan."""

    @jax.jit
    def many(q, *rest):
        def body(c, _):
            o = fn(q + c, *rest)
            return c + (o[0, 0, 0] * 0).astype(c.dtype), None
        c, _ = jax.lax.scan(body, jnp.zeros((), q.dtype), None, length=reps)
        return c

    many(*args).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        many(*args).block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times))


def loop_time(fn, args, reps=50):
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        o = f(*args)
    jax.block_until_ready(o)
    return (time.perf_counter() - t) / reps


def kernel_events(fn, args, calls):
    """[(name, start_us, duration_us)] of every CUDA kernel run during `calls` calls of fn."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    f = jax.jit(fn)
    for _ in range(3):
        jax.block_until_ready(f(*args))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            jax.block_until_ready(f(*args))  # one call at a time: its kernels form one span
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            out.append((e.name, e.time_range.start, e.device_time))
    return sorted(out, key=lambda x: x[1])


def spans(events, calls):
    """Split the sorted events into `calls` groups at the largest gaps; (first start, last end) each."""
    if not events:
        return []
    ends = [s + d for _, s, d in events]
    gaps = sorted(range(1, len(events)), key=lambda i: events[i][1] - ends[i - 1], reverse=True)[:calls - 1]
    cuts = [0] + sorted(gaps) + [len(events)]
    return [(events[a][1], max(ends[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]


def profile_span(fn, args, calls=20):
    """(median span of one call from its first kernel's start to its last kernel's end, the sum of
    its kernels' durations), in seconds, from torch's profiler; None without torch and CUDA."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    ev = kernel_events(fn, args, calls)
    sp = spans(ev, calls)
    if not sp:
        return None
    return float(np.median([b - a for a, b in sp])) * 1e-6, sum(d for _, _, d in ev) / calls * 1e-6


def copy_bandwidth():
    """Device-to-device copy bandwidth (bytes read + written per second): torch's copy_ when available
    (the measurement that gave 4.3 TB/s on the H200), else a jax elementwise pass."""
    try:
        import torch
        if torch.cuda.is_available():
            x = torch.empty(2 ** 32, dtype=torch.uint8, device="cuda").random_(0, 255)
            y = torch.empty_like(x)
            y.copy_(x)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(10):
                start.record()
                y.copy_(x)
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end) / 1e3)
            bw = 2 * x.numel() / float(np.median(ts))
            del x, y
            torch.cuda.empty_cache()
            return bw
    except ImportError:
        pass
    n = 512 if jax.default_backend() == "gpu" else 16   # 2 GiB on a GPU, 64 MiB elsewhere
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 1024, 1024), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / float(np.median(ts))


def add_model_args(p):
    """The model-shape flags the decode benchmarks share (default: the issue's Hq=32, Hk=8, D=128,
    block 128)."""
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hk", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
