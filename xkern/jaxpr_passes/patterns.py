"""The pattern language: a pattern is an ordinary JAX function, traced to a jaxpr and matched
structurally against the program.

Matching is two-step, so that one pattern serves every shape, axis and dtype:
  1. structural: from an anchor equation (the one producing the pattern's output), walk the template
     and the program backwards together, comparing primitives and operand wiring but not params or
     literal values (reduction axes, broadcast shapes, a mean's 1/n and an eps differ from the
     example the template was traced at);
  2. exact: read the pattern's params off the match (e.g. the softmax axis), trace the pattern again on
     the matched inputs' real shapes and dtypes, and require the program to equal that trace equation
     for equation, params included.
So a rewrite only happens where the program computes exactly what the pattern function computes.

Rules files (`*_rules.py` beside this one) list their patterns in `PATTERNS`; they are loaded the
first time a program is matched, so `import xkern` stays cheap.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import pkgutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from xkern import _collector, _compat
from xkern.jaxpr_passes import template_cache
from xkern.jaxpr_passes.canonicalize import canonicalize, dce
from xkern.jaxpr_passes.graph import Graph, as_literal, same_literal, unmarked


@dataclasses.dataclass(frozen=True, eq=False)
class Pattern:
    """A named way of writing an op, and what replaces it.

    fn(*inputs, **params): the pattern itself, an ordinary JAX function with one output.
    example(dtype): example input avals to trace the template at, for each dtype in `dtypes`.
    params_of(match): the params at a match, read off the matched equations (e.g. the axis).
    replace(*inputs, backend, **params): the replacement; must equal fn(*inputs, **params).
    (With folds_residual_add, replace(x, *rest, residual=r, ...) returns (fn(x + r, *rest), x + r).)
    check(match, params): a reason to decline this match (dtype, shape), or None.
    facts_of(match): more params for check and replace only (not fn): what the program shows about
    the matched inputs, such as the kind of a mask it computes from constants.
    ignores(params): indices of inputs the replacement does not read at these params (it gets None
    for them, and what only they needed is dead).
    constants: how many array constants the pattern closes over (jax.nn's window builds its
    positions with jnp.array(range(n))): they become the template's last inputs, matched to the
    program's constants, whose values the exact step then compares with the re-trace's.
    """
    name: str
    op: str
    fn: Callable
    example: Callable[[Any], tuple]
    dtypes: tuple
    params_of: Callable[["Match"], dict]
    replace: Callable
    check: Callable[["Match", dict], str | None] = lambda match, params: None
    facts_of: Callable[["Match"], dict] = lambda match: {}
    ignores: Callable[[dict], set] = lambda params: set()
    example_params: dict = dataclasses.field(default_factory=dict)
    # The first input may be a sum x + r made just before: then replace(x, ..., residual=r) also
    # returns x + r, and the add is folded into the kernel (a norm after a residual connection).
    folds_residual_add: bool = False
    constants: int = 0
    # Primitives a program must hold for the pattern to be tried (and its template traced, on first
    # need): a large family of patterns no program without them can match costs no start-up time.
    requires: frozenset = frozenset()
    # The name of a smaller pattern this one is built around (a row loss inside an LM head's loss):
    # traced only for programs where that one is found, so a family built around many small
    # patterns costs start-up time only for the few a program holds.
    extends: str | None = None
    # split_dims(i, ndim, params): the dims of input i (of ndim dims) that its kernels split across
    # devices (kernels/partition.py) at these params, in a program that shards them: where the
    # program constrains another dim to be sharded, the match is left to XLA
    # (rewrite.unsplit_sharding). A list of sets: the kernels split the dims of any one of them,
    # not of two. None: the leading dim only.
    split_dims: Callable[[int, int, dict], set | list] | None = None
    # xla_when(perturbed, params): why a call runs the matched equations themselves (jax.jit's
    # program) rather than the replacement, or None; perturbed: whether each input is differentiated
    # (rewrite._per_differentiation; all False where the call is not differentiated). Only where the
    # replacement ignores no input at these params. None: always the replacement.
    xla_when: Callable[[list[bool], dict], str | None] | None = None
    # substitutes(match, params): {input index: (program value, adapt)}: the replacement reads
    # adapt(that value) for the input instead, where the matched input is computed from a smaller
    # one (attention's k and v repeated over the heads: the kernels read the k/v heads as GQA), or
    # {input index: ((values...), adapt)}, adapt taking their tuple, where it is made of several
    # (a position bias plus a padding bias: the kernels take a bias and a mask). A call that runs
    # as written (xla_when) reads the matched input itself.
    substitutes: Callable[["Match", dict], dict] | None = None
    # provides(match): {program value inside the match: the name of a value the replacement can also
    # give, equal to it} (replace(..., provide=True) returns (out, {name: value}): a loss's rows'
    # logsumexp, its sum before a division). An intermediate read outside the match is then no
    # escape where it is one of them, or is computed from them (and the inputs) by elementwise and
    # shape equations: those stay in the program and run after the replacement, reading its values
    # (MaxText's z-loss and summed loss, returned for its metrics).
    provides: Callable[["Match"], dict] | None = None


@dataclasses.dataclass
class Match:
    pattern: Pattern
    graph: Graph
    anchor: int  # program equation producing the pattern's output
    eqns: dict[int, int]  # template equation index -> program equation index
    inputs: list  # program vars bound to the pattern's inputs, in order
    template: Jaxpr
    marks: frozenset = frozenset()  # pvary equations between matched ones (inside shard_map)
    shared: frozenset = frozenset()  # matched equations left in the program for other users (rewrite.py)
    provided: dict = dataclasses.field(default_factory=dict)  # program value -> name (Pattern.provides)

    def eqn(self, primitive: str, nth: int = 0):
        """The program equation matched to the template's nth `primitive` equation."""
        hits = [i for i, e in enumerate(self.template.eqns) if e.primitive.name == primitive]
        return self.graph.eqns[self.eqns[hits[nth]]]

    @property
    def input_avals(self) -> list:
        return [v.aval for v in self.inputs]

    @property
    def program_eqns(self) -> set[int]:
        return set(self.eqns.values()) | self.marks


