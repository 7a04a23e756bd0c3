"""Benchmark harness: xkern against jax.jit, by the timing method of shared/GPU.md.

Each case is checked against XLA on fresh random inputs before it is timed; a case whose result
disagrees fails loudly instead of printing a number. Effective bandwidth counts the fewest bytes the
program must move (each input read once, each output written once).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import platform
from typing import Callable

import jax
import numpy as np

from xkern.tuning.timing import time_pipelined

# Rooflines of the reference GPU (shared/GPU.md), measured on an H200.
ROOFLINE_TBPS = {"H200": 4.3}


@dataclasses.dataclass
class Case:
    op: str
    shape: tuple
    dtype: str
    mode: str  # "fwd" or "fwd+bwd"
    xkern_fn: Callable
    xla_fn: Callable
    make_args: Callable[[jax.Array], tuple]  # key -> fresh random inputs
    min_bytes: int  # 0 for whole programs (no single roofline applies)
    tolerance: float  # on max |xkern - xla| / max(|xla|, 1)
    flops: int = 0  # matmuls: floating-point operations per call (rates then in TFLOP/s)
    memory: bool = False  # also record each program's temporary memory (XLA's memory analysis)


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    dtype: str
    mode: str
    xkern_ms: float
    xla_ms: float
    speedup: float
    xkern_tbps: float | None
    xla_tbps: float | None
    roofline_pct: float | None
    max_error: float
    xkern_tflops: float | None = None
    xla_tflops: float | None = None
    xkern_temp_gib: float | None = None
    xla_temp_gib: float | None = None


def device_name() -> str:
    device = jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


def _roofline() -> float | None:
    kind = device_name()
    return next((v for k, v in ROOFLINE_TBPS.items() if k in kind), None)


def max_error(got, want) -> float:
    """Largest error relative to the reference's magnitude, over every output (a pytree)."""
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise AssertionError(f"{len(got_leaves)} outputs != {len(want_leaves)}")
    errors = [0.0]
    for got, want in zip(got_leaves, want_leaves):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:
            raise AssertionError(f"shape {got.shape} != {want.shape}")
        if not np.isfinite(got).all():
            raise AssertionError("xkern produced non-finite values on finite inputs")
        if got.size:
            errors.append(float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0)))
    return max(errors)


def temp_gib(jitted, *args) -> float | None:
    """Temporary (scratch) memory of the compiled program, as XLA's buffer assignment reports it:
    what it needs beyond its arguments and results."""
    analysis = jitted.lower(*args).compile().memory_analysis()
    size = getattr(analysis, "temp_size_in_bytes", None)
    return None if size is None else round(size / 2**30, 3)


def run_case(case: Case, seed: int = 0) -> Row:
    xkern_fn, xla_fn = jax.jit(case.xkern_fn), jax.jit(case.xla_fn)
    args = case.make_args(jax.random.key(seed))
    err = max_error(xkern_fn(*args), xla_fn(*args))
    if err > case.tolerance:
        raise AssertionError(f"{case.op} {case.shape} {case.mode}: error {err:.3g} > {case.tolerance}")
    t_xkern, t_xla = time_pipelined(xkern_fn, *args), time_pipelined(xla_fn, *args)
    roofline = _roofline() if case.min_bytes else None  # whole programs: no single roofline
    tbps = lambda t: round(case.min_bytes / t / 1e12, 3) if case.min_bytes else None
    tflops = lambda t: round(case.flops / t / 1e12, 1) if case.flops else None
    return Row(case.op, "x".join(map(str, case.shape)), case.dtype, case.mode,
               round(t_xkern * 1e3, 4), round(t_xla * 1e3, 4), round(t_xla / t_xkern, 3),
               tbps(t_xkern), tbps(t_xla),
               round(100 * tbps(t_xkern) / roofline, 1) if roofline else None, err,
               tflops(t_xkern), tflops(t_xla),
               *((temp_gib(xkern_fn, *args), temp_gib(xla_fn, *args)) if case.memory else (None, None)))


def format_table(rows: list[Row]) -> str:
    head = ("op", "shape", "dtype", "mode", "xkern ms", "jax.jit ms", "speedup", "xkern rate",
            "jax rate", "% roofline", "temp GiB xkern/jax")

    def rate(tbps, tflops):
        return f"{tflops:.0f} TFLOP/s" if tflops else ("-" if tbps is None else f"{tbps:.2f} TB/s")

    lines = [head] + [(r.op, r.shape, r.dtype, r.mode, f"{r.xkern_ms:.4f}", f"{r.xla_ms:.4f}",
                       f"{r.speedup:.2f}x", rate(r.xkern_tbps, r.xkern_tflops),
                       rate(r.xla_tbps, r.xla_tflops),
                       "-" if r.roofline_pct is None else f"{r.roofline_pct:.0f}%",
                       "-" if r.xkern_temp_gib is None else f"{r.xkern_temp_gib:.2f} / {r.xla_temp_gib:.2f}")
                      for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines)


def environment() -> dict:
    import triton

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(), "platform": jax.default_backend(), "jax": jax.__version__,
            "triton": triton.__version__, "python": platform.python_version()}


def save(rows: list[Row], path: str, command: str) -> None:
    with open(path, "w") as f:
        json.dump({"command": command, "environment": environment(),
                   "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


def best_vs_heuristic(label: str, results: list[dict], chosen: str) -> str:
    """One line of a config sweep: the fastest correct config, and the heuristic's time."""
    ok = [r for r in results if "ms" in r and r["max_error"] < 2e-2]
    best = min(ok, key=lambda r: r["ms"])
    mine = next((r for r in ok if r["config"] == chosen), None)
    return (f"{label}: best {best['ms']:.4f} ms {best['tbps']:.2f} TB/s {best['config']} | "
            f"heuristic {mine['ms'] if mine else '-'} ms")
