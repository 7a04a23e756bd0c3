"""The user's entry points: `jit`, `optimize` and `explain`."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import threading
import warnings
import weakref
from typing import Any, Callable

import jax
import numpy as np

from xkern import _collector, _compat, pipeline
from xkern.jaxpr_passes import unread
from xkern.jaxpr_passes.patterns import registry
from xkern.jaxpr_passes.rewrite import (Declined, declined_for_output, evaluate, hearing_as_written, ran_as_written,
                                        specs, traffic)
from xkern.kernels.launch import BACKENDS, kernel_names, resolve_backend
from xkern.memory.liveness import peak_live_bytes

# Array leaves are traced; everything else (Python and NumPy scalars included: under jax.jit they
# arrive as such only when they are static) is baked into the trace and keys its cache entry.
_DYNAMIC = (jax.Array, np.ndarray)


@dataclasses.dataclass
class _Traced:
    closed: Any
    out_tree: Any
    dynamic: list  # the array leaves of the arguments, in order
    key: Any  # the signature, or None when the trace must not be reused
    mutated: list  # argument leaves fun set in place (index among the leaves), computed after its outputs
    static_out: dict  # output leaves that are not arrays (a string in jax.grad's aux): position -> value
    unread: list = dataclasses.field(default_factory=list)  # aux leaves left out of the plan (unread.names)


def _trace(fun: Callable, args: tuple, kwargs: dict, backend: str, carry_in_place: bool = True) -> _Traced:
    """The jaxpr of `fun` at these arguments; non-array leaves (strings, None...) are static.
    What `fun` differentiates (a training step's jax.value_and_grad) is optimized before jax
    differentiates it, so its patterns are found in the forward pass it was written as.
    carry_in_place: whether values fun sets on its arguments become outputs (_set_in_place); under
    xkern.jit they go nowhere, as under jax.jit, so fun may also change their structure there."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    # A ShapeDtypeStruct (explain, planning at shapes only, as jax.jit(f).lower takes) is traced as
    # the abstract value it describes.
    dyn_idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (*_DYNAMIC, jax.ShapeDtypeStruct))]
    dynamic = [_canonical(leaves[i]) for i in dyn_idx]
    out_tree, mutated, static_out = [], [], {}
    # fun's own arguments, static leaves as None, for jax to trace: its errors then name them as
    # jax.jit's do (tree['x'], mode), not as flat leaves
    arrays, as_written = dict(zip(dyn_idx, dynamic)), True
    try:
        arrays_args, arrays_kwargs = jax.tree_util.tree_unflatten(treedef, [arrays.get(i) for i in range(len(leaves))])
        again = jax.tree_util.tree_leaves((arrays_args, arrays_kwargs))
        if len(again) != len(dynamic) or any(a is not b for a, b in zip(again, dynamic)):
            raise ValueError("leaves reordered")
    except Exception:  # a pytree node that takes no None, or flattens it otherwise: the leaves, named dyn[i]
        (arrays_args, arrays_kwargs), as_written = (tuple(dynamic), {}), False

    def flat_fun(*dyn):
        full = list(leaves)
        for i, value in zip(dyn_idx, dyn):
            full[i] = value
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        out, tree = jax.tree_util.tree_flatten(fun(*a, **k))
        out_tree.append(tree)
        static_out.update({n: v for n, v in enumerate(out) if not isinstance(v, _DYNAMIC)})
        if carry_in_place:
            after = _set_in_place(fun, treedef, full, (a, k))
        else:
            after = {}
            _warn_if_set_in_place(fun, full, (a, k), out)
        mutated.extend(after)
        return [v for n, v in enumerate(out) if n not in static_out] + list(after.values())

    def trace(drop: dict):
        del out_tree[:], mutated[:]
        static_out.clear()
        with (_compat.wrapping_differentiated(functools.partial(_before_differentiation, backend=backend)),
              unread.tracing(drop) as calls):
            # (a new function each time: jax caches a trace per function; named as fun, so that
            # jax's errors while tracing name the user's function and its line)
            traced = _named_as(fun, lambda *a, **k: flat_fun(*jax.tree_util.tree_leaves((a, k))),
                               same_parameters=as_written)
            return jax.make_jaxpr(traced)(*arrays_args, **arrays_kwargs), calls

    closed, calls = trace({})
    drop = unread.unread(closed, calls, declined_for_output) if backend != "xla" else {}
    dropped = []
    if drop:  # (aux leaves the program drops, which a differentiated function's plan kept: unread.py)
        explained = getattr(_inner_plans, "plans", None)
        first = list(explained or ())
        if explained is not None:
            explained.clear()
        again, calls = trace(drop)  # (the same program: its out_tree and the rest are the first trace's)
        if unread.all_unread(again):
            closed, dropped = again, unread.names(calls)
        elif explained is not None:
            explained[:] = first
    # (the type too: 1, 1.0, True and np.int32(1) are equal keys, but trace to different dtypes)
    static = tuple((i, type(leaf), leaf) for i, leaf in enumerate(leaves) if i not in set(dyn_idx))
    key = (treedef, static, tuple((tuple(np.shape(d)), jax.numpy.result_type(d),
                                   getattr(jax.typeof(d), "weak_type", False)) for d in dynamic))
    try:
        hash(key)
    except TypeError:
        key = None
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        key = None  # closes over an outer trace's values: valid for this trace only
    return _Traced(closed, out_tree[0], dynamic, key, mutated, static_out, dropped)


