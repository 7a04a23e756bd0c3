"""The autotuner and its on-disk config cache.

A kernel family with a config space (the matmul template's tiles, for one) asks `tuned` for the
config of one problem key. The answer comes from, in order: this process's memory, the cache file
of this device, or a measurement of every candidate with the pipelined timer (tuning/timing.py) on
random inputs of the problem's shapes (each candidate's results first checked against the first
candidate's: `agrees`; one that differs is skipped, named in a warning and in the file), whose
winner is written back to the file. So a process pays for tuning once per key and device, and
every later process starts with the tuned config. Keys carry a hash of the kernel code measured
(version_of), so changed kernels are tuned afresh.

The file is JSON, one per device kind and Triton version
($XKERN_CACHE_DIR or ~/.cache/xkern, then configs/<device>--triton-<version>.json), written by
atomic rename after merging with what is on disk, under a lock file, so processes tuning at once
neither corrupt it nor drop each other's keys. Tuning runs only on the triton backend and only
when XKERN_AUTOTUNE is not 0; otherwise, and for keys whose candidates all fail, the family's
heuristic config (the first candidate) is used.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
import threading
import warnings
from typing import Callable, Sequence

try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None

from xkern import _compat
from xkern.kernels import launch as L

ENV_VAR = "XKERN_AUTOTUNE"
_LOCK = threading.Lock()
_MEMORY: dict[str, dict[str, dict]] = {}  # cache file path -> {key: entry}
_UNWRITABLE: set[str] = set()  # cache files a write failed for (warned once each)


ACCEPTED = ("0", "1", "false", "true", "off", "on", "")  # "" (or unset): on


def enabled() -> bool:
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value not in ACCEPTED:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(v for v in ACCEPTED if v)} (or unset); got {value!r}")
    return value not in ("0", "false", "off")


def device_name() -> str:
    """The device kind and Triton version a cache file belongs to (configs do not travel)."""
    import jax
    import triton
    kind = jax.devices()[0].device_kind
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{kind}--triton-{triton.__version__}")


def cache_path(device: str | None = None) -> str:
    from xkern.fusion.codegen import cache_dir  # the same root as generated sources
    return os.path.join(cache_dir("configs"), f"{device or device_name()}.json")


def to_json(config: L.Config) -> dict:
    return {"meta": dict(config.meta), "num_warps": config.num_warps, "num_stages": config.num_stages}


def from_json(entry: dict) -> L.Config:
    return L.Config.of(num_warps=int(entry["num_warps"]), num_stages=int(entry["num_stages"]),
                       **entry["meta"])


def _read(path: str) -> dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent or unreadable (a half-written file is never renamed into place)


def lookup(key: str, path: str) -> L.Config | None:
    with _LOCK:
        if path not in _MEMORY:
            _MEMORY[path] = _read(path)
        entry = _MEMORY[path].get(key)
    try:
        return from_json(entry) if entry else None
    except (KeyError, TypeError, ValueError):
        return None  # an entry from an incompatible version: re-tune


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on `path` among processes (a lock file beside it; where fcntl is missing or
    the file system takes no locks, none: at worst a key is measured again)."""
    with open(f"{path}.lock", "a") as lock:
        try:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        except OSError:
            pass
        yield


def store(key: str, config: L.Config, seconds: float, path: str, disagreed: Sequence[str] = ()) -> None:
    """Write `key`'s winner (and the candidates skipped for giving other results, if any)."""
    entry = {**to_json(config), "us": round(seconds * 1e6, 2)}
    if disagreed:
        entry["disagreed"] = list(disagreed)
    with _LOCK:
        _MEMORY[path] = {**_read(path), key: entry}  # (this process keeps it even where the file cannot)
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with _locked(path):  # another process's read-merge-write waits, so neither loses the other's keys
                merged = {**_read(path), key: entry}
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(merged, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            _MEMORY[path] = merged
        except OSError as e:  # a read-only cache: later processes tune again, nothing worse
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
            if path not in _UNWRITABLE:
                _UNWRITABLE.add(path)
                warnings.warn(f"xkern: tuned configs cannot be written to {path} ({e}); each process will "
                              "tune again. Set XKERN_CACHE_DIR to a writable folder.", RuntimeWarning, stacklevel=3)


class Disagrees(ValueError):
    """A candidate whose result differs from the first candidate's: never a winner."""


# How far a candidate's outputs may be from the first candidate's, relative to their largest
# magnitude (at least 1), by the outputs' dtype: tiles sum in other orders, and 16-bit outputs round
# that to an ulp or two. A miscompiled tile was off by 30% of it (attention's dk, H200).
AGREEMENT = {"bfloat16": 2e-2, "float16": 5e-3}


def agrees(first: list, outputs) -> None:
    """Raise Disagrees unless `outputs` (a pytree of arrays: a candidate's results on the problem's
    random inputs) equal those of the first candidate measured, which `first` (empty before it)
    records; NaN only where the first has NaN. A family's measure calls it before timing: the tuner
    keeps the fastest candidate and would never look at its result, and Triton has compiled wrong
    code for one tile of a kernel whose other tiles are right (attention's dk/dv at 32 queries and
    8 warps on sm_90). Compared on the device: only two numbers per output travel."""
    import jax
    import jax.numpy as jnp
    leaves = jax.tree.leaves(outputs)
    if not first:
        first.extend(leaves)
        return
    for a, b in zip(leaves, first):
        if a.shape != b.shape:
            raise Disagrees(f"results of shape {a.shape} where the first candidate's are {b.shape}")
        allowed = AGREEMENT.get(jnp.dtype(b.dtype).name, 1e-3)
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))  # (infinities too: a row that sees no key)
        off = jnp.where(same, 0.0, jnp.nan_to_num(jnp.abs(a - b), nan=jnp.inf))
        off = float(jnp.max(off, initial=0.0))
        tolerance = allowed * max(float(jnp.max(jnp.where(jnp.isfinite(b), jnp.abs(b), 0.0), initial=0.0)), 1.0)
        if not off <= tolerance:
            raise Disagrees(f"off by {off:.3g} from the first candidate's result (allowed {tolerance:.3g})")