# --------------------------------------------------------------------------------------------------
# Structural matching
# --------------------------------------------------------------------------------------------------

# Binary primitives whose operands may come in either order (exactly: IEEE add and mul commute).
COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})


def _same_params(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_same_param(a[k], b[k]) or (k in _SHARDING_PARAMS and _unconstrained(a[k]) and
                                           _unconstrained(b[k])) for k in a)


_SHARDING_PARAMS = ("sharding", "out_sharding")


def _unconstrained(sharding) -> bool:
    """A sharding param that asks for nothing: None, or a mesh's sharding that splits no dim (jax
    writes those on broadcasts and iotas when tracing over arrays sharded across devices; the
    templates are traced without)."""
    spec = getattr(sharding, "spec", None)
    return sharding is None or (spec is not None and all(s is None for s in spec))


def _same_param(a, b) -> bool:
    if isinstance(a, (ClosedJaxpr, Jaxpr)) and isinstance(b, (ClosedJaxpr, Jaxpr)):
        return same_jaxpr(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_param(x, y) for x, y in zip(a, b))
    if callable(a) and callable(b):
        return True  # traced callables (custom_jvp rules, thunks) differ per trace
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN params (take_along_axis's fill_value) equal themselves
    try:
        return bool(a == b)
    except Exception:  # arrays and other values without a plain ==
        return a is b


_TEMPLATE_GRAPHS: dict[int, tuple] = {}


def _template_graph(template: Jaxpr) -> Graph:
    """The graph of a template, built once: the matcher tries every template at every anchor."""
    entry = _TEMPLATE_GRAPHS.get(id(template))
    if entry is None or entry[0] is not template:
        if len(_TEMPLATE_GRAPHS) > 4096:  # exact re-traces and sub-jaxprs pass through here too
            _TEMPLATE_GRAPHS.clear()
        entry = _TEMPLATE_GRAPHS[id(template)] = (template, Graph(template))  # keeps it alive
    return entry[1]


def _operand_kinds(graph: Graph, eqn: int) -> tuple[str, ...]:
    """Where each operand of equation `eqn` comes from: "literal", "input" (no producer: the
    jaxpr's inputs and constants) or the producing primitive. Cached on the graph: every template
    anchored at a primitive asks at each of its equations."""
    kinds = graph.operand_kinds.get(eqn)
    if kinds is None:
        def kind(v):
            v = unmarked(graph, v)[0]
            return ("literal" if isinstance(v, Literal) else
                    graph.eqns[graph.producer[v][0]].primitive.name if v in graph.producer else "input")
        kinds = graph.operand_kinds[eqn] = tuple(kind(v) for v in graph.eqns[eqn].invars)
    return kinds


def _producer(graph: Graph, v):
    """The equation producing operand `v` (through pvary marks), or None (an input or a literal)."""
    v = unmarked(graph, v)[0]
    return None if isinstance(v, Literal) or v not in graph.producer else graph.producer[v][0]


def _signature(t_graph: Graph, t_eqn: int, depth: int = 2) -> tuple:
    """What the cheap look compares at a template equation: its operands' kinds and, `depth` - 1
    levels up, those of the equations producing them. Cached on the template's graph."""
    key = ("signature", t_eqn, depth)
    sig = t_graph.operands_fit.get(key)
    if sig is None:
        eqn = t_graph.eqns[t_eqn]
        below = [_producer(t_graph, v) for v in eqn.invars] if depth > 1 else []
        sig = t_graph.operands_fit[key] = (eqn.primitive.name, _operand_kinds(t_graph, t_eqn), tuple(
            None if i is None else _signature(t_graph, i, depth - 1) for i in below) or None)
    return sig


def _fits(graph: Graph, eqn: int, sig: tuple) -> bool:
    """Whether program equation `eqn` agrees with a template signature (a template input takes any
    non-literal; commutative operands in either order). Cached: templates share signatures."""
    fit = graph.operands_fit.get((eqn, sig))
    if fit is None:
        name, want, below = sig
        have, operands = _operand_kinds(graph, eqn), graph.eqns[eqn].invars
        fits = lambda w, h: w == h or (w == "input" and h != "literal")
        orders = [(have, operands)] + ([(have[::-1], operands[::-1])] if name in COMMUTATIVE else [])
        fit = graph.operands_fit[(eqn, sig)] = any(
            len(kinds) == len(want) and all(fits(w, h) for w, h in zip(want, kinds)) and
            (below is None or all(b is None or _fits(graph, _producer(graph, v), b) for b, v in zip(below, vars_)))
            for kinds, vars_ in orders)
    return fit


def _operands_agree(t_graph: Graph, t_eqn: int, graph: Graph, eqn: int) -> bool:
    """A cheap first look before unifying: the anchors' operands come from the same primitives, and
    so do those primitives' operands (a template input takes any non-literal). Most anchors of a
    large program fail here."""
    te, pe = t_graph.eqns[t_eqn], graph.eqns[eqn]
    if te.primitive is not pe.primitive or len(te.invars) != len(pe.invars):
        return False
    return _fits(graph, eqn, _signature(t_graph, t_eqn))


_ANCHOR_SIGNATURES: dict[int, tuple] = {}


def anchor_signature(template: Jaxpr):
    """The cheap look's key for a template at its anchor (None: its output is an input), cached:
    the matcher checks each distinct key once per program equation, not each template."""
    entry = _ANCHOR_SIGNATURES.get(id(template))
    if entry is None or entry[0] is not template:
        t_graph = _template_graph(template)
        t_out = template.outvars[0]
        sig = None
        if t_out in t_graph.producer:
            anchor = t_graph.producer[t_out][0]
            sig = (len(t_graph.eqns[anchor].invars), _signature(t_graph, anchor))
        entry = _ANCHOR_SIGNATURES[id(template)] = (template, sig)
    return entry[1]


def anchor_fits(graph: Graph, eqn: int, sig) -> bool:
    """Whether a template with anchor signature `sig` can match at program equation `eqn` (whose
    primitive is the template anchor's)."""
    return sig is not None and len(graph.eqns[eqn].invars) == sig[0] and _fits(graph, eqn, sig[1])


def unify(template: Jaxpr, graph: Graph, anchor: int, strict: bool) -> Match | None:
    """Match `template` (one output) against the program, its output at equation `anchor`."""
    t_out = template.outvars[0]
    t_graph = _template_graph(template)
    if t_out not in t_graph.producer or not _operands_agree(t_graph, t_graph.producer[t_out][0], graph,
                                                             anchor):
        return None
    t_inputs = list(template.invars)
    binding: dict = {}
    eqn_map: dict[int, int] = {}
    marks: set[int] = set()  # the program's pvary equations matched through (see graph.unmarked)

    def match(tv, pv) -> bool:
        if tv not in t_inputs:  # a template input binds the program's value as it is
            pv, passed = unmarked(graph, pv)
            marks.update(passed)
        if isinstance(tv, Literal):
            # Structurally any scalar literal will do: literals are often sizes (a mean divides by
            # the row length; take_along_axis wraps negative indices by adding it) or params (a
            # norm's eps), which the pattern's params_of reads off the match; the exact re-trace
            # then checks every value.
            return isinstance(pv, Literal) and (not strict or (
                same_literal(tv, pv) and tv.aval.dtype == pv.aval.dtype))
        if isinstance(pv, Literal):
            return False
        if strict and (tv.aval.shape, tv.aval.dtype) != (pv.aval.shape, pv.aval.dtype):
            return False
        if tv in binding or tv in t_inputs:
            if tv in binding:
                return binding[tv] is pv
            binding[tv] = pv
            return True
        ti, tk = t_graph.producer[tv]
        if pv not in graph.producer:
            return False
        pi, pk = graph.producer[pv]
        if ti in eqn_map:
            return eqn_map[ti] == pi and tk == pk
        te, pe = t_graph.eqns[ti], graph.eqns[pi]
        if (te.primitive is not pe.primitive or tk != pk or len(te.invars) != len(pe.invars)
                or len(te.outvars) != len(pe.outvars)):
            return False
        if strict and not _same_params(te.params, pe.params):
            return False
        eqn_map[ti] = pi
        binding[tv] = pv
        if te.primitive.name not in COMMUTATIVE:
            return all(match(a, b) for a, b in zip(te.invars, pe.invars))
        # `scale * x` is `x * scale`: try the program's operands in both orders (undoing the
        # bindings of a failed first try; the choice is local, which suffices for small patterns).
        saved = dict(binding), dict(eqn_map), set(marks)
        for operands in (pe.invars, pe.invars[::-1]):
            if all(match(a, b) for a, b in zip(te.invars, operands)):
                return True
            binding.clear(), eqn_map.clear(), marks.clear()
            binding.update(saved[0]), eqn_map.update(saved[1]), marks.update(saved[2])
        return False

    p_out = graph.eqns[anchor].outvars
    if len(p_out) != 1 or not match(t_out, p_out[0]):
        return None
    if len(eqn_map) != len(t_graph.eqns) or any(v not in binding for v in t_inputs):
        return None
    return Match(None, graph, anchor, eqn_map, [binding[v] for v in t_inputs], template, frozenset(marks))


def literal_at(match: Match, example_value: float) -> float:
    """The program's literal where the template has the scalar `example_value` (a param the pattern
    was traced with, e.g. an eps or a scale: pick a distinctive example, matched within 1%, as the
    template may hold it rounded to a half-precision dtype)."""
    found = literals_at(match, example_value)
    if not found:
        raise ValueError(f"no literal like {example_value} in the matched program")
    return found[0]


def soft_cap_at(match: Match, example_value: float) -> float:
    """A soft cap's value, tanh(x / c) * c: the program's literal where the template divides and
    multiplies by `example_value`; NaN where the program's two differ (not a soft cap: the pattern's
    check declines it)."""
    caps = literals_at(match, example_value)
    return caps[0] if len(set(caps)) == 1 else float("nan")


def logsumexps_in(match: Match) -> dict:
    """The program values matched to the template's jax.nn.logsumexp results, log(sum(exp(x - m))) + m
    with m the rows' stopped max (broadcast or not): each row's logsumexp of what it reads, named
    "logsumexp"."""
    made_by = {v: e for e in match.template.eqns for v in e.outvars}
    producer = lambda v: None if isinstance(v, Literal) or v not in made_by else made_by[v].primitive.name
    found = []
    for ti, eqn in enumerate(match.template.eqns):
        shift = next((v for v in eqn.invars if producer(v) != "log"), None)
        if producer(shift) == "broadcast_in_dim":
            shift = made_by[shift].invars[0]
        if eqn.primitive.name == "add" and "log" in map(producer, eqn.invars) and producer(shift) == "stop_gradient":
            found.append(match.graph.eqns[match.eqns[ti]].outvars[0])
    return dict.fromkeys(found, "logsumexp")


def literals_at(match: Match, example_value: float) -> list[float]:
    """Every literal of the program where the template has `example_value`, in template order: a
    param the template uses twice (a soft cap divides and multiplies) must be the same number in both
    places, which matching alone does not check (any literal matches any)."""
    found = []
    for ti, eqn in enumerate(match.template.eqns):
        for i, v in enumerate(eqn.invars):
            value = getattr(v, "val", None)
            if value is not None and np.ndim(value) == 0 and np.isclose(float(value), example_value,
                                                                        rtol=1e-2):
                operands = match.graph.eqns[match.eqns[ti]].invars
                if eqn.primitive.name in COMMUTATIVE and as_literal(match.graph, operands[i]) is None:
                    operands = operands[::-1]  # matched the other way round (2 * x for x * 2)
                found.append(float(as_literal(match.graph, operands[i]).val))
    return found


def same_jaxpr(a, b) -> bool:
    """Whether two single-output jaxprs compute the same thing, equation for equation."""
    a, b = getattr(a, "jaxpr", a), getattr(b, "jaxpr", b)
    if len(a.eqns) != len(b.eqns) or len(a.outvars) != 1 or len(b.outvars) != 1 or not b.eqns:
        return len(a.eqns) == len(b.eqns) == 0 and a.outvars == b.outvars
    graph = _template_graph(b)
    anchor = graph.producer.get(b.outvars[0], (None,))[0]
    m = anchor is not None and unify(a, graph, anchor, strict=True)
    return bool(m) and m.inputs == list(b.invars)


# --------------------------------------------------------------------------------------------------
# Templates and the registry
# --------------------------------------------------------------------------------------------------

def trace(pattern: Pattern, avals, params: dict) -> Jaxpr:
    """The canonical jaxpr of `pattern.fn` at these input avals and params, its constants (as many
    as pattern.constants) lifted into its last inputs (see template_constants)."""
    closed = jax.make_jaxpr(functools.partial(pattern.fn, **params))(*avals)
    closed = dce(canonicalize(closed))
    if len(closed.consts) != pattern.constants:
        raise ValueError(f"pattern {pattern.name} closes over {len(closed.consts)} array constants, not "
                         f"{pattern.constants} (its `constants`); use Python scalars")
    if not closed.consts:
        return closed.jaxpr
    jaxpr = closed.jaxpr.replace(constvars=[], invars=[*closed.jaxpr.invars, *closed.jaxpr.constvars])
    _CONSTANTS[id(jaxpr)] = (jaxpr, [np.asarray(c) for c in closed.consts])
    return jaxpr


_CONSTANTS: dict[int, tuple] = {}  # id -> (template, values): only the few patterns with constants


def template_constants(template: Jaxpr) -> list:
    """The values of the constants `trace` lifted into `template`'s last inputs."""
    entry = _CONSTANTS.get(id(template))
    return list(entry[1]) if entry is not None and entry[0] is template else []


def same_constants(graph: Graph, program_vars, values) -> bool:
    """Whether each program var is a constant of the program holding that value."""
    program_vars = list(program_vars)
    return len(program_vars) == len(values) and all(v in graph.consts and np.shape(graph.consts[v]) == np.shape(value)
               and bool(np.all(np.asarray(graph.consts[v]) == value)) for v, value in zip(program_vars, values))


_trace_cached = functools.lru_cache(maxsize=4096)(
    lambda pattern, avals, params: trace(pattern, avals, dict(params)))


def retrace(pattern: Pattern, avals, params: dict) -> Jaxpr:
    """`trace`, cached per (pattern, input shapes and dtypes, params); under a mesh of Explicit axes
    with the inputs' shardings too (they are in the types, and jax writes them on the broadcasts,
    iotas and reductions it traces from such inputs, as it did in the program)."""
    key = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                if _compat.explicit_mesh([a]) is not None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals)
    return _trace_cached(pattern, key, tuple(sorted(params.items())))


