"""Rewriting: decide which pattern matches become xkern ops (a Plan), then evaluate the program with
those matches replaced, by an interpreter that re-binds every other equation unchanged.

Nothing edits a jaxpr by hand: evaluating the plan under a trace (jax.jit, make_jaxpr, grad, vmap)
builds the rewritten program, with each equation's source info carried over.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from xkern import _compat
from xkern.fusion import grouping
from xkern.fusion.lowering import ELEMENTWISE
from xkern.kernels import generated
from xkern.jaxpr_passes.canonicalize import bind_equation, canonicalize, live_equations
from xkern.jaxpr_passes.graph import Graph, aval_bytes, constant_equations
from xkern.jaxpr_passes.patterns import (Match, anchor_fits, anchor_signature, registry, retrace, same_constants,
                                        template_constants, unify)

# Higher-order primitives whose bodies are not rewritten: xkern's own ops are custom_vjp calls, and
# a custom_vjp's body is only the un-differentiated path of a function that has its own rules.
OPAQUE = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})


@dataclasses.dataclass
class Rewrite:
    match: Match
    params: dict
    location: str
    residual_add: int | None = None  # the folded add h = x + r making the first input (see below)
    substituted: dict = dataclasses.field(default_factory=dict)  # input index -> (value(s), adapt): Pattern.substitutes

    @property
    def pattern(self) -> str:
        return (self.match.pattern.name + (" + residual add" if self.residual_add is not None else "")
                + (f" + {given_names(self.match.provided)}" if self.match.provided else ""))

    def inputs(self) -> tuple[list, Any]:
        """The program values the replacement takes, one entry an input (None for those it ignores at
        these params; a tuple where several values substitute for one), and the residual r (None: no
        folded add)."""
        ignored = self.match.pattern.ignores(self.params)
        inputs = [None if n in ignored else self.substituted[n][0] if n in self.substituted else v
                  for n, v in enumerate(self.match.inputs)]
        if self.residual_add is None:
            return inputs, None
        x, r = self.match.graph.eqns[self.residual_add].invars
        return [x, *inputs[1:]], r

    def reads(self) -> list:
        """The program values the replacement reads, in order (the folded add's residual last)."""
        inputs, residual = self.inputs()
        return [u for v in (*inputs, residual) if v is not None for u in (v if isinstance(v, tuple) else (v,))]

    def arguments(self, read) -> list:
        """The replacement's arguments, read(value) for each program value of inputs(): substituted
        ones adapted (a tuple's values adapted together)."""
        inputs, _ = self.inputs()
        value = lambda v: None if v is None else tuple(map(read, v)) if isinstance(v, tuple) else read(v)
        return [self.substituted[n][1](value(v)) if n in self.substituted and v is not None else value(v)
                for n, v in enumerate(inputs)]


def given_names(provided: dict) -> str:
    """What a match's replacement gives beside its output (Match.provided), as explain says it."""
    return " and ".join(f"its {name}" for name in dict.fromkeys(provided.values()))


@dataclasses.dataclass
class Declined:
    pattern: str
    location: str
    reason: str
    anchor: int


@dataclasses.dataclass
class Fusion:
    """A generated kernel for a fusion group, run where the group's last equation was."""
    fused: Any  # xkern.kernels.generated.Fused
    location: str
    backward: "Plan | None" = None  # a matmul group's epilogue derivative, planned like a program
    aliases: dict = dataclasses.field(default_factory=dict)  # input -> output written over it (memory plan)

    @property
    def inputs(self) -> list:
        return list(self.fused.input_vars)

    @property
    def outputs(self) -> list:
        return [v for v, _ in self.fused.group.outputs]


@dataclasses.dataclass
class Plan:
    closed: ClosedJaxpr
    live: set[int]
    rewrites: dict[int, Rewrite]  # anchor equation -> its rewrite
    skip: set[int]  # equations a rewrite absorbed
    subplans: dict[int, dict[str, list["Plan"]]]  # equation -> param -> plans of its sub-jaxprs
    declined: list[Declined]
    fusions: dict[int, Fusion] = dataclasses.field(default_factory=dict)  # last equation -> fusion
    # equations reading a value a rewrite provides (Pattern.provides), directly or not -> the position
    # they run at: after that rewrite's anchor (see _deferred)
    deferred: dict[int, int] = dataclasses.field(default_factory=dict)
    role: str = ""  # what a plan that is not the user's program plans ("epilogue derivative")

    def walk(self):
        """This plan and every sub-plan (sub-jaxprs, epilogue derivatives), depth first."""
        yield self
        for by_param in self.subplans.values():
            for plans in by_param.values():
                for plan in plans:
                    yield from plan.walk()
        for fusion in self.fusions.values():
            if fusion.backward is not None:
                yield from fusion.backward.walk()

    @property
    def changes(self) -> bool:
        return any(p.rewrites or p.fusions for p in self.walk())


def empty_plan(closed: ClosedJaxpr) -> Plan:
    return Plan(closed, live_equations(closed.jaxpr), {}, set(), {}, [])


def location(eqn) -> str:
    return _compat.summarize_source(eqn.source_info)


# --------------------------------------------------------------------------------------------------
# Deciding
# --------------------------------------------------------------------------------------------------

# What a pattern may compute from its inputs alone and still share with the rest of the program:
# mask and bias preparation (a float mask turned to bool, broadcast per head). Such an equation stays
# in the program for its other users while the replacement computes its own copy: a mask made once
# and read by every layer's attention, or merged into one by canonicalization, is not an escape.
SHAREABLE = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                       "transpose", "iota", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
                       "select_n", "add", "sub", "mul", "neg", "max", "min", "copy", "pvary"})