def _named_as(fun: Callable, traced: Callable, same_parameters: bool = False) -> Callable:
    """`traced` (fun, or fun over its array leaves) with fun's name, module and source line, so that
    jax's errors while tracing name the user's function, not xkern's wrapper; and its signature
    where its parameters are fun's (same_parameters), so that they name the argument too."""
    try:
        traced.__name__, traced.__qualname__ = fun.__name__, fun.__qualname__
        traced.__module__ = fun.__module__
        traced.__code__ = traced.__code__.replace(co_filename=fun.__code__.co_filename,
                                                  co_firstlineno=fun.__code__.co_firstlineno, co_name=fun.__name__)
        if same_parameters:
            traced.__signature__ = inspect.signature(fun)
    except (AttributeError, TypeError, ValueError):  # a callable object, a partial, a builtin: as it was
        pass
    return traced


def _canonical(leaf):
    """A NumPy array in the dtype jax would make of it (float64 -> float32 unless jax_enable_x64), as
    the program is traced and its kernels launched at that dtype (eager `optimize` gets such arrays)."""
    if isinstance(leaf, np.ndarray):
        return np.asarray(leaf, jax.dtypes.canonicalize_dtype(leaf.dtype))
    return leaf


def _set_in_place(fun: Callable, treedef, before: list, arguments) -> dict:
    """The argument leaves `fun` set in place (Flax NNX modules, an optimizer's state: objects with
    reference semantics), index -> new value. They become outputs of the traced program too, and
    are set on the caller's objects after the run (_apply_mutations), as if fun had run there."""
    after, after_tree = jax.tree_util.tree_flatten(arguments)
    if after_tree != treedef:
        raise TypeError(f"xkern: {getattr(fun, '__name__', 'fun')} changed the structure of its arguments "
                        "in place (added or removed a leaf); xkern can carry values set in place, not new "
                        "structure: return the changed object instead")
    return {i: new for i, (old, new) in enumerate(zip(before, after)) if new is not old}


