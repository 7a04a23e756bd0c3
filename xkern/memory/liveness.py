"""Memory planning: live ranges over a planned program, kernels that write over inputs which die at
them, and an estimate of peak live bytes before and after rewriting.

A value dies at the equation that reads it last. In a plan, an equation that a rewrite or a fusion
absorbed is read where that kernel runs (its anchor, or its group's last equation), so positions
are those of execution. A generated kernel may write an output over a same-shaped, same-typed
input that dies there (input_output_aliases): a program input or output never does (XLA would copy
an input it was not given to donate, and an output must survive).

The peak is an estimate over the jaxpr's own order, not XLA's schedule and fusion (XLA never
materializes the inside of its fusions, so it overstates an unfused program): the inputs are held
throughout, each equation's outputs from that equation to their last use, and an in-place
kernel's aliased outputs take no new memory. What XLA drops is not counted: an equation whose
outputs nothing reads, and a call's input that its body does not read (a rewrite that may run as
written keeps the matched program's inputs for that path: T5's summed bias, unread where the
kernels run).
"""
from __future__ import annotations

from jax.extend.core import Var

from xkern.jaxpr_passes.graph import Graph, aval_bytes


def execution_positions(plan) -> dict[int, int]:
    """Equation index -> the index at which it actually runs in the rewritten program."""
    at = {i: plan.deferred.get(i, i) for i in plan.live}
    for anchor, rewrite in plan.rewrites.items():
        for i in rewrite.match.program_eqns | ({rewrite.residual_add} - {None}):
            at[i] = anchor
    for last, fusion in plan.fusions.items():
        for i in fusion.fused.group.eqns:
            at[i] = last
        if fusion.fused.k:  # the matmul the epilogue's kernel computes
            at[Graph(plan.closed.jaxpr).producer[fusion.fused.eqns[0].outvars[0]][0]] = last
    return at


def dying_inputs(plan, graph: Graph, position: int, inputs) -> set:
    """The inputs (program values) read by the kernel at `position` that nothing reads afterwards."""
    at = execution_positions(plan)
    dead = set()
    for v in inputs:
        if not isinstance(v, Var) or v in graph.invars or v in graph.outvars:
            continue
        reads = [at[c] for c in graph.consumers.get(v, ()) if c in at]
        if reads and max(reads) == position:
            dead.add(v)
    return dead


def plan_in_place(plan) -> None:
    """Give each generated kernel of `plan` (and of its sub-plans) the outputs it may write over
    inputs that die at it: a full-size output over a full-size input of the same shape and dtype."""
    for p in plan.walk():
        if not p.fusions:
            continue
        graph = Graph(p.closed.jaxpr)
        for position, fusion in p.fusions.items():
            fused = fusion.fused
            dead = dying_inputs(p, graph, position, fused.input_vars)
            free = [n for n, (v, kind) in enumerate(zip(fused.input_vars, fused.input_kinds))
                    if kind == "full" and v in dead]
            aliases = {}
            for o, (kind, aval) in enumerate(zip(fused.output_kinds, fused.output_avals)):
                match = next((n for n in free if fused.input_vars[n].aval.shape == aval.shape
                              and fused.input_vars[n].aval.dtype == aval.dtype), None)
                if kind == "full" and match is not None:
                    aliases[match] = o
                    free.remove(match)
            fusion.aliases = aliases


def peak_live_bytes(jaxpr) -> int:
    """Estimated peak bytes of values live at once (inputs, constants and intermediates), in the
    jaxpr's order; kernels that write in place (xkern_kernel with aliases) add nothing for those."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    graph = Graph(jaxpr)
    running = _running(jaxpr)
    last = {v: -1 for v in graph.producer}
    for i in running:
        for v in _read_inputs(graph.eqns[i]):
            last[v] = i
    for v in graph.outvars:
        last[v] = len(graph.eqns)
    live = sum(aval_bytes(v.aval) for v in graph.invars)
    peak = live
    for i in sorted(running):
        eqn = graph.eqns[i]
        aliases = _aliases(eqn)
        reused = {eqn.invars[a] for a, _ in aliases}  # their memory lives on as the outputs
        live += sum(aval_bytes(v.aval) for k, v in enumerate(eqn.outvars) if k not in {o for _, o in aliases})
        peak = max(peak, live)
        for v in {v for v in _read_inputs(eqn) if last.get(v) == i} - reused - graph.invars:
            live -= aval_bytes(v.aval)  # (the caller holds the program's inputs throughout)
        live -= sum(aval_bytes(v.aval) for v in eqn.outvars if last.get(v, -1) == -1)  # never read
    return peak


def _running(jaxpr) -> set[int]:
    """The equations whose outputs the program's outputs need (or that have effects)."""
    needed, running = {v for v in jaxpr.outvars if isinstance(v, Var)}, set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            running.add(i)
            needed.update(_read_inputs(eqn))
    return running


def _read_inputs(eqn) -> list:
    """The inputs `eqn` reads: of a call (custom_vjp_call, jit), those its body reads."""
    body = _body(eqn)
    if body is None or len(body.invars) != len(eqn.invars):
        return [v for v in eqn.invars if isinstance(v, Var)]
    running = _running(body)
    read = {v for i in running for v in _read_inputs(body.eqns[i])} | {v for v in body.outvars if isinstance(v, Var)}
    return [v for v, inner in zip(eqn.invars, body.invars) if isinstance(v, Var) and inner in read]


def _body(eqn):
    """The jaxpr a call equation runs, or None."""
    body = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    body = getattr(body, "jaxpr", body)
    return body if hasattr(body, "eqns") else None


def _aliases(eqn) -> list[tuple[int, int]]:
    """(input, output) positions of `eqn` whose output is written over the input: an in-place
    kernel, or a call (custom_vjp_call, jit) whose body passes one through."""
    if eqn.primitive.name == "xkern_kernel":
        return list(eqn.params.get("aliases", ()))
    body = _body(eqn)
    if body is None:
        return []
    pairs = []
    for inner in body.eqns:
        for a, o in _aliases(inner):
            source, result = inner.invars[a], inner.outvars[o]
            if source in body.invars and result in body.outvars:
                pairs.append((body.invars.index(source), body.outvars.index(result)))
    return pairs