def _shared_prefix(match: Match) -> set[int]:
    """The match's equations computed from its inputs, literals and constants alone, through cheap
    elementwise and shape operations (SHAREABLE) or from literals and constants only (a scale's
    sqrt): safe to leave in the program for other users."""
    graph, inside = match.graph, match.program_eqns
    prefix, constant = set(), set()  # constant: computed from literals and constants alone
    made_by = lambda v: graph.producer[v][0] if v in graph.producer else None
    for i in sorted(inside - {match.anchor}):
        eqn = graph.eqns[i]
        consts = [isinstance(v, Literal) or v in graph.consts or made_by(v) in constant for v in eqn.invars]
        if eqn.effects or not all(c or v in match.inputs or made_by(v) in prefix
                                  for c, v in zip(consts, eqn.invars)):
            continue
        if all(consts):
            constant.add(i)
        if all(consts) or eqn.primitive.name in SHAREABLE:
            prefix.add(i)
    return prefix


def _escaping(match: Match, live: set[int]) -> tuple[str | None, set[int], dict]:
    """(The primitive of an intermediate used outside the match, or None; the match's equations
    that stay in the program because something outside reads them, from its shared prefix or
    computed from what the replacement provides; the values it must provide)."""
    graph, inside = match.graph, match.program_eqns
    prefix = _shared_prefix(match)
    read_outside = lambda i: any(v in graph.outvars or any(c in live and c not in inside
                                                            for c in graph.consumers.get(v, ()))
                                 for v in graph.eqns[i].outvars)
    escaping = [i for i in sorted(inside - {match.anchor}) if read_outside(i)]
    given = match.pattern.provides(match) if match.pattern.provides and any(i not in prefix for i in escaping) else {}
    derived = _derived(match, prefix, given)
    made_given = {graph.producer[v][0] for v in given}
    stays = prefix | derived
    if any(i not in stays | made_given for i in escaping):
        i = next(i for i in escaping if i not in stays and i not in made_given)
        out = any(v in graph.outvars for v in graph.eqns[i].outvars) and not any(
            c in live and c not in inside for v in graph.eqns[i].outvars for c in graph.consumers.get(v, ()))
        return f"{'output ' if out else ''}{graph.eqns[i].primitive.name}", set(), {}
    kept, todo = set(), [i for i in escaping if i not in made_given]
    while todo:  # each kept equation, and what it reads inside the prefix or computes from the given
        i = todo.pop()
        if i not in kept:
            kept.add(i)
            todo += [graph.producer[v][0] for v in graph.eqns[i].invars
                     if not isinstance(v, Literal) and v in graph.producer and graph.producer[v][0] in stays]
    needed = {v for i in kept for v in graph.eqns[i].invars if isinstance(v, Var)} | {
        v for i in escaping if i in made_given for v in graph.eqns[i].outvars}
    return None, kept, {v: name for v, name in given.items() if v in needed}