def _apply_mutations(args: tuple, kwargs: dict, mutated: list, values: list) -> None:
    """Set each argument leaf fun updated in place (by index among the leaves) on the caller's
    objects, through its path: attributes (an NNX Variable's value) and items of dicts and lists."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
    for i, value in zip(mutated, values):
        *parents, last = paths[i]
        node = (args, kwargs)
        for key in parents:
            node = _child(node, key)
        if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "value" and hasattr(node, "set_value"):
            node.set_value(value)  # a Flax NNX Variable (its .value setter is deprecated)
        elif isinstance(last, jax.tree_util.GetAttrKey):
            setattr(node, last.name, value)
        elif isinstance(last, (jax.tree_util.DictKey, jax.tree_util.SequenceKey)) and not isinstance(node, tuple):
            node[last.key if isinstance(last, jax.tree_util.DictKey) else last.idx] = value
        else:
            raise TypeError(f"xkern: the function set an argument leaf in place at {jax.tree_util.keystr(paths[i])}, "
                            "which xkern cannot set on the caller's object; return it instead")


def _child(node, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    raise TypeError(f"xkern: cannot follow {key!r} into an argument to set a value the function changed in place")


# Plans made for the functions a program differentiates, while `explain` traces it (None otherwise).
_inner_plans = threading.local()


def _before_differentiation(fun: Callable, has_aux: bool, backend: str | None) -> Callable:
    """A function the traced program hands to jax.grad / value_and_grad / vjp, optimized first:
    after differentiation the forward's intermediates feed the backward pass, so no pattern could be
    taken there; before it, each op's backward kernel is what gets differentiated. has_aux: fun
    returns (out, aux); aux leaves the program drops are dropped from the plan too (unread.py)."""
    _check_args("optimize", fun, backend)
    optimized = lambda f, on_plan: _optimized(f, backend, carry_in_place=True, on_plan=on_plan)
    return unread.marking(fun, optimized) if has_aux else optimized(fun, None)


def _check_args(api: str, fun, backend) -> None:
    if not callable(fun):
        raise TypeError(f"xkern.{api}: fun must be callable; got {type(fun).__name__}")
    if backend is not None and backend not in BACKENDS:
        platform = "" if backend not in ("cpu", "gpu", "cuda", "rocm", "tpu") else (
            " (xkern's backend is the kernels'; jax.jit's platform argument is not taken: place arrays with "
            "jax.device_put or jax.default_device)")
        raise ValueError(f"xkern.{api}: backend must be one of {', '.join(BACKENDS)} or None; "
                         f"got {backend!r}{platform}")


def optimize(fun: Callable | None = None, *, backend: str | None = None):
    """Rewrite `fun`'s program with xkern's kernels each time it is traced or called.

    Composes with jax.jit, jax.grad / value_and_grad (gradients run through each op's backward
    kernels), jax.vmap, lax.scan bodies and Flax modules (with Flax NNX, nnx.jit(optimize(step)):
    values `fun` sets on its arguments in place are set on the caller's objects). Results equal
    `fun`'s within the dtype's tolerance; what xkern cannot handle is left to XLA (see `explain`).
    """
    if fun is None:
        return functools.partial(optimize, backend=backend)
    _check_args("optimize", fun, backend)
    return _optimized(fun, backend, carry_in_place=True)


def _optimized(fun: Callable, backend: str | None, carry_in_place: bool, on_plan=None) -> Callable:
    """on_plan(plan): told of the plan each call runs."""
    plans: dict = {}  # signature -> [(the program as traced, its plan)], the latest last

    @functools.wraps(fun)
    def optimized(*args, **kwargs):
        chosen = resolve_backend(backend)
        with _collector.paused():
            traced = _trace(fun, args, kwargs, chosen, carry_in_place)
            plan = _cached_plan(plans, traced, chosen)
            if getattr(_inner_plans, "plans", None) is not None:
                _inner_plans.plans.append(plan)
            if on_plan is not None:
                on_plan(plan)
            outs = evaluate(plan, _weak_cotangents(traced.dynamic), chosen)
        n_out = len(outs) - len(traced.mutated)
        if traced.mutated:
            _apply_mutations(args, kwargs, traced.mutated, outs[n_out:])
        arrays = iter(outs[:n_out])
        leaves = [traced.static_out[n] if n in traced.static_out else next(arrays)
                  for n in range(traced.out_tree.num_leaves)]
        return jax.tree_util.tree_unflatten(traced.out_tree, leaves)

    return optimized


def _weak_cotangents(values: list) -> list:
    """`values`, each weakly typed float tracer (a Python float jax.grad differentiates) cast strong
    and back: the plan drops the program's own such cast (canonicalize), whose transpose is what
    gives jax.grad's result the argument's weak type. XLA removes the casts."""
    def through_strong(x):
        aval = jax.typeof(x)
        if not (isinstance(x, jax.core.Tracer) and getattr(aval, "weak_type", False)
                and jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)):
            return x
        return _compat.typed_as(_compat.typed_as(x, aval.update(weak_type=False)), aval)
    return [through_strong(x) for x in values]


PLANS_PER_SIGNATURE = 8
SIGNATURES_KEPT = 64  # (eager calls with a new Python scalar each time make a new signature each)


def _cached_plan(plans: dict, traced: _Traced, backend: str):
    """The plan made for a program equal to `traced`'s, or a new one (kept for next time). Equal: the
    same signature, the same jaxpr (a function reading Python state may trace another program at the
    same arguments) and the same constants (arrays it closes over: weights swapped on a model, a
    global changed), as the plan was made from their values. A plan holds its constants, so a new
    one for the same jaxpr replaces the old (swapped-out weights are not kept alive)."""
    if traced.key is None:
        return pipeline.plan(traced.closed, backend)
    text = str(traced.closed.jaxpr)
    if (traced.key, backend) not in plans and len(plans) >= SIGNATURES_KEPT:
        del plans[next(iter(plans))]  # the oldest signature's
    entries = plans.setdefault((traced.key, backend), [])
    for entry_text, consts, plan in entries:
        if entry_text == text and _same_constants(consts, traced.closed.consts):
            return plan
    plan = pipeline.plan(traced.closed, backend)
    entries[:] = [e for e in entries if e[0] != text][-(PLANS_PER_SIGNATURE - 1):]
    entries.append((text, [_kept(c) for c in traced.closed.consts], plan))
    return plan


COMPARED_ELEMENTS = 1 << 24  # (a causal mask of 4096 x 4096)


def _kept(const):
    """A constant as the plan's entry keeps it: a numpy array, which can change in place (a global
    mask set anew), as a copy of its values, up to COMPARED_ELEMENTS; a jax array as itself."""
    if isinstance(const, np.ndarray) and const.size <= COMPARED_ELEMENTS:
        return const.copy()
    return const


def _same_constants(old: list, new: list) -> bool:
    """The same arrays, or equal values (a numpy constant is a new array on each trace, or the same one
    changed in place); a large one not the same array counts as changed rather than be compared."""
    return len(old) == len(new) and all(map(_same_constant, old, new))


def _same_constant(kept, new) -> bool:
    if kept is new:  # a jax array (immutable), or a numpy one too large to have been copied
        return True
    return (np.shape(kept) == np.shape(new) and np.size(new) <= COMPARED_ELEMENTS
            and jax.numpy.result_type(kept) == jax.numpy.result_type(new)
            and bool(np.array_equal(np.asarray(kept), np.asarray(new), equal_nan=True)))


def _warn_if_set_in_place(fun: Callable, before: list, arguments, outs: list) -> None:
    """Under xkern.jit, as under jax.jit, values fun sets on its arguments go nowhere: say so, unless
    fun returns them too (a functional NNX step, merge then return nnx.state(model))."""
    returned = {id(leaf) for leaf in outs}
    if any(new is not old and id(new) not in returned
           for old, new in zip(before, jax.tree_util.tree_leaves(arguments))):
        warnings.warn(f"xkern.jit: {getattr(fun, '__name__', 'fun')} set values on its arguments in place "
                      "(as Flax NNX's optimizer.update does); like jax.jit, xkern.jit returns them nowhere "
                      "and the caller's objects keep their old values: use nnx.jit(xkern.optimize(fun)), "
                      "or return what changed", stacklevel=2)


def jit(fun: Callable | None = None, *, backend: str | None = None, **jit_kwargs):
    """A drop-in for `jax.jit` that rewrites the program with xkern's kernels before XLA sees it.

    Every other keyword (static_argnums / static_argnames, donate_argnums / donate_argnames,
    keep_unused, in_shardings, ...) is jax.jit's, passed to it unchanged; the result is jax.jit's
    (`.lower()`, `.trace()` and the rest work as there)."""
    if fun is None:
        return functools.partial(jit, backend=backend, **jit_kwargs)
    _check_args("jit", fun, backend)
    jitted = jax.jit(_jit_wrapper(fun, backend), **jit_kwargs)
    jitted.__dict__.update(getattr(fun, "__dict__", {}))  # fun's attributes, as jax.jit's wrapper has
    jitted.__wrapped__ = fun  # as jax.jit's; it also keeps fun alive, which its wrapper holds weakly
    return jitted


# xkern.jit(f) made again for the same f (in a loop, as jax.jit allows) reuses f's wrapper, so that
# jax.jit's caches, keyed on the function, hit: nothing is traced, planned or compiled again. The
# wrapper holds f weakly (from this cache a strong reference would keep every f alive forever).
_JIT_WRAPPERS = weakref.WeakKeyDictionary()  # f -> {backend: (weak refs to f and its equals, wrapper)}


def _jit_wrapper(fun: Callable, backend: str | None) -> Callable:
    """What xkern.jit hands jax.jit: `fun` optimized, its in-place updates left in its trace (under
    jax.jit they go nowhere; _warn_if_set_in_place). One per (fun, backend) where fun can be cached."""
    try:
        per_fun = _JIT_WRAPPERS.setdefault(fun, {})
        signature = inspect.signature(fun)  # (jax.jit reads it for static_argnames)
    except (TypeError, ValueError):  # not weakly referenceable, unhashable, or no signature
        return _optimized(fun, backend, carry_in_place=False)
    if backend not in per_fun:
        refs = []
        per_fun[backend] = (refs, _optimized(_weakly(refs, fun, signature), backend, carry_in_place=False))
    refs, wrapper = per_fun[backend]
    # An equal callable (the same bound method fetched again) shares the wrapper; each xkern.jit
    # keeps its own alive, and the wrapper calls whichever still lives.
    refs[:] = [r for r in refs if r() is not None and r() is not fun] + [weakref.ref(fun)]
    return wrapper


def _weakly(refs: list, fun: Callable, signature) -> Callable:
    """The latest live callable of `refs` (weak references to callables equal to fun), called;
    named, documented and signed as fun."""
    def call(*args, **kwargs):
        live = next(f for f in (r() for r in reversed(refs)) if f is not None)
        return live(*args, **kwargs)
    functools.update_wrapper(call, fun, updated=())  # (not fun's __dict__: references of its own)
    del call.__wrapped__  # (a strong reference)
    _named_as(fun, call)  # (jax.jit's messages: fun's source line)
    call.__signature__ = signature
    return call


# --------------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Replaced:
    pattern: str  # the pattern's name, or "generated/N ops" for a fusion group
    op: str
    location: str
    kernels: list[str]
    params: dict
    source: str | None = None  # a generated kernel's Triton source


@dataclasses.dataclass
class Report:
    """What xkern does to a program: printable, and data."""
    backend: str
    kernels: list[str]  # every kernel the rewritten program launches, in program order
    matches: list[Replaced]
    declined: list[Declined]
    bytes_before: int  # estimated, the matched regions as unfused equations
    bytes_after: int  # estimated, the kernels that replace them (each input read, output written)
    peak_before: int = 0  # estimated peak live bytes, equation by equation (xkern/memory)
    peak_after: int = 0  # the same for the rewritten program (in-place kernels reuse their inputs)
    in_place: int = 0  # kernels writing an output over an input that dies there
    unread: list = dataclasses.field(default_factory=list)  # aux outputs left out, never read ("aux['logits']")

    def __str__(self) -> str:
        lines = [f"xkern on backend {self.backend!r}: {len(self.matches)} rewrite(s), "
                 f"{len(self.declined)} declined; kernels launched: {self.kernels or 'none'}"]
        for m in self.matches:
            # (under jax.grad a group computing only the loss's value is planned, but never runs)
            unused = " (not launched: the program needs none of its outputs, or they are empty)" if m.kernels and \
                not set(m.kernels) & set(self.kernels) else ""
            lines.append(f"  fused    {m.pattern:42} at {m.location} -> {', '.join(m.kernels)}{unused}")
        generated = [d for d in self.declined if d.pattern.startswith("generated/")]
        for d in self.declined if len(generated) <= 8 else [d for d in self.declined
                                                             if d not in generated]:
            lines.append(f"  declined {d.pattern:42} at {d.location}: {d.reason}")
        if len(generated) > 8:  # a big program has many small groups: summarize them by reason
            reasons: dict = {}
            for d in generated:
                key = d.reason.split(";")[0].split(":")[0]
                reasons[key] = reasons.get(key, 0) + 1
            for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
                lines.append(f"  declined {n} generated group(s): {reason} (report.declined has each)")
        if self.unread:
            lines.append(f"  left out {', '.join(self.unread)}: the aux of a differentiated function, which the "
                         "program never reads (not computed: what computes it may be fused)")
        if self.matches:
            lines.append(f"  estimated bytes moved by the rewritten regions: "
                         f"{_mib(self.bytes_before)} unfused -> {_mib(self.bytes_after)} as kernels")
            lines.append(f"  estimated peak live memory, equation by equation: {_mib(self.peak_before)} -> "
                         f"{_mib(self.peak_after)} ({self.in_place} kernel(s) writing over an input that dies there)")
        if self.backend == "xla":
            lines.append("  (backend 'xla': nothing is rewritten)")
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _decisions(inner: list, plan, backend: str, as_written: list, launched: list) -> tuple[list, list]:
    """(Replaced, Declined) of the differentiated functions' plans (`inner`) and the program's;
    as_written: the decisions heard (rewrite.hearing_as_written): one a call ran as written is declined
    for its reason. launched: the kernels the program launches (a matmul group differentiated runs
    its variant that also writes the product)."""
    # A candidate a differentiated function's plan already decided (taken, or declined with its
    # reason) is seen again, differentiated, in the whole program (often as a smaller spelling, a
    # line away, in the same function): say it once.
    site = lambda pattern, location: (pattern.split("/")[0], re.sub(r":\d+(:\d+)? ", " ", location))
    decided = {site(d.pattern, d.location) for top in inner for p in top.walk() for d in p.declined} | {
        site(r.match.pattern.name, r.location) for top in inner for p in top.walk() for r in p.rewrites.values()}
    outer = {id(p) for p in plan.walk()}
    matches, declined = [], []
    for p in (q for top in (*inner, plan) for q in top.walk()):
        declined += [d for d in p.declined if id(p) not in outer or site(d.pattern, d.location) not in decided]
        for r in p.rewrites.values():
            reason = ran_as_written(as_written, r)
            if reason is not None:
                declined.append(Declined(r.pattern, r.location, reason, r.match.anchor))
                continue
            reads, (_, residual) = r.reads(), r.inputs()

            def replace(*values, r=r, reads=reads, residual=residual):
                read = dict(zip(reads, values)).__getitem__
                kw = {} if residual is None else {"residual": read(residual)}
                return r.match.pattern.replace(*r.arguments(read), backend=backend, **r.params, **kw)
            replaced = jax.make_jaxpr(replace)(*specs([v.aval for v in reads]))
            matches.append(Replaced(r.pattern, r.match.pattern.op, r.location, kernel_names(replaced), r.params))
        role = f" ({p.role}, in the backward pass)" if p.role else ""
        for f in p.fusions.values():
            ran = f.fused.with_product if f.fused.k and f.fused.name not in launched and \
                f.fused.with_product.name in launched else f.fused
            matches.append(Replaced(f"generated/{len(f.fused.eqns)} ops{role}", "fused", f.location,
                                    [ran.name], {}, ran.source))
    return matches, declined


def explain(fun: Callable, *, backend: str | None = None, static_argnums: int | tuple = (),
            static_argnames: str | tuple = ()):
    """`explain(fun)(*args)`: a Report of what xkern.jit / optimize would do to `fun` at these args.
    static_argnums / static_argnames: as xkern.jit's (jax.jit's); a function jitted already keeps
    its own."""
    _check_args("explain", fun, backend)
    nums = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)
    names = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
    if not all(isinstance(n, int) for n in nums) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"xkern.explain: static_argnums must be ints and static_argnames strings, as "
                        f"jax.jit's; got {static_argnums!r} and {static_argnames!r}")
    try:  # (a name of a parameter passed by position, as jax.jit reads static_argnames)
        positional = [p.name for p in inspect.signature(fun).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        nums |= {positional.index(name) for name in names if name in positional}
    except (TypeError, ValueError):
        pass
    jitted = hasattr(fun, "lower") and hasattr(fun, "trace")  # (it decides what its arguments are)

    def as_jit_traces(value, static: bool):
        """Python numbers traced as xkern.jit's jax.jit traces them (weakly typed), not baked in."""
        if static or jitted:
            return value
        return jax.tree.map(lambda a: jax.numpy.asarray(a) if type(a) in (int, float, complex) else a, value)

    def report(*args, **kwargs) -> Report:
        chosen = resolve_backend(backend)
        n = len(args)
        args = tuple(as_jit_traces(a, i in nums or i - n in nums) for i, a in enumerate(args))
        kwargs = {k: as_jit_traces(v, k in names) for k, v in kwargs.items()}
        _inner_plans.plans = inner = []
        # (as_written: the rewrites a call runs as written, Pattern.xla_when)
        with _collector.paused(), hearing_as_written() as as_written:
            try:
                traced = _trace(fun, args, kwargs, chosen)
            finally:
                _inner_plans.plans = None
            plan = pipeline.plan(traced.closed, chosen)
            rewritten = jax.make_jaxpr(lambda *d: evaluate(plan, d, chosen))(*traced.dynamic)
        launched = kernel_names(rewritten)
        matches, declined = _decisions(inner, plan, chosen, as_written, launched)
        # (a matmul epilogue's derivative is planned with it, but runs only if the program differentiates)
        matches = [m for m in matches if "in the backward pass" not in m.pattern or set(m.kernels) <= set(launched)]
        before, after = map(sum, zip(*(traffic(p) for p in (*inner, plan))))
        in_place = sum(bool(f.aliases) for top in (*inner, plan) for p in top.walk() for f in p.fusions.values())
        return Report(chosen, launched, matches, declined, before, after, peak_live_bytes(traced.closed),
                      peak_live_bytes(rewritten), in_place, traced.unread)
    return report


def patterns() -> list[str]:
    """The names of every registered pattern (duplicates rejected at registration are left out)."""
    rejected = {name for name, _ in registry().rejected}
    return [p.name for p in registry().patterns if p.name not in rejected]
