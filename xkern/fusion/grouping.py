"""Fusion grouping: the equations no named pattern took, gathered into groups that one generated
row kernel can compute.

A group iterates over a shape S = R + (C,): rows R, a last axis C. Each value in it has a kind:
  full   shape S                       (a [BLOCK_M, BLOCK_N] tile in the kernel)
  row    shape R or R + (1,)           (one value per row: [BLOCK_M, 1]; reductions make these)
  col    shape (1,..,1, C) or (C,)       (one value per column: [1, BLOCK_N]; never an output)
  scalar shape ()                      (an input or literal)
Elementwise equations combine kinds as numpy broadcasting does (jaxprs broadcast size-1 axes:
full op row -> full, row op col -> full); broadcast_in_dim turns row, col or scalar values into
wider ones; reduce_sum/max/min over the last axis turn full values into rows.
"""
from __future__ import annotations

import dataclasses
import heapq

from jax.extend.core import Literal

from xkern.fusion import lowering


@dataclasses.dataclass
class Group:
    shape: tuple  # S
    eqns: list[int] = dataclasses.field(default_factory=list)
    kinds: dict = dataclasses.field(default_factory=dict)  # var produced in the group -> kind
    inputs: list = dataclasses.field(default_factory=list)  # (var, kind), in first-use order
    outputs: list = dataclasses.field(default_factory=list)  # (var, kind)

    @property
    def rows(self) -> tuple:
        return self.shape[:-1]

    @property
    def n_cols(self) -> int:
        return self.shape[-1]


def _shape_kind(shape, S) -> str | None:
    shape, R = tuple(shape), tuple(S[:-1])
    if shape == tuple(S):
        return "full"
    if shape == ():
        return "scalar"
    if shape in (R, R + (1,)):
        return "row"
    if len(S) >= 2 and shape == (1,) * (len(S) - 1) + (S[-1],):
        return "col"
    return None


def _combine(kinds) -> str | None:
    shaped = {k for k in kinds if k != "scalar"}
    if not shaped:
        return None  # scalar arithmetic stays with XLA
    if "full" in shaped or shaped == {"row", "col"}:
        return "full"
    return shaped.pop()


def _operand_kind(v, group: Group) -> str | None:
    if isinstance(v, Literal):
        return "scalar" if v.aval.shape == () else None
    return group.kinds.get(v) or _shape_kind(v.aval.shape, group.shape)


def eqn_kinds(eqn, group: Group) -> tuple[list, str] | None:
    """The kinds of `eqn`'s operands and output inside `group`, or None if it does not fit."""
    name, S = eqn.primitive.name, group.shape
    nd = len(S)
    if name in lowering.ELEMENTWISE:
        kinds = [_operand_kind(v, group) for v in eqn.invars]
        out = None if None in kinds else _combine(kinds)
        if out is None or _shape_kind(eqn.outvars[0].aval.shape, S) != out:
            return None
        return kinds, out
    if name == "broadcast_in_dim":
        (v,), out_shape, dims = eqn.invars, tuple(eqn.outvars[0].aval.shape), eqn.params["broadcast_dimensions"]
        shape = tuple(v.aval.shape)
        out_kind = _shape_kind(out_shape, S)
        if out_kind is None or isinstance(v, Literal) and shape != ():
            return None
        if shape == ():
            kind = "scalar"
        elif out_kind in ("full", "col") and shape == (S[-1],) and tuple(dims) == (nd - 1,) and \
                group.kinds.get(v, "col") == "col":  # (a row value of a square group is not one per column)
            kind = "col"
        elif group.kinds.get(v, "row") == "row" and _shape_kind(shape, S) == "row" and \
                tuple(dims) == tuple(range(len(shape))):
            kind = "row"
        else:
            return None
        return [kind], out_kind
    if name in ("reshape", "squeeze", "expand_dims"):
        (v,) = eqn.invars[:1]
        if _operand_kind(v, group) == "row" and _shape_kind(eqn.outvars[0].aval.shape, S) == "row":
            return ["row"], "row"
        return None
    if name in lowering.REDUCTIONS:
        (v,) = eqn.invars
        if tuple(eqn.params["axes"]) == (nd - 1,) and _operand_kind(v, group) == "full":
            return ["full"], "row"
    return None