DERIVABLE = frozenset(ELEMENTWISE) | {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type"}


def _derived(match: Match, prefix: set[int], given: dict) -> set[int]:
    """The match's equations (not its anchor) computed by elementwise and shape equations from the
    values `given` (Pattern.provides) and from its inputs, literals and shared prefix."""
    if not given:
        return set()
    graph, derived = match.graph, set()
    known = set(given) | set(match.inputs) | set(graph.consts)
    for i in sorted(match.program_eqns - {match.anchor}):
        eqn = graph.eqns[i]
        if i in prefix:
            known.update(eqn.outvars)
        elif (not eqn.effects and eqn.primitive.name in DERIVABLE and not set(eqn.outvars) & set(given)
              and all(isinstance(v, Literal) or v in known for v in eqn.invars)):
            derived.add(i)
            known.update(eqn.outvars)
    return derived


def _reads_own_output(match: Match, live: set[int]) -> bool:
    """Whether the match's inputs are computed from what reads the values it provides: the
    replacement could not run before them."""
    graph = match.graph
    after, todo = set(), [c for v in match.provided for c in graph.consumers.get(v, ())]
    while todo:
        i = todo.pop()
        if i in live and i not in after and (i not in match.program_eqns or i in match.shared):
            after.add(i)
            todo += [c for v in graph.eqns[i].outvars for c in graph.consumers.get(v, ())]
    before, todo = set(), [graph.producer[v][0] for v in match.inputs if isinstance(v, Var) and v in graph.producer]
    while todo:
        i = todo.pop()
        if i not in before:
            before.add(i)
            todo += [graph.producer[v][0] for v in graph.eqns[i].invars if isinstance(v, Var) and v in graph.producer]
    return bool(after & before)


AN_OUTPUT = "is also an output of the program"  # (_decide's reason for an intermediate returned)


def declined_for_output(plan: Plan) -> bool:
    """Whether the plan declined a pattern because an intermediate of it is an output of the program."""
    return any(AN_OUTPUT in d.reason for p in plan.walk() for d in p.declined)


NEAR_MISS = ("the pattern does not apply at these inputs", "differs from ")  # _decide's look-alike reasons


def _decide(match: Match, live: set[int], backend: str, cost) -> tuple[dict | None, str | None, bool]:
    """The params of an accepted match, or the reason it is declined and whether the cost model
    gave it."""
    escaped, match.shared, match.provided = _escaping(match, live)
    if match.provided and _reads_own_output(match, live):
        return None, (f"the pattern's inputs are computed from {given_names(match.provided)}, which the program "
                      "reads outside it: the kernel that would give it needs them first"), False
    if escaped and escaped.startswith("output "):
        return None, (f"an intermediate ({escaped[7:]}) {AN_OUTPUT} (returned beside the "
                      "result, as a loss's sum or its logits for metrics): the kernels do not write it"), False
    if escaped:
        return None, (f"an intermediate ({escaped}) is also used outside the pattern: by another computation "
                      "of the same value (two norms of one input share their statistics once jax's "
                      "duplicates are merged), or by a backward pass if the program was differentiated "
                      "before xkern saw it (give xkern the function that calls jax.grad, or jax.grad an "
                      "xkern.optimize'd function)"), False
    pattern = match.pattern
    try:
        params = pattern.params_of(match)
        exact = retrace(pattern, match.input_avals[:len(match.inputs) - pattern.constants], params)
    except Exception as e:  # a pattern that cannot be traced here is a near miss, not a crash
        return None, f"the pattern does not apply at these inputs ({type(e).__name__}: {e})", False
    again = unify(exact, match.graph, match.anchor, strict=True)
    if again is None or any(a is not b for a, b in zip(again.inputs, match.inputs)):
        return None, (f"differs from {pattern.name} at these shapes and params "
                      f"(e.g. reductions over other axes, other dtypes)"), False
    lifted = again.inputs[len(again.inputs) - pattern.constants:]
    if not same_constants(match.graph, lifted, template_constants(exact)):
        return None, f"its constants differ from {pattern.name}'s at these shapes and params", False
    out = match.graph.eqns[match.anchor].outvars[0]
    consumers = [match.graph.eqns[c].primitive.name for c in match.graph.consumers.get(out, ())
                 if c in live] + (["output"] if out in match.graph.outvars else [])
    params = {**params, **pattern.facts_of(match)}
    splits = pattern.split_dims or (lambda i, ndim, params: {0})
    reason = pattern.check(match, params) or unsplit_sharding(match.graph, match.inputs,
                                                              lambda i, ndim: splits(i, ndim, params))
    if reason:
        return None, reason, False
    reason = cost(pattern.op, match.input_avals, params, backend, consumers)
    return (None, reason, True) if reason else (params, None, False)


def unsplit_sharding(graph: Graph, inputs, splits) -> str | None:
    """A reason to leave a match to XLA where the program constrains an input
    (with_sharding_constraint), or types it (a mesh of Explicit axes), to be sharded along a dim its
    kernels do not split (partition.py: the leading dim; attention's heads too): each device would
    gather it and compute the whole, where XLA computes in parallel (a vocabulary sharded under the
    loss, a sequence under a norm); and under Explicit axes the kernels' views of it as rows could
    not be typed. splits(i, ndim): the dims of input i (of ndim dims) that may be sharded, a set, or
    a list of sets where the kernels split along the dims of any one of them but not of two."""
    for i, v in enumerate(inputs):
        eqn = _constraint_of(graph, v)
        sharding, how = (eqn.params.get("sharding"), "with_sharding_constraint") if eqn is not None else (
            _typed_sharding(v), "its type, on a mesh of Explicit axes")
        spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
        if spec is None or mesh is None:
            continue
        sharded = _sharded_dims(spec, mesh)
        allowed = splits(i, v.aval.ndim)
        allowed = allowed if isinstance(allowed, list) else [allowed]
        if any(sharded.keys() <= dims for dims in allowed):
            continue
        d = next((d for d in sharded if not any(d in dims for dims in allowed)), None)
        if d is None:
            return (f"an input is sharded along its dims {sorted(sharded)} ({how}), which the kernels "
                    f"split one at a time: each device would gather it along one of them, where XLA "
                    f"computes its share")
        return (f"an input is sharded along its dim {d} over mesh axes {sharded[d]} "
                f"({how}), which the kernels do not split: each device would "
                f"gather it and compute the whole, where XLA computes its share")
    return None


def _sharded_dims(spec, mesh) -> dict:
    """{dim: its mesh axes} of the dims a PartitionSpec splits in more than one part."""
    out = {}
    for d, axes in enumerate(spec):
        axes = (axes,) if isinstance(axes, str) else axes
        if isinstance(axes, tuple) and math.prod(dict(mesh.shape).get(a, 1) for a in axes) > 1:
            out[d] = axes
    return out


def _typed_sharding(v):
    """The sharding v's type carries (a mesh of Explicit axes), or None."""
    aval = getattr(v, "aval", None)
    return aval.sharding if isinstance(v, Var) and _compat.explicit_mesh([aval]) is not None else None


def _constraint_of(graph: Graph, v, depth: int = 8):
    """The with_sharding_constraint equation giving v, through up to `depth` elementwise equations
    after it (a cast; `x - mean`, whose result is sharded as x is), each followed back to an operand
    of its own shape (of its dtype, where one is); or None."""
    for _ in range(depth + 1):
        if not isinstance(v, Var) or v not in graph.producer:
            return None
        eqn = graph.eqns[graph.producer[v][0]]
        if eqn.primitive.name == "sharding_constraint":
            return eqn
        if eqn.primitive.name not in ELEMENTWISE:
            return None
        alike = [u for u in eqn.invars if isinstance(u, Var) and u.aval.shape == v.aval.shape]
        v = next((u for u in alike if u.aval.dtype == v.aval.dtype), alike[0] if alike else None)  # (not a
        # where's boolean mask: its values)
    return None


_BY_SIGNATURE: dict[int, tuple] = {}


def _by_signature(entries: list) -> dict:
    """{anchor signature: indices into entries}, cached per registry list: a program equation is
    looked at once per distinct signature (a few dozen), not once per template (hundreds share an
    anchor: every attention spelling ends in a dot_general)."""
    cached = _BY_SIGNATURE.get(id(entries))
    if cached is None or cached[0] is not entries:
        index: dict = {}
        for j, (_, template) in enumerate(entries):
            index.setdefault(anchor_signature(template), []).append(j)
        cached = _BY_SIGNATURE[id(entries)] = (entries, index)
    return cached[1]


UNMATCHED_ATTENTION = ("a softmax between two matrix products, as in attention, written in no spelling the attention "
                       "patterns take (the scores scaled per key, a mask applied after the softmax, ...): the scores "
                       "exist in memory")


def _attention_left_as_softmax(plan: Plan, graph: Graph) -> tuple[list[Declined], set[int]]:
    """explain's note at each softmax (fused or not) that reads a batched matrix product (over batch
    and heads, as q k^T) a few equations back and feeds one a few equations on: attention that no
    attention pattern took. (An LM head's product has no batch axes.) Also the equations a few past
    each such softmax: an attention spelling's look-alike ending there is said better by the note."""
    def batched_product(j: int) -> bool:
        eqn = graph.eqns[j]
        return eqn.primitive.name == "dot_general" and bool(eqn.params["dimension_numbers"][1][0])

    def reached(start: int, step, depth: int) -> tuple[bool, set[int]]:
        frontier, seen, found = [start], {start}, False
        for _ in range(depth):
            frontier = [j for i in frontier for j in step(i) if j not in seen and not seen.add(j)]
            found = found or any(batched_product(j) for j in frontier)
        return found, seen
    back = lambda i: [graph.producer[v][0] for v in graph.eqns[i].invars if isinstance(v, Var) and v in graph.producer]
    on = lambda i: [j for v in graph.eqns[i].outvars for j in graph.consumers.get(v, ())]
    softmaxes = {i: r.location for i, r in plan.rewrites.items() if r.match.pattern.op in ("softmax", "log_softmax")}
    softmaxes.update({d.anchor: d.location for d in plan.declined if d.pattern.startswith(("softmax/", "log_softmax/"))})
    notes, after = [], set()
    for i, where in sorted(softmaxes.items()):
        if reached(i, on, 4)[0] and reached(i, back, 12)[0]:
            notes.append(Declined("attention", where, UNMATCHED_ATTENTION, i))
            after |= reached(i, on, 8)[1]
    return notes, after


def match_patterns(closed: ClosedJaxpr, backend: str, cost, plan_sub) -> Plan:
    """Find the named patterns in `closed`; sub-jaxprs are planned by `plan_sub` (the pipeline)."""
    graph = Graph(closed.jaxpr, closed.consts)
    plan = empty_plan(closed)
    by_anchor = registry().by_anchor_in(graph, plan.live)
    claimed: set[int] = set()
    # Equations of matches the cost model declined: a match inside one is not taken either (its
    # estimate would count the intermediates the larger match keeps out of memory as gains, e.g. a
    # norm's float32 upcast, as if they were inputs it must read anyway).
    too_costly: list[frozenset[int]] = []
    # Latest anchors first, so a larger pattern (softmax with its casts) wins over one inside it.
    for i in reversed(range(len(graph.eqns))):
        if i not in plan.live or i in claimed:
            continue
        entries = by_anchor.get(graph.eqns[i].primitive.name, ())
        by_signature = _by_signature(entries)  # the cheap look once per distinct anchor signature
        for j in sorted(j for sig, js in by_signature.items() if anchor_fits(graph, i, sig) for j in js):
            pattern, template = entries[j]
            match = unify(template, graph, i, strict=False)
            if match is None or match.program_eqns & claimed:
                continue
            match.pattern = pattern
            if any(match.program_eqns <= outer for outer in too_costly):
                continue  # the larger match's reason stands for it
            params, reason, by_cost = _decide(match, plan.live, backend, cost)
            if reason:
                plan.declined.append(Declined(pattern.name, location(graph.eqns[i]), reason, i))
                if by_cost:
                    too_costly.append(frozenset(match.program_eqns))
                continue
            substituted = {} if pattern.substitutes is None else pattern.substitutes(match, params)
            plan.rewrites[i] = Rewrite(match, params, location(graph.eqns[i]), substituted=substituted)
            claimed |= match.program_eqns - match.shared  # shared ones stay, for every match reading them
            plan.skip |= match.program_eqns - {i} - match.shared
            break
    _fold_residual_adds(plan, graph, claimed)
    if any(r.match.pattern.ignores(r.params) or r.substituted for r in plan.rewrites.values()):
        _drop_unread(plan)
    plan.deferred = _deferred(plan, graph)
    # A candidate declined in one spelling but rewritten in another was not declined after all; of
    # several spellings declined at one place, the largest (tried first) that the program does
    # write speaks for it (a spelling whose exact trace differs is only a look-alike). But where
    # another op took the place (the cross-entropy without the LM head's matmul), a larger op's
    # reason is kept: it says why the fusion is smaller than it could be.
    speaker: dict[int, Declined] = {}
    for d in sorted(plan.declined, key=lambda d: d.reason.startswith(NEAR_MISS)):
        speaker.setdefault(d.anchor, d)
    notes, after_notes = _attention_left_as_softmax(plan, graph)
    plan.declined = [d for d in plan.declined if (d.anchor not in claimed or _other_op_took(plan, d))
                     and speaker[d.anchor] is d and not (d.anchor in after_notes and d.pattern.startswith("attention/")
                                                         and d.reason.startswith(NEAR_MISS))] + notes
    for i in sorted(plan.live - claimed):
        eqn = graph.eqns[i]
        if eqn.primitive.name in OPAQUE:
            continue
        for name, value in eqn.params.items():
            bodies = _sub_jaxprs(value)
            if bodies:
                with _compat.body_context(eqn):
                    plans = [plan_sub(body) for body in bodies]
                if any(p.changes or any(q.declined for q in p.walk()) for p in plans):
                    plan.subplans.setdefault(i, {})[name] = plans
    return plan


def _other_op_took(plan: Plan, declined: Declined) -> bool:
    """Whether a rewrite of another op took the declined candidate's anchor, and the candidate is
    a spelling the program writes (not a look-alike)."""
    rewrite = plan.rewrites.get(declined.anchor)
    return (rewrite is not None and not declined.reason.startswith(NEAR_MISS)
            and declined.pattern.split("/")[0] != rewrite.match.pattern.op)


def _fold_residual_adds(plan: Plan, graph: Graph, claimed: set[int]) -> None:
    """Let each rewrite whose pattern can (a norm) take the add h = x + r that makes its first input:
    the kernel then reads x and r and writes h beside its output. The replacement runs at the
    pattern's anchor, so h's other users must all come after it (as in a pre-norm transformer block,
    where h is next used by the block's second residual add). A matched equation left in the program
    for another user (match.shared: h's upcast, also read outside the norm) runs where it stood, so
    it counts as such a user."""
    for anchor, rewrite in plan.rewrites.items():
        h = rewrite.match.inputs[0]
        add = graph.residual_sum(h) if rewrite.match.pattern.folds_residual_add else None
        if add is None or add in claimed or add not in plan.live:
            continue
        own = rewrite.match.program_eqns - rewrite.match.shared
        if any(c in plan.live and c < anchor and c not in own for c in graph.consumers.get(h, ())):
            continue
        rewrite.residual_add = add
        claimed.add(add)
        plan.skip.add(add)


def _deferred(plan: Plan, graph: Graph) -> dict[int, int]:
    """The equations reading a value a rewrite provides (Pattern.provides), or reading such an
    equation's results, -> where they run: at the latest of their own position and the anchors they
    wait for (the kept z-loss term sits before the loss's anchor in the program; so does its mask
    and sum). Nothing else reads them, so moving them later keeps every value before its readers."""
    provider = {v: anchor for anchor, r in plan.rewrites.items() for v in r.match.provided}
    if not provider:
        return {}
    release, made = {}, {}
    for i in sorted(plan.live - plan.skip):
        reads = plan.rewrites[i].reads() if i in plan.rewrites else graph.eqns[i].invars
        waits = [provider[v] if v in provider else release[made[v]] for v in reads
                 if isinstance(v, Var) and (v in provider or v in made)]
        if waits:
            release[i] = max(i, *waits)
            made.update(dict.fromkeys(graph.eqns[i].outvars, i))
    return release


def _drop_unread(plan: Plan) -> None:
    """What only inputs the replacements ignore needed (a constant mask read as causal), or read
    through a substitute (the repeat of k/v heads), is dead."""
    def reads(i, eqn):
        if i in plan.rewrites:  # (one that may run as written also reads what its equations read)
            rewrite = plan.rewrites[i]
            return [*rewrite.reads(), *(_external_reads(rewrite, plan.closed.jaxpr)
                                        if _may_run_as_written(rewrite) else ())]
        return () if i in plan.skip else eqn.invars
    plan.live = live_equations(plan.closed.jaxpr, reads) | (plan.live & plan.skip)


def _sub_jaxprs(value) -> list[ClosedJaxpr]:
    values = value if isinstance(value, tuple) else (value,)
    if not values or not all(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in values):
        return []
    return [v if isinstance(v, ClosedJaxpr) else ClosedJaxpr(v, ()) for v in values]


# --------------------------------------------------------------------------------------------------
# Evaluating
# --------------------------------------------------------------------------------------------------

def specs(avals) -> list[jax.ShapeDtypeStruct]:
    return [_compat.spec_like(a) for a in avals]


def evaluate(plan: Plan, args, backend: str) -> list:
    """Run the program of `plan` on `args` (arrays or tracers), with its rewrites applied."""
    jaxpr = plan.closed.jaxpr
    env = dict(zip(jaxpr.constvars, plan.closed.consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: None if v is None else v.val if isinstance(v, Literal) else env[v]
    # (deferred equations wait for the rewrites whose values they read: see _deferred)
    order = sorted(range(len(jaxpr.eqns)), key=lambda i: (plan.deferred[i], 1, i) if i in plan.deferred else (i, 0, i))
    for i in order:
        eqn = jaxpr.eqns[i]
        if i not in plan.live or i in plan.skip:
            continue
        if i in plan.fusions:
            fusion = plan.fusions[i]
            derivative = None if fusion.backward is None else (
                lambda *a, plan=fusion.backward: evaluate(plan, a, backend))
            with _compat.user_context(eqn.source_info):
                outs = generated.op(fusion.fused, backend, derivative, fusion.aliases)(*map(read, fusion.inputs))
            env.update(zip(fusion.outputs, outs))
            continue
        if i in plan.rewrites:
            rewrite = plan.rewrites[i]
            _, residual = rewrite.inputs()
            if _may_run_as_written(rewrite):
                reads = list(dict.fromkeys([*_external_reads(rewrite, jaxpr),
                                            *(v for v in rewrite.reads() if not isinstance(v, Literal))]))
                with _compat.user_context(eqn.source_info):
                    env[eqn.outvars[0]] = _per_differentiation(rewrite, jaxpr, reads, backend)(*map(read, reads))
                continue
            replace = functools.partial(rewrite.match.pattern.replace, *rewrite.arguments(read),
                                        backend=backend, **rewrite.params)
            with _compat.user_context(eqn.source_info):
                if rewrite.match.provided:
                    out, given = replace(provide=True)
                    outs = [out]
                    env.update({v: given[name].reshape(v.aval.shape).astype(v.aval.dtype)
                                for v, name in rewrite.match.provided.items()})
                elif residual is None:
                    outs = [replace()]
                else:
                    out, env[rewrite.match.inputs[0]] = replace(residual=read(residual))
                    outs = [out]
            _check_replaced(rewrite, eqn.outvars[0].aval, outs[0])
        elif i in plan.subplans:
            params = dict(eqn.params)
            with _compat.body_context(eqn):
                for name, plans in plan.subplans[i].items():
                    params[name] = _rebuilt(eqn.params[name], plans, backend)
            outs = bind_equation(eqn, map(read, eqn.invars), params)
        else:
            outs = _compat.run_equation(eqn, list(map(read, eqn.invars)))
        env.update(zip(eqn.outvars, outs))
    return [read(v) if isinstance(v, Literal) else _compat.typed_as(read(v), v.aval) for v in jaxpr.outvars]


def _check_replaced(rewrite: Rewrite, aval, value) -> None:
    """A replacement must give the program's value its shape and dtype; anything else is xkern's bug
    (never passed on: a bf16 result where the program's is float32 would change every later op)."""
    got = jax.typeof(value)
    if (got.shape, got.dtype) != (aval.shape, aval.dtype):
        raise AssertionError(f"xkern: the replacement of {rewrite.pattern} at {rewrite.location} gives "
                             f"{got.str_short()} where the program computes {aval.str_short()}; please report this")


def _may_run_as_written(rewrite: Rewrite) -> bool:
    """Whether the rewrite's pattern may run its matched equations instead (Pattern.xla_when)."""
    pattern = rewrite.match.pattern
    return (pattern.xla_when is not None and rewrite.residual_add is None and not rewrite.match.provided
            and not pattern.ignores(rewrite.params))


def _external_reads(rewrite: Rewrite, jaxpr) -> list:
    """The program values the matched equations read (its inputs, constants), each once."""
    made = {v for j in rewrite.match.program_eqns for v in jaxpr.eqns[j].outvars}
    reads = [*rewrite.match.inputs, *(v for j in sorted(rewrite.match.program_eqns) for v in jaxpr.eqns[j].invars)]
    return list(dict.fromkeys(v for v in reads if not isinstance(v, Literal) and v not in made))


def _per_differentiation(rewrite: Rewrite, jaxpr, reads: list, backend: str):
    """The rewrite as a function of the values it reads, deciding when it is differentiated, from
    which of them are (custom_vjp's symbolic zeros): the replacement, or the matched equations as
    written where Pattern.xla_when gives a reason (heard by explain). The decision is made wherever
    the differentiation is applied, inside the jitted function or around it (jax.grad(xkern.jit(f)));
    a call not differentiated asks with nothing perturbed."""
    match, pattern = rewrite.match, rewrite.match.pattern
    at = {v: n for n, v in enumerate(reads)}
    out = jaxpr.eqns[match.anchor].outvars[0]

    def replacement(*values):  # (reading substitutes where the pattern has them: Rewrite.arguments)
        read = lambda v: v.val if isinstance(v, Literal) else values[at[v]]
        value = pattern.replace(*rewrite.arguments(read), backend=backend, **rewrite.params)
        _check_replaced(rewrite, out.aval, value)
        return value

    def as_written(*values):
        env = dict(zip(reads, values))
        read = lambda v: v.val if isinstance(v, Literal) else env[v]
        for j in sorted(match.program_eqns):
            e = jaxpr.eqns[j]
            env.update(zip(e.outvars, _compat.run_equation(e, [read(v) for v in e.invars])))
        return env[out]

    def chosen(perturbed: list[bool], differentiated: bool):
        reason = pattern.xla_when(perturbed, rewrite.params)
        if _AS_WRITTEN.heard is not None:
            _AS_WRITTEN.heard.append((rewrite, reason, differentiated))
        return as_written if reason else replacement

    @jax.custom_vjp
    def op(*values):  # (not differentiated; also traced, unrun, where it is)
        return chosen([False] * len(match.inputs), False)(*values)

    def fwd(*primals):
        perturbed = {v: p.perturbed for v, p in zip(reads, primals)}
        return jax.vjp(chosen([perturbed[v] for v in match.inputs], True), *(p.value for p in primals))

    def bwd(vjp, d_out):
        if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
            return (None,) * len(reads)
        return tuple(vjp(d_out))
    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op


class _Heard(threading.local):
    heard: list | None = None  # (rewrite, reason or None, differentiated) of each decision, while explain listens


_AS_WRITTEN = _Heard()


def ran_as_written(heard: list, rewrite: Rewrite) -> str | None:
    """Why `rewrite` ran as written (Pattern.xla_when) in the calls heard, or None: a differentiated
    call's decision where there was one (jax traces the undifferentiated function there too, unrun),
    else the undifferentiated call's."""
    decisions = [(why, differentiated) for r, why, differentiated in heard if r is rewrite]
    decided = [why for why, differentiated in decisions if differentiated] or [why for why, _ in decisions]
    return next((why for why in decided if why), None)


@contextlib.contextmanager
def hearing_as_written():
    """A list of (rewrite, reason or None, differentiated) for each decision of Pattern.xla_when
    meanwhile (ran_as_written reads it)."""
    previous, _AS_WRITTEN.heard = _AS_WRITTEN.heard, []
    try:
        yield _AS_WRITTEN.heard
    finally:
        _AS_WRITTEN.heard = previous


def _rebuilt(value, plans: list[Plan], backend: str):
    """A sub-jaxpr param with its plans' rewrites applied (re-traced), in the param's own type."""
    values = value if isinstance(value, tuple) else (value,)
    out = []
    for original, plan in zip(values, plans):
        if not plan.changes:
            out.append(original)
            continue
        avals = [v.aval for v in plan.closed.jaxpr.invars]
        new = jax.make_jaxpr(lambda *a, plan=plan: evaluate(plan, a, backend))(*specs(avals))
        if isinstance(original, Jaxpr):
            out.append(new.jaxpr if not new.consts else original)  # an open body cannot take consts
        else:
            out.append(new)
    return tuple(out) if isinstance(value, tuple) else out[0]


# Operations XLA never fuses into a neighbouring elementwise kernel: a group bordered only by these
# (and by the program's inputs and outputs) replaces a whole XLA fusion, as in the measured cases.
XLA_BARRIERS = frozenset({"dot_general", "conv_general_dilated", "xkern_kernel", "custom_vjp_call",
                          "custom_vjp_call_jaxpr", "custom_jvp_call", "scan", "while", "cond", "sort",
                          "jit", "pjit", "scatter", "scatter-add", "scatter_add", "argsort",
                          "cumsum", "cumprod", "cummax", "cumlogsumexp"})


BITCASTS = frozenset({"reshape", "squeeze", "expand_dims"})  # free in XLA: look through them


def _fusable_neighbour(group, graph, live: set[int], claimed: set[int]) -> str | None:
    """An operation next to the group that XLA would fuse with it (so a separate kernel moves more
    bytes than XLA's fusion would), or None if the group's borders are all fusion barriers."""
    inside = set(group.eqns)
    elementwise_only = not any(graph.eqns[i].primitive.name.startswith("reduce_") for i in inside)

    def producer_issue(v) -> str | None:
        if v not in graph.producer:
            return None  # a program input
        i = graph.producer[v][0]
        name = graph.eqns[i].primitive.name
        if i in claimed:
            return None
        if name in BITCASTS:
            return producer_issue(graph.eqns[i].invars[0])
        if name == "dot_general":  # XLA fuses elementwise epilogues into matmuls
            return "its input is a matmul's product (an elementwise epilogue)" if elementwise_only else None
        return None if name in XLA_BARRIERS else f"its input comes from {name}"

    def consumer_issue(v, seen=()) -> str | None:
        for c in graph.consumers.get(v, ()):
            name = graph.eqns[c].primitive.name
            if c not in live or c in inside or c in claimed or name in XLA_BARRIERS:
                continue
            if name in BITCASTS:
                issue = consumer_issue(graph.eqns[c].outvars[0])
                if issue:
                    return issue
                continue
            return f"its result feeds {name}"
        return None

    for v, kind in group.inputs:
        issue = producer_issue(v) if kind == "full" else None
        if issue:
            return issue
    for v, _ in group.outputs:
        issue = consumer_issue(v)
        if issue:
            return issue
    return None


CONSTANT_GROUP = "computed from constants alone: XLA folds it, or fuses it into its users"


def fuse_groups(plan: Plan, backend: str, cost) -> Plan:
    """Generated kernels for the groups of equations no pattern took, where the cost model agrees."""
    graph = Graph(plan.closed.jaxpr, plan.closed.consts)
    # A rewrite reads its inputs at its anchor: a group must give them as outputs even where their
    # only equation-consumer is one the match left in the program (an upcast shared with others).
    for anchor, rewrite in plan.rewrites.items():
        for v in rewrite.reads():
            if isinstance(v, Var) and anchor not in graph.consumers.get(v, ()):
                graph.consumers.setdefault(v, []).append(anchor)
    claimed = plan.skip | set(plan.rewrites) | set(plan.deferred)  # (deferred: they run out of order)
    role = f" ({plan.role})" if plan.role else ""
    for dot, g in grouping.matmul_epilogues(graph, plan.live, claimed):
        last = graph.eqns[g.eqns[-1]]
        read = [v for v, _ in generated.inputs(g, graph.eqns, dot)]
        reason = unsplit_sharding(graph, read, generated.split_dims(g, graph.eqns, dot)) or cost(
            "matmul_epilogue", [v.aval for v in graph.eqns[dot].invars], {}, backend)
        if reason:
            plan.declined.append(Declined(f"generated/matmul+{len(g.eqns)} ops", location(last), reason,
                                          g.eqns[-1]))
            # Leave the epilogue with XLA too: it fuses bias and activation into the matmul itself
            # (cuBLASLt), which a separate kernel reading the product back would undo.
            claimed |= set(g.eqns)
            continue
        fused = generated.build(g, graph.eqns, dot)
        plan.fusions[g.eqns[-1]] = Fusion(fused, location(last), _epilogue_derivative(fused, backend, cost))
        plan.skip |= (set(g.eqns) | {dot}) - {g.eqns[-1]}
        claimed |= set(g.eqns) | {dot}
    groups, _ = grouping.find_groups(graph, plan.live, claimed)
    for g in groups:
        last = graph.eqns[g.eqns[-1]]
        if all(constant_equations(graph, v) is not None for v, _ in g.inputs):  # (iotas, a count as a sum of
            # ones, a mask from a broadcast of 1.0): nothing the program is given, so nothing to save
            plan.declined.append(Declined(f"generated/{len(g.eqns)} ops{role}", location(last), CONSTANT_GROUP,
                                          g.eqns[-1]))
            continue
        moved = sum(aval_bytes(v.aval) for v, _ in (*g.inputs, *g.outputs))
        reason = unsplit_sharding(graph, [v for v, _ in g.inputs], generated.split_dims(g, graph.eqns)) or cost(
            "fused", [v.aval for v, _ in g.inputs],
            {"bytes": moved, "n_cols": g.n_cols, "fusable_neighbour": _fusable_neighbour(g, graph, plan.live, claimed)},
            backend)
        if reason:
            plan.declined.append(Declined(f"generated/{len(g.eqns)} ops{role}", location(last), reason,
                                          g.eqns[-1]))
            continue
        plan.fusions[g.eqns[-1]] = Fusion(generated.build(g, graph.eqns), location(last))
        plan.skip |= set(g.eqns) - {g.eqns[-1]}
    return plan


def _epilogue_derivative(fused, backend: str, cost) -> Plan:
    """The backward pass of a matmul group's epilogue, (product, other inputs, output cotangents) ->
    (d_product, d_others), traced and planned as a program of its own: its elementwise part (the
    activation's derivative times the cotangent) becomes one generated kernel where the cost model
    agrees, and what is not elementwise (a bias gradient's sum over rows) stays with XLA."""
    n_others = len(fused.input_vars) - 2

    def derivative(product, *rest):
        others, cotangents = rest[:n_others], rest[n_others:]
        return jax.vjp(fused.epilogue, product, *others)[1](list(cotangents))

    avals = [fused.eqns[0].outvars[0].aval, *(v.aval for v in fused.input_vars[2:]), *fused.output_avals]
    # Canonical as the program's own plan is (calls inlined, squares as square, repeats merged), so
    # the grouping sees the same spellings there.
    closed = canonicalize(jax.make_jaxpr(derivative)(*specs(avals)))
    plan = empty_plan(closed)
    plan.role = "epilogue derivative"
    return fuse_groups(plan, backend, cost)


def traffic(plan: Plan) -> tuple[int, int]:
    """Estimated bytes the rewritten regions move: (before, as unfused equations; after, as kernels)."""
    before = after = 0
    for p in plan.walk():
        graph = Graph(p.closed.jaxpr)
        for rewrite in p.rewrites.values():
            seen = set()
            folded = {rewrite.residual_add} - {None}
            for i in rewrite.match.program_eqns | folded:
                for v in (*graph.eqns[i].invars, *graph.eqns[i].outvars):
                    if not isinstance(v, Literal) and v not in seen:
                        seen.add(v)
                        before += aval_bytes(v.aval)
            outs = [graph.eqns[rewrite.match.anchor].outvars[0]] + [rewrite.match.inputs[0]] * bool(folded)
            after += sum(aval_bytes(v.aval) for v in (*rewrite.reads(), *outs))
        for fusion in p.fusions.values():
            seen = set()
            for eqn in fusion.fused.eqns:
                for v in (*eqn.invars, *eqn.outvars):
                    if not isinstance(v, Literal) and v not in seen:
                        seen.add(v)
                        before += aval_bytes(v.aval)
            after += sum(aval_bytes(v.aval) for v in (*fusion.inputs, *fusion.outputs))
    return before, after