@dataclasses.dataclass
class Registry:
    by_anchor: dict  # anchor primitive name -> [(pattern, template)], largest template first
    patterns: list
    rejected: list  # (pattern name, name of the pattern it duplicates)
    # Families traced on first need, keyed (requires, extends): those a program's primitives allow,
    # and of them those extending a pattern found in the program.
    gated: dict = dataclasses.field(default_factory=dict)  # key -> [patterns]
    built: dict = dataclasses.field(default_factory=dict)  # key -> their Registry, once traced
    merged: dict = dataclasses.field(default_factory=dict)  # frozenset of keys -> by_anchor

    def by_anchor_for(self, primitives, found=frozenset()) -> dict:
        """by_anchor with the gated families whose required primitives all occur in the program and
        whose extended pattern (if any) is among `found`."""
        groups = frozenset(key for key in self.gated if key[0] <= primitives and key[1] in (None, *found))
        if not groups:
            return self.by_anchor
        if groups not in self.merged:
            merged = {anchor: list(entries) for anchor, entries in self.by_anchor.items()}
            for key in sorted(groups, key=lambda k: (sorted(k[0]), k[1] or "")):
                for anchor, entries in self._family(key).by_anchor.items():
                    merged.setdefault(anchor, []).extend(entries)
            for entries in merged.values():
                entries.sort(key=lambda e: -len(e[1].eqns))
            self.merged[groups] = merged
        return self.merged[groups]

    def by_anchor_in(self, graph: Graph, live) -> dict:
        """by_anchor for this program: the families its primitives allow, then those extending a
        pattern that matches in it (structurally, the cheap evidence), and so on while the families
        added extend patterns found in turn (a row loss, its reduction, the reduction scaled)."""
        primitives = frozenset(graph.eqns[i].primitive.name for i in live)
        by_anchor = self.by_anchor_for(primitives)
        extended = {key[1] for key in self.gated if key[1] is not None and key[0] <= primitives}
        found = frozenset()
        while more := found_in(graph, live, by_anchor, extended - found):
            found |= more
            by_anchor = self.by_anchor_for(primitives, found)
        return by_anchor

    def _family(self, key) -> "Registry":
        """The registry of the gated family `key`, built on first need."""
        if key not in self.built:
            self.built[key] = build_registry(self.gated[key])
            self.rejected += self.built[key].rejected
        return self.built[key]

    def build_all(self) -> "Registry":
        """Every pattern, gated or not, in one registry (to check them all together, e.g. for
        duplicates): every family's registry as programs get it (traced once, or loaded from the
        disk cache), merged, with a template that two families share rejected as in one."""
        with _collector.paused():
            families = [self] + [self._family(key) for key in self.gated]
            kept, rejected, by_anchor = {}, list(self.rejected), {}  # (self.rejected: the families' too)
            for family in families:
                fresh = []
                for anchor, (pattern, t) in ((a, e) for a, entries in family.by_anchor.items() for e in entries):
                    twin = next((p for p, other in kept.get(_primitive_counts(t), ()) if same_jaxpr(t, other)), None)
                    if twin is None:
                        fresh.append((anchor, pattern, t))
                    elif (pattern.name, twin.name) not in rejected:
                        rejected.append((pattern.name, twin.name))
                for anchor, pattern, t in fresh:  # (a family's own templates are distinct already)
                    kept.setdefault(_primitive_counts(t), []).append((pattern, t))
                    by_anchor.setdefault(anchor, []).append((pattern, t))
        for anchor_entries in by_anchor.values():
            anchor_entries.sort(key=lambda e: -len(e[1].eqns))
        return Registry(by_anchor, self.patterns, rejected)