def find_groups(graph, live: set[int], claimed: set[int]) -> tuple[list[Group], list[tuple[int, str]]]:
    """Groups of fusable equations, and (equation, reason) for candidates that were left out."""
    groups: list[Group] = []
    owner: dict[int, Group] = {}  # eqn index -> its group
    producer_group = {}  # var -> group
    for i, eqn in enumerate(graph.eqns):
        if i not in live or i in claimed or lowering.supported(eqn) or len(eqn.outvars) != 1:
            continue
        candidates = [producer_group[v] for v in eqn.invars
                      if not isinstance(v, Literal) and v in producer_group]
        target = None
        for g in candidates:
            if eqn_kinds(eqn, g):
                target = g
                break
        if target is None:
            out_shape = tuple(eqn.outvars[0].aval.shape)
            shape = tuple(eqn.invars[0].aval.shape) if eqn.primitive.name in lowering.REDUCTIONS \
                else out_shape
            if not shape:
                continue
            target = Group(shape)
            if not eqn_kinds(eqn, target):
                continue
            groups.append(target)
        kinds, out_kind = eqn_kinds(eqn, target)
        target.eqns.append(i)
        target.kinds[eqn.outvars[0]] = out_kind
        owner[i] = target
        producer_group[eqn.outvars[0]] = target
        for v, kind in zip(eqn.invars, kinds):
            if not isinstance(v, Literal) and v not in target.kinds and (v, kind) not in target.inputs:
                target.inputs.append((v, kind))
    groups = _merge(groups, graph, live)
    kept, left = [], []
    for g in groups:
        reason = _finish(g, graph, live)
        if reason:
            left.append((g.eqns[-1], reason))
        else:
            kept.append(g)
    return kept, left


def _order_ok(group: Group, graph, live: set[int]) -> bool:
    """Whether every result used outside the group is used only after the group's last equation."""
    inside, last = set(group.eqns), group.eqns[-1]
    return all(c > last for i in group.eqns for c in graph.consumers.get(graph.eqns[i].outvars[0], ())
               if c in live and c not in inside)


def _merge(groups: list[Group], graph, live: set[int]) -> list[Group]:
    """Merge groups over the same shape that read a common input or one another's results, so one
    pass over the data produces all their outputs (a multi-output kernel). Each group takes in turn
    every later one it can, growing as it goes; passes repeat until none merges (a grown group may
    relate to one it passed), each pass linear in the pairs (a restart after every merge made a
    32-layer training step's planning take minutes)."""
    def reads(g: Group) -> set:
        return {v for v, _ in g.inputs}

    changed = True
    while changed:
        changed = False
        x = 0
        while x < len(groups):  # (groups shrink as they merge)
            a, a_in = groups[x], reads(groups[x])
            y = x + 1
            while y < len(groups):
                b = groups[y]
                if a.shape == b.shape:
                    b_in = reads(b)
                    if a_in & b_in or a_in & b.kinds.keys() or b_in & a.kinds.keys():
                        union = Group(a.shape, sorted(a.eqns + b.eqns), {**a.kinds, **b.kinds})
                        union.inputs = list(dict.fromkeys((v, k) for v, k in a.inputs + b.inputs
                                                          if v not in union.kinds))
                        if _order_ok(union, graph, live):
                            groups[x], a, a_in = union, union, reads(union)
                            del groups[y]
                            changed = True
                            continue
                y += 1
            x += 1
    return groups