# The fastest candidates of the first pass are timed once more, in reverse order, each keeping its
# faster time: a GPU's clocks drift while candidates run one after another (on an H200 the matmul
# template's heuristic tile came out at 1.508 ms in one run and the tuner's pick at 1.565 in the next).
FINALISTS = 3


def best(candidates: Sequence[L.Config], measure: Callable[[L.Config], float],
         disagreed: list | None = None) -> tuple[L.Config, float]:
    """The fastest candidate by `measure` (seconds); one that fails to compile or run is skipped.
    Those skipped because their results differ (Disagrees) are appended to `disagreed` as
    (config, reason)."""
    times: dict[int, float] = {}

    def run(i: int) -> None:
        try:
            with _compat.eval_context():  # run the candidates now, not inside the user's trace
                seconds = measure(candidates[i])
        except Disagrees as e:
            if disagreed is not None:  # (never a finalist: measured once)
                disagreed.append((candidates[i], str(e)))
            return
        except Exception:  # noqa: BLE001 - out of shared memory, too many registers...: not a winner
            return
        times[i] = min(seconds, times.get(i, math.inf))

    for i in range(len(candidates)):
        run(i)
    if not times:
        return candidates[0], math.inf
    if len(times) > 1:
        for i in reversed(sorted(times, key=times.get)[:FINALISTS]):
            run(i)
    fastest = min(times, key=times.get)
    return candidates[fastest], times[fastest]


def version_of(*parts) -> str:
    """A short hash naming the code a config was tuned for: Triton kernels (their cache_key covers
    their source and every helper they call) or template text. A winner measured on older code is
    not reused once the code changes."""
    text = "|".join(getattr(p, "cache_key", None) or str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def tuned(family: str, key: str, candidates: Sequence[L.Config], measure: Callable[[L.Config], float],
          backend: str, path: str | None = None, version: str = "") -> L.Config:
    """The config for `family` at `key`; candidates[0] is the heuristic, used when not tuning.
    version (version_of the kernels measured) is part of the cache key."""
    # enabled() first: a bad XKERN_AUTOTUNE is an error on every backend, not only where it is used
    if not enabled() or backend != "triton" or len(candidates) == 1:
        return candidates[0]
    path = path or cache_path()
    full_key = f"{family}@{version}|{key}" if version else f"{family}|{key}"
    config = lookup(full_key, path)
    if config not in candidates:  # (None, or an entry edited by hand or from a config space since changed)
        config = None
    if config is None:
        disagreed: list = []
        config, seconds = best(candidates, measure, disagreed)
        for bad, reason in disagreed:  # a compiler bug, most likely: say so, once (the file keeps it)
            warnings.warn(f"xkern: the {family} candidate {describe(bad)} gave results unlike the first "
                          f"candidate's at {key} ({reason}); skipped. A Triton miscompile of that tile is "
                          "likely: please report it with this message.", RuntimeWarning, stacklevel=2)
        if len(disagreed) > 1:
            warnings.warn(f"xkern: {len(disagreed)} {family} candidates differ from the first one at {key}; "
                          f"the first, {describe(candidates[0])}, may be the one that is wrong.", RuntimeWarning,
                          stacklevel=2)
        if math.isfinite(seconds):
            store(full_key, config, seconds, path, [f"{describe(bad)}: {reason}" for bad, reason in disagreed])
    return config


def describe(config: L.Config) -> str:
    """A config as one line: its meta-parameters, warps and stages."""
    meta = ", ".join(f"{k}={v}" for k, v in sorted(dict(config.meta).items()))
    return f"({meta}, num_warps={config.num_warps}, num_stages={config.num_stages})"