def found_in(graph: Graph, live, by_anchor: dict, names) -> frozenset:
    """Which of the patterns named `names` match somewhere among the `live` equations (structurally)."""
    at = collections.defaultdict(list)  # primitive -> live equations
    for i in sorted(live):
        at[graph.eqns[i].primitive.name].append(i)
    found = set()
    for anchor, entries in by_anchor.items():
        for pattern, template in entries:
            if pattern.name in names and pattern.name not in found and any(  # (one template found is enough)
                    anchor_fits(graph, i, anchor_signature(template)) and unify(template, graph, i, strict=False)
                    for i in at[anchor]):
                found.add(pattern.name)
    return frozenset(found)


def _representatives(dtypes) -> list:
    """The dtypes (or dtype tuples) worth tracing: float16 traces as bfloat16 does but for dtypes,
    which structural matching ignores (the exact re-trace then checks the real one), so only
    bfloat16 is traced: half the tracing, a faster first xkern.jit."""
    def half(d):
        try:
            return jnp.bfloat16 if np.dtype(d) == np.float16 else d
        except TypeError:  # a pattern's own example selector, not a dtype
            return d
    out = []
    for d in dtypes:
        rep = tuple(map(half, d)) if isinstance(d, tuple) else half(d)
        if rep not in out:
            out.append(rep)
    return out