def _finish(group: Group, graph, live: set[int]) -> str | None:
    """Fill in the group's outputs; a reason if it cannot be one kernel."""
    inside, last = set(group.eqns), group.eqns[-1]
    compute = [i for i in group.eqns if graph.eqns[i].primitive.name not in lowering.SHAPE_OPS]
    if len(compute) < 2:
        return "a single operation: nothing to fuse"
    for i in group.eqns:
        v = graph.eqns[i].outvars[0]
        users = [c for c in graph.consumers.get(v, ()) if c in live and c not in inside]
        if any(c < last for c in users):
            return "a result is needed outside the group before the group ends"
        if users or v in graph.outvars:
            kind = group.kinds[v]
            if kind not in ("full", "row"):
                return f"a {kind} result leaves the group"
            group.outputs.append((v, kind))
    if group.n_cols > 16384:
        return f"rows of {group.n_cols} are longer than the one-block template takes (16384)"
    if group.n_cols == 0:  # (a max over no columns is -inf: XLA's to give)
        return "rows of 0 elements: nothing to fuse"
    return None


def supported_dot(eqn) -> bool:
    """A dot_general the matmul template takes: [..., K] @ [K, N], one float dtype, no batch dims, K
    and N not 0 (an empty contraction's zeros, or an empty product, are XLA's to make)."""
    if eqn.primitive.name != "dot_general":
        return False
    lhs, rhs = eqn.invars
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dtypes = {lowering.dtype_name(lhs.aval), lowering.dtype_name(rhs.aval)}
    return (len(rhs.aval.shape) == 2 and min(rhs.aval.shape) > 0 and len(lhs.aval.shape) >= 2
            and tuple(lc) == (len(lhs.aval.shape) - 1,)
            and tuple(rc) == (0,) and not lb and not rb and len(dtypes) == 1
            and dtypes <= lowering.FLOATS and lowering.dtype_name(eqn.outvars[0].aval) in lowering.FLOATS
            and not isinstance(lhs, Literal) and not isinstance(rhs, Literal))


def matmul_epilogues(graph, live: set[int], claimed: set[int]) -> list[tuple[int, Group]]:
    """(dot equation, epilogue group) pairs: the elementwise equations that consume a matmul's result
    (bias, activation, scaling, residual, casts), to run on its tiles before they are stored."""
    found = []
    taken = set(claimed)
    for d, dot in enumerate(graph.eqns):
        if d not in live or d in taken or not supported_dot(dot):
            continue
        out = dot.outvars[0]
        group = Group(tuple(out.aval.shape), inputs=[(out, "full")])
        group.kinds[out] = "full"
        # the equations that read the group, in program order: its values' consumers, not a scan of
        # every later equation for each matmul (quadratic in the program's length)
        reading, seen = list(graph.consumers.get(out, ())), set()
        while reading:
            i = heapq.heappop(reading)
            if i in seen:  # (an equation reading two of the group's values)
                continue
            seen.add(i)
            eqn = graph.eqns[i]
            if (i not in live or i in taken or len(eqn.outvars) != 1 or eqn.primitive.name in lowering.REDUCTIONS
                    or lowering.supported(eqn)):
                continue
            fits = eqn_kinds(eqn, group)
            if not fits or fits[1] != "full":
                continue
            group.eqns.append(i)
            group.kinds[eqn.outvars[0]] = "full"
            for c in graph.consumers.get(eqn.outvars[0], ()):  # (all after i: equations are in order)
                heapq.heappush(reading, c)
            for v, kind in zip(eqn.invars, fits[0]):
                if not isinstance(v, Literal) and v not in group.kinds and (v, kind) not in group.inputs:
                    group.inputs.append((v, kind))
        inside = set(group.eqns)
        if not group.eqns or graph.escapes(out, inside) or not _order_ok(group, graph, live):
            continue
        for i in group.eqns:
            v = graph.eqns[i].outvars[0]
            if v in graph.outvars or any(c in live and c not in inside for c in graph.consumers.get(v, ())):
                group.outputs.append((v, "full"))
        found.append((d, group))
        taken |= inside | {d}
    return found
