"""The order of xkern's steps over a traced program, in one place, above every package it orders.

    1. canonicalize   inline jit / call wrappers so patterns can see through them
    2. patterns       named patterns -> xkern ops; each match checked exactly, by dtype, and by the
                      cost model (a rewrite that loses to XLA is declined, with its reason)
    3. fusion         groups of the remaining elementwise / last-axis-reduction equations -> generated
                      Triton kernels, where the cost model says they beat XLA's own fusions
    4. memory         live ranges over the planned program: generated kernels write their outputs
                      over inputs that die at them (xkern/memory)

Sub-jaxprs (cond branches, scan and while bodies, remat, custom_jvp) go through the same steps.
"""
from __future__ import annotations

from jax.extend.core import ClosedJaxpr

from xkern import _collector
from xkern.jaxpr_passes.canonicalize import canonicalize
from xkern.jaxpr_passes.rewrite import Plan, empty_plan, fuse_groups, match_patterns
from xkern.memory.liveness import plan_in_place
from xkern.tuning.cost import decline_reason


def plan(closed: ClosedJaxpr, backend: str) -> Plan:
    """What xkern will do to the program `closed` on `backend`."""
    if backend == "xla":
        return empty_plan(closed)
    with _collector.paused():  # (xkern.jit pauses it over the trace too; this, for callers of plan)
        closed = canonicalize(closed)
        planned = match_patterns(closed, backend, cost=decline_reason,
                                 plan_sub=lambda sub: plan(sub, backend))
        planned = fuse_groups(planned, backend, cost=decline_reason)
        plan_in_place(planned)
    return planned
