"""What every part of scripts/bench_gpu.py measures with: the verify block and the mean commit it decodes at, an
output's hash, medians, device time, the copy bandwidth (the floors' divisor) and a call's top kernels."""

from __future__ import annotations

import hashlib
import statistics
import time

BLOCK = 16
MEAN_COMMIT = 7.0


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def cuda_seconds(torch, device, fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, the device synchronized before and after each."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - began)
    return samples


def copy_bandwidth(torch, device) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = [torch.empty_like(src) for _ in range(2)]
    for i in range(3):
        dst[i % 2].copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(10):
        start.record()
        dst[i % 2].copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times)


def profile_top(torch, fn, repeats: int, top: int = 12) -> list[dict]:
    """The kernels that take most of the device time of fn(), per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in profiler.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            rows.append((device_us / repeats / 1e3, event.count // repeats, event.key[:90]))
    rows.sort(reverse=True)
    total = sum(ms for ms, _, _ in rows)
    return [{"ms_per_call": round(ms, 3), "launches": count, "kernel": name} for ms, count, name in rows[:top]] + [
        {"ms_per_call": round(total, 3), "launches": sum(c for _, c, _ in rows), "kernel": "(all kernels)"}]
