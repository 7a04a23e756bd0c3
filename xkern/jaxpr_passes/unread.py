"""The aux outputs of a differentiated function that the program around it never reads.

A training step hands jax.value_and_grad(loss_fn, has_aux=True) a function whose aux may carry large
values the step drops: MaxText's loss_fn returns its logits there (for its eval step's metrics).
xkern plans that function before jax differentiates it (api._before_differentiation), on its own,
where the logits are one of its outputs: the LM head's kernel, which never writes them, is declined.
Whether the step reads them is known only once the whole step is traced. So each aux leaf leaves the
function through an identity marker (`aux_p`, keyed by the call and the leaf), and jax's dead-code
elimination of the traced step says which markers its outputs still need (`unread`). Where a call's
plan declined a pattern for an intermediate that is an output, and some of its aux leaves are
unread, the step is traced once more with those leaves made zeros in the function xkern plans; the
markers of that trace must show them unread still (`all_unread`: a trace cached by jax may number
the calls otherwise), or the first trace stands. Canonicalization removes the markers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import numpy as np
from jax.extend.core import Primitive, jaxprs_in_params
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

aux_p = Primitive("xkern_aux_output")  # params: key (call, leaf), dropped (made zeros in this trace)
aux_p.def_impl(lambda x, **_: x)
aux_p.def_abstract_eval(lambda x, **_: x)
ad.primitive_jvps[aux_p] = lambda primals, tangents, **params: (aux_p.bind(*primals, **params), tangents[0])
batching.primitive_batchers[aux_p] = lambda args, dims, **params: (aux_p.bind(*args, **params), dims[0])
mlir.register_lowering(aux_p, lambda ctx, x, **_: [x])


@dataclasses.dataclass
class Call:
    """One function the traced program differentiates with aux outputs."""
    plans: list = dataclasses.field(default_factory=list)  # xkern's plans of it
    dropped: frozenset = frozenset()  # its aux leaves made zeros in this trace
    paths: list = dataclasses.field(default_factory=list)  # its aux leaves' paths, as jax.tree_util.keystr


_state = threading.local()


@contextlib.contextmanager
def tracing(drop: dict):
    """A trace of the whole program, whose differentiated functions' aux leaves are marked; `drop`:
    call number -> the leaves to make zeros. Yields the calls, in the order they are traced."""
    previous = getattr(_state, "trace", None)
    _state.trace = (calls := [], drop)
    try:
        yield calls
    finally:
        _state.trace = previous


def marking(fun, optimize):
    """`optimize(fun)` (fun returns (out, aux), as jax.vjp's has_aux asks), its aux leaves marked and
    those the trace drops made zeros before it is planned; plain `optimize(fun)` outside `tracing`."""
    trace = getattr(_state, "trace", None)
    if trace is None:
        return optimize(fun, on_plan=None)
    calls, drop = trace
    number, call = len(calls), Call(dropped=frozenset(drop.get(len(calls), ())))
    calls.append(call)

    def planned(*args):
        out = fun(*args)
        if not call.dropped or not (isinstance(out, (tuple, list)) and len(out) == 2):
            return out
        leaves, tree = jax.tree_util.tree_flatten(out[1])
        leaves = [_zeros(leaf) if k in call.dropped else leaf for k, leaf in enumerate(leaves)]
        return out[0], jax.tree_util.tree_unflatten(tree, leaves)

    def marked(*args):
        out = optimize(planned, on_plan=call.plans.append)(*args)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            return out
        leaves, tree = jax.tree_util.tree_flatten(out[1])
        call.paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(out[1])[0]]
        leaves = [aux_p.bind(leaf, key=(number, k), dropped=k in call.dropped) if _is_array(leaf) else leaf
                  for k, leaf in enumerate(leaves)]
        return out[0], jax.tree_util.tree_unflatten(tree, leaves)
    return marked


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray)) or isinstance(leaf, jax.core.Tracer)


def _zeros(leaf):
    """What a dropped leaf becomes: zeros of its shape and dtype (nothing reads them), where it has a
    numeric dtype; anything else (a PRNG key) is kept."""
    dtype = getattr(leaf, "dtype", None)
    if not _is_array(leaf) or dtype is None or not (jax.numpy.issubdtype(dtype, np.number) or dtype == bool):
        return leaf
    return jax.numpy.zeros(np.shape(leaf), dtype)


def _markers(jaxpr) -> list:
    """The params of every marker in `jaxpr`, sub-jaxprs included."""
    found, todo = [], [jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            if eqn.primitive is aux_p:
                found.append(eqn.params)
            todo += [getattr(sub, "jaxpr", sub) for sub in jaxprs_in_params(eqn.params)]
    return found


def _surviving(closed) -> list:
    """The markers of `closed` that its outputs or effects need (jax's dead-code elimination)."""
    return _markers(pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)[0])


def unread(closed, calls: list, worth) -> dict:
    """Call number -> its aux leaves that `closed` never reads, for the calls where dropping them may
    change a plan (`worth(plan)`: one of its plans declined a pattern for an output)."""
    read = {p["key"] for p in _surviving(closed)}
    drop = {}
    for p in _markers(closed.jaxpr):
        number, leaf = p["key"]
        if p["key"] not in read and number < len(calls) and any(map(worth, calls[number].plans)):
            drop.setdefault(number, set()).add(leaf)
    return drop


def all_unread(closed) -> bool:
    """Whether no leaf made zeros in the trace `closed` is read there."""
    return not any(p["dropped"] for p in _surviving(closed))


def names(calls: list) -> list[str]:
    """The leaves the calls dropped, as their aux paths: "aux['logits']"."""
    return [f"aux{call.paths[leaf]}" for call in calls for leaf in sorted(call.dropped) if leaf < len(call.paths)]
