"""A graph view over a jaxpr: who produces each variable, who consumes it, which are outputs.

Read by the matcher, by fusion and by memory planning; it never edits the jaxpr (rewrites re-trace).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import Literal, Var


class Graph:
    def __init__(self, jaxpr, consts=()):
        self.jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        self.consts = dict(zip(self.jaxpr.constvars, consts))  # a closed jaxpr's constant values
        self.eqns = list(self.jaxpr.eqns)
        self.producer: dict[Var, tuple[int, int]] = {}  # var -> (eqn index, output index)
        self.consumers: dict[Var, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            for k, v in enumerate(eqn.outvars):
                self.producer[v] = (i, k)
            for v in eqn.invars:
                if isinstance(v, Var):
                    self.consumers.setdefault(v, []).append(i)
        self.invars = set(self.jaxpr.invars) | set(self.jaxpr.constvars)
        self.outvars = {v for v in self.jaxpr.outvars if isinstance(v, Var)}
        self.operand_kinds: dict[int, tuple[str, ...]] = {}  # the pattern matcher's caches
        self.operands_fit: dict[tuple, bool] = {}

    def residual_sum(self, var) -> int | None:
        """The equation computing `var` as the sum of two arrays of its shape and dtype (a residual
        connection, which a norm's kernel can take), or None."""
        if var not in self.producer:
            return None
        i = self.producer[var][0]
        eqn = self.eqns[i]
        if eqn.primitive.name != "add" or any(
                isinstance(v, Literal) or (v.aval.shape, v.aval.dtype) != (var.aval.shape, var.aval.dtype)
                for v in eqn.invars):
            return None
        return i

    def escapes(self, var, inside: set[int]) -> bool:
        """Whether `var` is read outside the equations `inside` (or is an output of the jaxpr)."""
        return var in self.outvars or any(c not in inside for c in self.consumers.get(var, ()))


def constant_equations(graph: Graph, var) -> list[int] | None:
    """The equations, in order, by which the program computes `var` from literals and constants
    alone (a causal mask built from iota, say); None if it reads a program input, goes through an
    equation with effects, or reads a constant that is a tracer of an enclosing trace (a value of
    the outer program, unknown now)."""
    order: list[int] = []

    def computable(v) -> bool:
        if isinstance(v, Literal):
            return True
        if v in graph.consts:  # (a jaxpr traced inside another's trace closes over the outer tracers)
            return not isinstance(graph.consts[v], jax.core.Tracer)
        if v not in graph.producer:
            return False  # a program input
        i = graph.producer[v][0]
        if i in order:
            return True
        eqn = graph.eqns[i]
        if eqn.effects or not all(computable(u) for u in eqn.invars):
            return False
        order.append(i)
        return True
    return order if computable(var) else None


def constant_value(graph: Graph, var, max_elements: int):
    """`var`'s value (a concrete jax array, on the default device) if the program computes it from
    literals and constants alone (constant_equations), evaluated now; None if not, or if it has
    more than `max_elements` elements. Read it under jax.ensure_compile_time_eval() while tracing."""
    if int(np.prod(var.aval.shape, dtype=np.int64)) > max_elements:
        return None
    order = constant_equations(graph, var)
    if order is None:
        return None
    from xkern._compat import bind_equation

    env = dict(graph.consts)
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    try:
        with jax.ensure_compile_time_eval():  # concrete values even while the caller traces
            for eqn in (graph.eqns[i] for i in order):
                values = [read(v) for v in eqn.invars]
                env.update(zip(eqn.outvars, values if eqn.primitive.name in MARKS else bind_equation(eqn, values)))
            return jax.numpy.asarray(read(var))
    except Exception:  # noqa: BLE001 - an equation that cannot run eagerly here: the value is unknown
        return None


MARKS = frozenset({"pvary"})  # equations that only retype a value (inside shard_map), never change it


def unmarked(graph: Graph, atom) -> tuple:
    """(the value `atom` is a retyping of, the marking equations passed): inside shard_map jax
    writes `pvary` where a replicated value (a literal, a constant mask) meets a per-device one,
    so `max(-inf, m)` is traced as `max(pvary(-inf), m)`. Patterns match through such marks."""
    marks = []
    while not isinstance(atom, Literal) and atom in graph.producer:
        i = graph.producer[atom][0]
        if graph.eqns[i].primitive.name not in MARKS:
            break
        marks.append(i)
        atom = graph.eqns[i].invars[0]
    return atom, marks


def as_literal(graph: Graph, atom):
    """`atom` if it is a literal, or the literal it marks as varying across devices; else None."""
    atom, _ = unmarked(graph, atom)
    return atom if isinstance(atom, Literal) else None


def literal_value(atom):
    return atom.val if isinstance(atom, Literal) else None


def same_literal(a, b) -> bool:
    """Equal values, as the literals' dtypes hold them: a weak-typed float32 literal keeps the Python
    float it was written as (MaxText's -0.7 * float32 max / 2 against a weak-typed mask), the same
    number given a float32 array is rounded first."""
    va, vb = (np.asarray(literal_value(x), dtype=getattr(getattr(x, "aval", None), "dtype", None)) for x in (a, b))
    return va.shape == vb.shape and bool(np.array_equal(va, vb, equal_nan=True))


def aval_bytes(aval) -> int:
    shape = getattr(aval, "shape", ())
    return int(np.prod(shape, dtype=np.int64)) * aval.dtype.itemsize if shape else 0  # (a PRNG key's too)


SHAPING = ("broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims")


def before_shaping(graph: Graph, var) -> tuple:
    """(the var that `var` broadcasts, reshapes or casts, the dtypes cast to on the way, last first)."""
    casts = []
    while not isinstance(var, Literal) and var in graph.producer:
        eqn = graph.eqns[graph.producer[var][0]]
        if eqn.primitive.name not in SHAPING:
            break
        if eqn.primitive.name == "convert_element_type":
            casts.append(eqn.params["new_dtype"])
        var = eqn.invars[0]
    return var, casts


def _cast(x, casts: list):
    """The number x cast as `casts` (last first) cast it, back as a Python float."""
    with jax.ensure_compile_time_eval():
        x = jax.numpy.asarray(x)
        for dtype in reversed(casts):
            x = x.astype(dtype)
        return float(x)


def uniform_value(graph: Graph, var) -> float | None:
    """The one value every element of `var` holds, if the program makes it by broadcasting (and
    casting) a literal or a small constant; else None."""
    var, casts = before_shaping(graph, var)
    value = var.val if isinstance(var, Literal) else constant_value(graph, var, 1 << 16)
    if value is None:
        return None
    value = np.asarray(value)
    if value.size == 0 or not np.all(value == value.flat[0]):
        return None
    return _cast(value.flat[0], casts)


# Elementwise primitives through which a value stays a function of one boolean array (each other
# operand uniform): what a padding bias is written with.
_BOOL_FUNCTION_OPS = frozenset({"add", "sub", "mul", "div", "neg", "max", "min", "select_n"})


def _of_one_bool(graph: Graph, var, leaves: set, visits: list):
    """f with var == f(p) elementwise, p the one boolean array of `leaves` (filled here) it is made
    from, through broadcasts, reshapes, casts and arithmetic with uniform operands; a uniform value
    is a constant f. None otherwise (also past 32 values looked at: visits counts them). f maps a
    Python bool to a 0-d array."""
    visits.append(var)
    if len(visits) > 32:
        return None
    value = uniform_value(graph, var)
    if value is not None:
        dtype = var.aval.dtype
        return lambda p: jax.numpy.asarray(value, dtype)
    if isinstance(var, Literal):
        return None
    if var.aval.dtype == np.bool_ and (var not in graph.producer or graph.eqns[graph.producer[var][0]].primitive.name
                                       not in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")):
        leaves.add(var)
        return (lambda p: jax.numpy.asarray(p)) if len(leaves) == 1 else None
    if var not in graph.producer:
        return None
    eqn = graph.eqns[graph.producer[var][0]]
    name = eqn.primitive.name
    if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
        return _of_one_bool(graph, eqn.invars[0], leaves, visits)
    if name == "convert_element_type":
        inner = _of_one_bool(graph, eqn.invars[0], leaves, visits)
        return None if inner is None else (lambda p: inner(p).astype(eqn.params["new_dtype"]))
    if name not in _BOOL_FUNCTION_OPS:
        return None
    parts = []
    for v in eqn.invars:
        parts.append(_of_one_bool(graph, v, leaves, visits))
        if parts[-1] is None or len(leaves) > 1:
            return None
    if len(leaves) != 1:
        return None
    if name == "select_n":  # select_n(which, *cases): cases[which]
        return lambda p: parts[1 + int(parts[0](p))](p)
    return lambda p: eqn.primitive.bind(*(f(p) for f in parts), **eqn.params)


def padding_fill(graph: Graph, var) -> float | None:
    """f where `var` holds only 0 and f, as a function of one boolean array: a padding bias
    (`jnp.where(mask, 0., f)`, t5x's and HF's; `(1. - mask) * f` and `f * (mask - 1.)` of a boolean
    mask cast), through broadcasts, reshapes and casts; else None."""
    f = _of_one_bool(graph, var, set(), [])
    if f is None:
        return None
    try:
        with jax.ensure_compile_time_eval():
            values = sorted(float(f(p)) for p in (False, True))
    except Exception:  # noqa: BLE001 - an operand that cannot be evaluated here: not a padding bias
        return None
    return values[0] if values[1] == 0 and values[0] != 0 else None
