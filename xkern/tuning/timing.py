"""Device timing, the one method used by benchmarks and the tuner (see shared/GPU.md).

Dispatch N calls back to back, block once on the last result, divide by N; repeat and take the
median. Blocking after every call would add ~0.2 ms of host round trip per call on an H200 and hide
any kernel under a millisecond. The first call (compilation, allocation) is never timed.
"""
from __future__ import annotations

import statistics
import time

import jax


def time_pipelined(fn, *args, repeats: int = 3, min_seconds: float = 0.05,
                   max_calls: int = 5000) -> float:
    """Median seconds per call of `fn(*args)`, timed as a pipelined batch of calls."""
    jax.block_until_ready(fn(*args))  # compile and allocate outside the timing
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    estimate = max(time.perf_counter() - start, 1e-6)
    calls = int(min(max_calls, max(5, min_seconds / estimate)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)
