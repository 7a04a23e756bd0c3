"""Python's cyclic garbage collector, paused while xkern traces, plans and rewrites a program.

Those steps allocate millions of small objects (pattern objects built, templates unpickled,
equations traced), and every full collection walks every object in the process: collections were
two thirds of a training step's first plan (3.0 s, 1.46 s paused; a 2-core CPU). Memory is still
freed by reference counting while paused; cycles made meanwhile are collected once it resumes.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_state = {"depth": 0, "was_enabled": False}  # shared by nested pauses and by threads
_lock = threading.Lock()


@contextlib.contextmanager
def paused():
    """The collector off inside, then as it was before the outermost pause (errors too). Nested
    pauses (a differentiated function optimized inside a step's trace) and threads share one."""
    with _lock:
        if _state["depth"] == 0:
            _state["was_enabled"] = gc.isenabled()
            gc.disable()
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["was_enabled"]:
                gc.enable()