def build_registry(patterns: list[Pattern]) -> Registry:
    """Every pattern's templates, as an earlier process stored them (template_cache.py) or traced
    now and stored; duplicates (a template another pattern already has) rejected."""
    names = [p.name for p in patterns]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate pattern names: {sorted(n for n in names if names.count(n) > 1)}")
    stored = template_cache.load(patterns)
    if stored is not None:
        by_anchor, rejected, constants = stored
        for anchor, index, values in constants:
            template = by_anchor[anchor][index][1]
            _CONSTANTS[id(template)] = (template, values)
        return Registry(by_anchor, patterns, rejected)
    by_anchor, rejected = _trace_registry(patterns)
    constants = [(anchor, i, template_constants(t)) for anchor, entries in by_anchor.items()
                 for i, (_, t) in enumerate(entries) if template_constants(t)]
    template_cache.store(patterns, by_anchor, rejected, constants)
    return Registry(by_anchor, patterns, rejected)


def _primitive_counts(template: Jaxpr) -> tuple:
    """The count of each primitive: only templates with the same can be the same."""
    return tuple(sorted(collections.Counter(e.primitive.name for e in template.eqns).items()))


def _trace_registry(patterns: list[Pattern]) -> tuple[dict, list]:
    """Trace every pattern's templates: by_anchor (largest template first) and the rejected."""
    kept, rejected, by_anchor = {}, [], {}  # kept: _primitive_counts -> [(pattern, template)]
    for pattern in patterns:
        templates = []
        for dtype in _representatives(pattern.dtypes):
            # (off any mesh the program is traced under: templates are stored for every later program)
            with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
                t = trace(pattern, pattern.example(dtype), pattern.example_params)
            if not any(same_jaxpr(t, other) for other in templates):
                templates.append(t)
        fresh = []
        for t in templates:  # only templates of the same primitives, as many of each, can be the same
            twin = next((p for p, other in kept.get(_primitive_counts(t), ()) if same_jaxpr(t, other)), None)
            if twin is None:
                fresh.append(t)
            elif (pattern.name, twin.name) not in rejected:
                rejected.append((pattern.name, twin.name))
        for t in fresh:
            kept.setdefault(_primitive_counts(t), []).append((pattern, t))
            anchor = Graph(t).producer[t.outvars[0]][0]
            by_anchor.setdefault(t.eqns[anchor].primitive.name, []).append((pattern, t))
    for entries in by_anchor.values():
        entries.sort(key=lambda e: -len(e[1].eqns))
    return by_anchor, rejected


@functools.cache
def registry() -> Registry:
    """All patterns of every `*_rules` module, traced once, on first use."""
    import xkern.jaxpr_passes as package

    patterns = []
    with _collector.paused():  # (thousands of patterns built, templates loaded: see _collector)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if info.name.endswith("_rules"):
                patterns += importlib.import_module(f"{package.__name__}.{info.name}").PATTERNS
        built = build_registry([p for p in patterns if not (p.requires or p.extends)])
    built.patterns = patterns
    for p in patterns:
        if p.requires or p.extends:
            built.gated.setdefault((p.requires, p.extends), []).append(p)
    return built
