"""Canonicalization: inline call wrappers so patterns see through them, and find dead equations.

`jax.jit` inside a program (jax.nn.log_softmax is one) leaves a `jit` equation around its body;
patterns would never see a body's equations next to their neighbours, so such calls are inlined by
re-tracing an interpreter over the jaxpr (source info kept). Higher-order primitives with real
semantics (cond, scan, while, remat, custom_jvp/vjp) are left alone: the rewrite recurses into them.
"""
from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, Literal

from xkern import _compat

INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


bind_equation = _compat.bind_equation


def _inline_eval(jaxpr, consts, args, source_info=None) -> list:
    """Evaluate `jaxpr`, inlining calls; inlined equations take the call's source info (the user's
    line, where the body's own would point inside a library)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in INLINED:
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            body, body_consts = (sub.jaxpr, sub.consts) if isinstance(sub, ClosedJaxpr) else (sub, [])
            outs = _inline_eval(body, body_consts, invals, source_info or eqn.source_info)
        else:
            outs = bind_equation(eqn, invals, source_info=source_info)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def has_calls(jaxpr) -> bool:
    return any(e.primitive.name in INLINED for e in jaxpr.eqns)


def canonicalize(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with its jit / call wrappers inlined (the same jaxpr when it has none)."""
    if not has_calls(closed.jaxpr):
        return closed
    avals = [v.aval for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *args: _inline_eval(closed.jaxpr, closed.consts, args))(*avals)


def live_equations(jaxpr, reads=None) -> set[int]:
    """Indices of equations whose outputs reach the jaxpr's outputs, or that have effects (DCE).
    reads(i, eqn): the values equation i reads, where that is not its invars (a rewritten one)."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    live = set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live.add(i)
            read = eqn.invars if reads is None else reads(i, eqn)
            needed.update(v for v in read if not isinstance(v, Literal))
    return live


def dce(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` without its dead equations (the same jaxpr when it has none)."""
    live = live_equations(closed.jaxpr)
    if len(live) == len(closed.jaxpr.eqns):
        return closed
    jaxpr = closed.jaxpr

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, Literal) else env[v]
        for i in sorted(live):
            eqn = jaxpr.eqns[i]
            env.update(zip(eqn.outvars, bind_equation(eqn, [read(v) for v in eqn.invars])))
        return [read(v) for v in jaxpr.outvars]
    return jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])
