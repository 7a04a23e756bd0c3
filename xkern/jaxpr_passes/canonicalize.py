"""Canonicalization: one spelling for what people write several ways, so patterns see through it;
and dead equations found.

- Calls inlined: `jax.jit` inside a program (jax.nn.log_softmax is one) leaves a `jit` equation
  around its body; patterns would never see a body's equations next to their neighbours. So are the
  custom_vjp calls of libraries whose backward rule is their body's gradient (see below), written
  by hand to save memory (ANALYTIC_VJPS: t5x's and MaxText's cross_entropy_with_logits): the loss
  then meets the patterns, whose kernels have that gradient too, and its z-loss output (MaxText's
  and t5x's metrics) is computed from the rows' logsumexp the kernels give (Pattern.provides);
  where none takes it, jax differentiates the body, the same gradient, saving no more than the
  rule (which saves the exps and the log-probabilities). Their rules ignore the z-loss output's
  cotangent ("only used for logging"), so it is inlined behind a stop_gradient. (Their
  rule takes each row of targets to sum to 1, as a one-hot of a label in range does: for a label
  out of range, one_hot's row of zeros, it adds the row's softmax, which the body's gradient, and
  so xkern's, does not.)
- Squares: `x ** 2` and `x * x` become `square(x)` (XLA lowers all three to x * x).
- Scalars broadcast once: a broadcast of a broadcast of a scalar becomes one broadcast of the
  scalar (jax.vmap writes `broadcast(broadcast(0.0, [10]), [4, 10])` where the unmapped program
  has `broadcast(0.0, [4, 10])`: a per-example loss mapped over a batch); inside shard_map, where
  jax marks the first broadcast as varying over the mesh (pvary), the scalar is marked instead.
  But for a 1-D integer array of a literal, `jnp.full((b,), 20)`: jax.nn's lengths, which its
  patterns take as an input.
- Iotas made at their shape: a broadcast of an iota that keeps its counted axis becomes an iota of
  the broadcast's shape (jax.nn.one_hot mapped by jax.vmap writes `broadcast(iota([1, V]), [1, 1, V])`
  where the unmapped program has `iota([1, 1, V])`).
- Repeated elementwise equations merged: `(h - mean) * rsqrt(mean((h - mean) ** 2) + eps)` computes
  h - mean twice as written; a template computes it once. Only elementwise ones: a repeated matmul
  or reduction merged could become an intermediate shared by two patterns (softmax(x @ w) and
  log_softmax(x @ w) would share max(x @ w)), and a pattern whose intermediate is used outside it
  is declined.
- Swapped operands of batched products folded: `q @ k.swapaxes(-1, -2)` is a transpose then a
  dot_general; einsum writes q.k^T as one dot_general contracting the last dims. The swap goes into
  the product's dimension numbers (the transpose is then dead), so the matmul spelling of attention
  (nanoGPT's) meets the einsum templates.
- Softmaxes written by hand: `e = exp(x - max(x)); e / sum(e)` as jax.nn.softmax writes it (the
  maximum taken with -inf, its gradient stopped), so its patterns (and attention's) see one
  spelling. Only where nothing else reads the maximum, the exps or their sum: the softmax does not
  change when its inputs shift together, so no gradient flows through the maximum and stopping it
  changes nothing; `m + log(sum(exp(x - m)))` sharing them is another function. (A sum cast back
  before it is broadcast, bf16 `e / e.sum(-1)[..., None]`, is broadcast first, as below.) The
  stop_gradient is marked: where no kernel takes the softmax, the program runs it as
  the identity it was (_compat.run_equation), so its bf16 gradient is the one written.
- Weak types dropped, not cast: `convert_element_type` to a value's own dtype, only making a weakly
  typed value (`jnp.where(mask, 0., -1e9)`, a Python number's array) strongly typed, computes
  nothing, but stands between a pattern's equations (jax.nn.dot_product_attention casts such a
  bias; a strongly typed one it does not). Readers take the weak value; the program's outputs keep
  their types (cast back at the end where one became weak).
- Sums expanded where they are taken: a row sum without keepdims, taken through elementwise
  equations (`mean`, `+ eps`, `rsqrt`, a cast: other operands scalars) then given its unit dims back
  (`[..., None]`, as haliax writes its norms), is expanded first and the equations run on [..., 1],
  as keepdims=True computes it: both spellings become one. (The same values and gradients: an
  elementwise equation commutes with adding unit dims.) jnp.var's sum is inside its jit: where
  inlining exposes one, the program is re-traced once more.
- Slices that cut a value into consecutive pieces along one axis, all of it, become one split
  (`jnp.split`'s equation): `x[..., :h]` and `x[..., h:]` are the halves MaxText's rope and a GLU's
  one projection take with jnp.split. (Split's gradient is one concatenate, the slices' pads and
  adds: the same values.)
- Gathers along the last axis batched: jnp.take_along_axis gathers a batch axis of size 1 (one
  row; [B, 1, V] logits, one token per example) as a slice of it, not a batching dim as at every
  other size; it becomes the batched gather (its indices given a unit index dim), so
  cross-entropy's patterns see one spelling at every shape.
- Integer casts taken before broadcasts: `labels[..., None]` of int16 / uint8 / uint32 labels is
  broadcast, then cast to int32 by take_along_axis; the cast goes first (the same values), so the
  patterns' labels input is the int32 labels as the program's gather reads them.
- Marks removed: the identity equations that tell which aux outputs of a differentiated function
  the program reads (unread.py).
The program is re-traced through an interpreter that does all thirteen (source info kept).
Higher-order primitives with real semantics (cond, scan, while, remat, custom_jvp/vjp but those
above) are left alone: the rewrite recurses into them.
"""
from __future__ import annotations

import enum

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from xkern import _compat
from xkern.fusion.lowering import ELEMENTWISE
from xkern.jaxpr_passes.unread import aux_p

INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})
# (the backward rule's module, last part; its name) of custom_vjp functions inlined (see above)
ANALYTIC_VJPS = frozenset({("losses", "_cross_entropy_with_logits_bwd"),  # t5x.losses
                           ("max_utils", "_cross_entropy_with_logits_bwd")})  # MaxText.max_utils


def _inlined_body(eqn):
    """The body to inline in place of `eqn` (a call, or a custom_vjp of ANALYTIC_VJPS), else None."""
    if eqn.primitive.name in INLINED:
        return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if eqn.primitive.name == "custom_vjp_call":
        bwd = getattr(eqn.params.get("bwd"), "f", None)
        name = (getattr(bwd, "__module__", None) or "").rsplit(".", 1)[-1], getattr(bwd, "__name__", None)
        return eqn.params["call_jaxpr"] if name in ANALYTIC_VJPS else None
    return None


bind_equation = _compat.bind_equation


def _squared(eqn):
    """The operand x of an equation computing x ** 2 or x * x, else None."""
    name, args = eqn.primitive.name, eqn.invars
    if name == "integer_pow" and eqn.params.get("y") == 2:
        return args[0]
    if name == "mul" and not isinstance(args[0], Literal) and args[0] is args[1]:
        return args[0]
    return None


def _filled_from(eqn, filled: dict):
    """(scalar, its pvary or None) where `eqn` broadcasts a broadcast of that scalar (filled: each
    such broadcast's result -> the same), else None."""
    if eqn.primitive.name != "broadcast_in_dim" or isinstance(eqn.invars[0], Literal):
        return None
    return filled.get(eqn.invars[0])


def _note_filled(eqn, filled: dict, chain) -> None:
    """Records `eqn`'s result if it is a broadcast of a scalar (chain: the scalar it was folded to),
    or that broadcast marked as varying over the mesh. Not a 1-D array of an integer literal
    (`jnp.full((b,), 20)`): that is how jax.nn's lengths are given, an input of its patterns."""
    if eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], Literal) and len(
            eqn.outvars[0].aval.shape) == 1 and np.issubdtype(eqn.outvars[0].aval.dtype, np.integer):
        return
    if eqn.primitive.name == "broadcast_in_dim" and (chain or not eqn.invars[0].aval.shape):
        filled[eqn.outvars[0]] = chain or (eqn.invars[0], None)
    elif (eqn.primitive.name == "pvary" and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], Literal)
          and eqn.invars[0] in filled
          and filled[eqn.invars[0]][1] is None):
        filled[eqn.outvars[0]] = (filled[eqn.invars[0]][0], eqn)


def _broadcast_scalar(eqn, chain, read, source_info) -> list:
    """`eqn` (a broadcast of a broadcast of a scalar) as one broadcast of the scalar, marked as
    varying where the first broadcast was."""
    scalar, vary = chain
    value = read(scalar)
    if vary is not None:
        value = bind_equation(vary.replace(invars=[scalar], outvars=vary.outvars[:1]), [value],
                              source_info=source_info)[0]
    return bind_equation(eqn.replace(invars=[scalar], params={**eqn.params, "broadcast_dimensions": ()}), [value],
                         source_info=source_info)


def _slice_partitions(jaxpr) -> dict:
    """Slices that cut a value into consecutive pieces along one axis, the whole of it, nothing else
    of it sliced (repeats aside): each slice's result -> (the value, the axis, the pieces' sizes,
    its piece). jnp.split writes them as one `split` equation (MaxText's rope halves, a GLU's
    gate and up); slices are one spelling of the same."""
    by_value: dict = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "slice" and not isinstance(eqn.invars[0], Literal):
            by_value.setdefault(eqn.invars[0], []).append(eqn)
    parts = {}
    for x, eqns in by_value.items():
        shape = x.aval.shape
        cut = {d for e in eqns for d, (a, b) in enumerate(zip(e.params["start_indices"], e.params["limit_indices"]))
               if (a, b) != (0, shape[d])}
        if len(eqns) < 2 or len(cut) != 1 or any(any(s != 1 for s in e.params["strides"] or ()) for e in eqns):
            continue
        axis = cut.pop()
        pieces = sorted({(e.params["start_indices"][axis], e.params["limit_indices"][axis]) for e in eqns})
        if len(pieces) < 2 or pieces[0][0] != 0 or pieces[-1][1] != shape[axis] or any(
                a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
            continue
        sizes = tuple(b - a for a, b in pieces)
        for e in eqns:
            k = pieces.index((e.params["start_indices"][axis], e.params["limit_indices"][axis]))
            parts[e.outvars[0]] = (x, axis, sizes, k)
    return parts


def _read_vars(jaxpr) -> set:
    """The values some equation of `jaxpr` reads."""
    return {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)}


def _iota_broadcast(eqn, producers: dict):
    """`eqn` as one iota when it broadcasts an iota and keeps its counted axis's length (producers:
    each iota's result -> its equation), else None."""
    if eqn.primitive.name != "broadcast_in_dim" or isinstance(eqn.invars[0], Literal):
        return None
    iota = producers.get(eqn.invars[0])
    if iota is None:
        return None
    axis = eqn.params["broadcast_dimensions"][iota.params["dimension"]]
    if eqn.params["shape"][axis] != iota.params["shape"][iota.params["dimension"]]:
        return None  # (an iota of length 1 broadcast along its axis: zeros, not an iota)
    return eqn.replace(primitive=iota.primitive, invars=[], params={
        **iota.params, "shape": tuple(eqn.params["shape"]), "dimension": int(axis),
        "sharding": eqn.params.get("sharding")})


def _note_iota(eqn, producers: dict) -> None:
    if eqn.primitive.name == "iota":
        producers[eqn.outvars[0]] = eqn


def _folded_transpose(eqn, transposes: dict):
    """`eqn` reading the operand itself where it is a batched product of an operand whose last two
    dims a transpose swapped (`q @ k.swapaxes(-1, -2)`, which einsum writes as one dot_general), the
    swap folded into its dimension numbers; else None. (Not where both swapped dims are free: their
    order in the result would change. Products without batch dims, `h @ w.T`, stay as written.)"""
    if eqn.primitive.name != "dot_general" or not eqn.params["dimension_numbers"][1][0]:
        return None
    (contract, batch), invars, folded = map(list, eqn.params["dimension_numbers"]), list(eqn.invars), False
    for side in (0, 1):
        t = None if isinstance(invars[side], Literal) else transposes.get(invars[side])
        n = len(t.params["permutation"]) if t is not None else 0
        if t is None or tuple(t.params["permutation"]) != (*range(n - 2), n - 1, n - 2):
            continue
        if not {n - 2, n - 1} & {*contract[side], *batch[side]}:
            continue
        swap = lambda dims, n=n: tuple(2 * n - 3 - d if d >= n - 2 else d for d in dims)  # n-2 <-> n-1
        contract[side], batch[side], invars[side], folded = swap(contract[side]), swap(batch[side]), t.invars[0], True
    if not folded:
        return None
    return eqn.replace(invars=invars, params={**eqn.params, "dimension_numbers": (tuple(contract), tuple(batch))})


def _take_along_unit_axes(eqn) -> bool:
    """Whether `eqn` is jnp.take_along_axis's gather along the last axis of an operand [..., V] whose
    batch axes of size 1 are slices (offset dims at their own places) and the others batching dims
    in order, one index a position (see _batched_gather)."""
    if eqn.primitive.name != "gather":
        return False
    operand, indices, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
    n, dims = len(operand.shape), eqn.params["dimension_numbers"]
    batch = tuple(dims.operand_batching_dims)
    unit = tuple(a for a in range(n - 1) if a not in batch)
    return (bool(unit) and tuple(dims.offset_dims) == unit and all(operand.shape[a] == 1 for a in unit)
            and batch == tuple(sorted(batch)) and tuple(dims.start_indices_batching_dims) == tuple(range(len(batch)))
            and tuple(dims.collapsed_slice_dims) == (n - 1,) and tuple(dims.start_index_map) == (n - 1,)
            and tuple(eqn.params["slice_sizes"]) == (1,) * n and indices.shape[-1:] == (1,)
            and len(out.shape) == n and tuple(out.shape[:-1]) == tuple(operand.shape[:-1]))


def _batched_gather(eqn, operand, indices, source_info) -> list:
    """_take_along_unit_axes's gather as take_along_axis writes it where those axes are longer:
    every batch axis a batching dim, the indices one reshape to [..., K, 1] (the unit axes' places,
    of size 1, keep the indices' order; indices: the values before their reshape, where they have one)."""
    out, n = eqn.outvars[0].aval, len(eqn.invars[0].aval.shape)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(n - 1,), start_index_map=(n - 1,),
                                          operand_batching_dims=tuple(range(n - 1)),
                                          start_indices_batching_dims=tuple(range(n - 1)))
    with _compat.user_context(source_info or eqn.source_info):
        indices = jax.lax.reshape(indices, (*out.shape, 1))
    return bind_equation(eqn, [operand, indices], params={**eqn.params, "dimension_numbers": dims},
                         source_info=source_info)


def _integer_cast(eqn) -> bool:
    integer = lambda dtype: np.issubdtype(dtype, np.integer)
    return eqn.primitive.name == "convert_element_type" and not isinstance(eqn.invars[0], Literal) and \
        integer(eqn.invars[0].aval.dtype) and integer(eqn.params["new_dtype"])


def _broadcast(eqn) -> bool:
    return eqn.primitive.name == "broadcast_in_dim" and not isinstance(eqn.invars[0], Literal)


def _note_transpose(eqn, producers: dict) -> None:
    if eqn.primitive.name == "transpose":
        producers[eqn.outvars[0]] = eqn


def _only_reader(var, readers: dict, name: str | None = None):
    """The one equation that reads `var` (of primitive `name`, if given), else None (also where the
    program's outputs, None in `readers`, are its only reader)."""
    found = readers.get(var, ())
    if len(found) != 1 or found[0] is None or (name and found[0].primitive.name != name):
        return None
    return found[0]


def _through(var, readers: dict, names: set):
    """(the value reached, the one equation reading it, the primitives passed) from var along its
    only readers while they are of `names`."""
    reader, passed = _only_reader(var, readers), []
    while reader is not None and reader.primitive.name in names:
        var, passed = reader.outvars[0], passed + [reader.primitive.name]
        reader = _only_reader(var, readers)
    return var, reader, passed


def _readers(jaxpr) -> dict:
    """{value: the equations reading it, None for each time it is an output of `jaxpr`}."""
    readers = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                readers.setdefault(v, []).append(eqn)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            readers.setdefault(v, []).append(None)
    return readers


def _hand_softmaxes(jaxpr) -> dict:
    """{maximum: its broadcast (keepdims)} of the softmaxes written by hand in `jaxpr`: max(x) along
    some axes, broadcast, subtracted from x, exp, divided by its own sum along those axes (converts
    around the sum allowed, as jnp.sum of bf16 writes them; a cast before the broadcast,
    `e / e.sum(-1)[..., None]` in bf16, is moved after it by _late_expansions), nothing else reading
    any of them."""
    readers = _readers(jaxpr)
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "reduce_max" or not jax.numpy.issubdtype(eqn.invars[0].aval.dtype, jax.numpy.floating):
            continue
        x, axes = eqn.invars[0], tuple(eqn.params["axes"])
        keep = _only_reader(eqn.outvars[0], readers, "broadcast_in_dim")
        shift = keep and _only_reader(keep.outvars[0], readers, "sub")
        exp = shift and shift.invars == [x, keep.outvars[0]] and _only_reader(shift.outvars[0], readers, "exp")
        if not exp or tuple(keep.outvars[0].aval.shape) != tuple(1 if i in axes else n
                                                                for i, n in enumerate(x.aval.shape)):
            continue
        exps = readers.get(exp.outvars[0], [])
        div = [r for r in exps if r is not None and r.primitive.name == "div" and r.invars[0] is exp.outvars[0]]
        rest = [r for r in exps if r not in div]
        if len(div) != 1 or len(rest) != 1 or rest[0] is None:
            continue
        total = rest[0]
        if total.primitive.name == "convert_element_type":
            total = _only_reader(total.outvars[0], readers)
        if total is None or total.primitive.name != "reduce_sum" or tuple(total.params["axes"]) != axes:
            continue
        var, reader, passed = _through(total.outvars[0], readers, {"convert_element_type", "broadcast_in_dim"})
        if reader is not div[0] or div[0].invars[1] is not var or passed.count("broadcast_in_dim") != 1:
            continue
        found[eqn.outvars[0]] = keep.outvars[0]
    return found


def _kept_dims(reduction) -> tuple:
    """The dims of a reduction's operand that its result keeps."""
    return tuple(i for i in range(reduction.invars[0].aval.ndim) if i not in reduction.params["axes"])


def _expansion(eqn, var, shape, kept: tuple) -> bool:
    """Whether `eqn` only gives `var` unit dims back, to `shape` (`[..., None]`, jnp.expand_dims or a
    reshape; kept: the dims of `shape` that `var` has)."""
    if eqn is None or len(eqn.outvars) != 1 or eqn.invars[0] is not var or tuple(eqn.outvars[0].aval.shape) != shape:
        return False  # (an equation of no result reads it too: jax.debug.print's)
    if eqn.primitive.name == "broadcast_in_dim":
        return tuple(eqn.params["broadcast_dimensions"]) == kept
    return eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is None


def _late_expansion(reduction, readers: dict, producers: dict):
    """(the sum `reduction` and the elementwise equations after it, {a broadcast scalar they read:
    its broadcast}, the expansions that give the last one the sum's unit dims back) where its result
    gets them back late (see the module's docstring), else None. Each value on the way is read by
    the next equation only: the narrow one is not needed."""
    var, kept = reduction.outvars[0], _kept_dims(reduction)
    wide = tuple(n if i in kept else 1 for i, n in enumerate(reduction.invars[0].aval.shape))
    chain, scalars = [reduction], {}
    while not all(_expansion(r, var, wide, kept) for r in readers.get(var) or [None]):
        reader = _only_reader(var, readers)
        if (reader is None or reader.primitive.name not in ELEMENTWISE or reader.effects
                or reader.outvars[0].aval.shape != var.aval.shape):
            return None
        for v in reader.invars:  # the others: literals and scalars, or scalars broadcast (again, wide)
            if v is var or isinstance(v, Literal) or not v.aval.shape:
                continue
            producer = producers.get(v)
            if producer is None or producer.primitive.name != "broadcast_in_dim" or producer.invars[0].aval.shape:
                return None
            scalars[v] = producer
        chain.append(reader)
        var = reader.outvars[0]
    return chain, scalars, readers[var]


def _late_expansions(jaxpr) -> tuple[dict, dict, dict]:
    """The row sums of `jaxpr` that get their unit dims back late, as (widened, scalars, expansions):
    widened {the sum's result and each result after it: its shape with the unit dims}, the values to
    compute wide; scalars {a broadcast scalar those read: its broadcast}, to broadcast wide instead;
    expansions {an expansion's result: the wide value it is}."""
    readers, producers = _readers(jaxpr), {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    widened, scalars, expansions = {}, {}, {}
    for eqn in jaxpr.eqns:
        found = eqn.primitive.name == "reduce_sum" and _late_expansion(eqn, readers, producers)
        # (a sum expanded at once is written as keepdims writes it, unless by a reshape)
        if found and (len(found[0]) > 1 or any(r.primitive.name == "reshape" for r in found[2])):
            chain, chain_scalars, found_expansions = found
            wide = found_expansions[0].outvars[0].aval.shape
            widened.update((e.outvars[0], wide) for e in chain)
            scalars.update(chain_scalars)
            expansions.update((r.outvars[0], chain[-1].outvars[0]) for r in found_expansions)
    return widened, scalars, expansions


def _weak_cast(eqn, eqn_reads: set) -> bool:
    """Whether `eqn` only makes a weakly typed value strongly typed (the same dtype) for equations
    (eqn_reads: the values equations read) to read. (One only an output reads stays: the cast back.)"""
    if (eqn.primitive.name != "convert_element_type" or isinstance(eqn.invars[0], Literal)
            or eqn.outvars[0] not in eqn_reads):
        return False
    aval = eqn.invars[0].aval
    return aval.weak_type and not eqn.params.get("weak_type") and aval.dtype == eqn.params["new_dtype"]


def _plain(value) -> bool:
    """Whether a param is plain data (so equal params mean the same computation), not a jaxpr or a
    function."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return value is None or isinstance(value, (bool, int, float, str, np.dtype, enum.Enum))


def _cse_key(eqn, operands):
    """What identifies an elementwise `eqn`'s result among the program's (its primitive, params and
    operands), or None (not elementwise, effects, params that are not plain data)."""
    if (eqn.primitive.name not in ELEMENTWISE or eqn.effects
            or not all(map(_plain, eqn.params.values()))):
        return None
    return (eqn.primitive, tuple(sorted(eqn.params.items())), operands)


def _literal_key(v: Literal):
    value = np.asarray(v.val)
    return ("literal", value.dtype.str, value.shape, value.tobytes())


def _inline_eval(jaxpr, consts, args, source_info=None, seen=None, broadcasts=None) -> list:
    """Evaluate `jaxpr` canonically (calls inlined, squares as `square`, repeated equations computed
    once); inlined equations take the call's source info (the user's line, where the body's own
    would point inside a library)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    seen = {} if seen is None else seen  # CSE key -> (outputs, operands)
    broadcasts = {} if broadcasts is None else broadcasts  # id(a broadcast's value) -> (its eqn, operand, value)
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    filled, iotas, transposes, reshapes, eqn_reads = {}, {}, {}, {}, _read_vars(jaxpr)
    softmax_maxima = _hand_softmaxes(jaxpr)
    kept_maxima = set(softmax_maxima.values())
    widened, scalars, expansions = _late_expansions(jaxpr)
    partitions, splits = _slice_partitions(jaxpr), {}  # (the value, axis) -> its split's pieces
    for eqn in jaxpr.eqns:
        if eqn.outvars and eqn.outvars[0] in expansions:  # (computed wide already)
            env[eqn.outvars[0]] = read(expansions[eqn.outvars[0]])
            continue
        if eqn.outvars and eqn.outvars[0] in softmax_maxima:
            env[eqn.outvars[0]] = jax.numpy.max(read(eqn.invars[0]), axis=tuple(eqn.params["axes"]),
                                                initial=-np.inf)  # (jax.nn.softmax's spelling)
            continue
        if eqn.outvars and eqn.outvars[0] in kept_maxima:  # (marked: run as written, it passes gradients)
            kept = bind_equation(eqn, [read(v) for v in eqn.invars], source_info=source_info)[0]
            with jax.named_scope(_compat.HAND_SOFTMAX_SCOPE):
                env[eqn.outvars[0]] = jax.lax.stop_gradient(kept)
            continue
        if eqn.outvars and eqn.outvars[0] in partitions:  # (one split, where the first piece was)
            x, axis, sizes, k = partitions[eqn.outvars[0]]
            if (x, axis) not in splits:
                splits[x, axis] = bind_equation(eqn.replace(primitive=jax.lax.split_p), [read(x)],
                                                params={"sizes": sizes, "axis": axis}, source_info=source_info)
            env[eqn.outvars[0]] = splits[x, axis][k]
            continue
        if _weak_cast(eqn, eqn_reads) or eqn.primitive is aux_p:
            env[eqn.outvars[0]] = read(eqn.invars[0])
            continue
        if _take_along_unit_axes(eqn):
            indices = reshapes[eqn.invars[1]].invars[0] if eqn.invars[1] in reshapes else eqn.invars[1]
            env[eqn.outvars[0]] = _batched_gather(eqn, read(eqn.invars[0]), read(indices), source_info)[0]
            continue
        if _integer_cast(eqn) and id(read(eqn.invars[0])) in broadcasts:  # (cast first, then broadcast)
            broadcast, operand, _ = broadcasts[id(read(eqn.invars[0]))]
            cast = bind_equation(eqn.replace(invars=broadcast.invars), [operand], source_info=source_info)
            env[eqn.outvars[0]] = bind_equation(broadcast, cast, source_info=source_info)[0]
            continue
        if eqn.primitive.name == "reshape" and not isinstance(eqn.invars[0], Literal):
            reshapes[eqn.outvars[0]] = eqn
        squared = _squared(eqn)
        if squared is not None:
            eqn = eqn.replace(primitive=jax.lax.square_p, invars=[squared], params={})
        eqn = _iota_broadcast(eqn, iotas) or _folded_transpose(eqn, transposes) or eqn
        _note_iota(eqn, iotas)
        _note_transpose(eqn, transposes)
        chain = _filled_from(eqn, filled)
        _note_filled(eqn, filled, chain)
        if chain is not None:
            env.update(zip(eqn.outvars, _broadcast_scalar(eqn, chain, read, source_info)))
            continue
        invals = [read(v) for v in eqn.invars]
        sub = _inlined_body(eqn)
        if sub is not None:
            body, body_consts = (sub.jaxpr, sub.consts) if isinstance(sub, ClosedJaxpr) else (sub, [])
            outs = _inline_eval(body, body_consts, invals, source_info or eqn.source_info, seen, broadcasts)
            if eqn.primitive.name == "custom_vjp_call":  # (their rules ignore the other outputs' cotangents)
                outs = outs[:1] + [jax.lax.stop_gradient(v) for v in outs[1:]]
            env.update(zip(eqn.outvars, outs))
            continue
        shape = widened.get(eqn.outvars[0]) if eqn.outvars else None
        if shape is not None:  # (after a sum expanded early: its scalars broadcast to its wide shape)
            invals = [bind_equation(scalars[v], [read(scalars[v].invars[0])], source_info=source_info,
                                    params={**scalars[v].params, "shape": shape})[0]
                      if not isinstance(v, Literal) and v in scalars else val for v, val in zip(eqn.invars, invals)]
        key = _cse_key(eqn, tuple(_literal_key(v) if isinstance(v, Literal) else id(val)
                                  for v, val in zip(eqn.invars, invals)))
        if key is not None and key in seen:
            outs = seen[key][0]
        else:
            outs = bind_equation(eqn, invals, source_info=source_info)
            if key is not None:
                seen[key] = (outs, invals)  # invals kept alive: their ids are in the key
        if shape is not None and eqn.primitive.name == "reduce_sum":  # its unit dims back, as keepdims
            outs = [jax.lax.broadcast_in_dim(outs[0], shape, _kept_dims(eqn))]
        env.update(zip(eqn.outvars, outs))
        if _broadcast(eqn):  # (by value: a cast inside an inlined body finds it)
            broadcasts[id(outs[0])] = (eqn, invals[0], outs[0])
    # (an output that a dropped cast left weakly typed is cast as the program's was)
    return [read(v) if isinstance(v, Literal) else _compat.typed_as(read(v), v.aval) for v in jaxpr.outvars]


def _needs_rewriting(jaxpr) -> bool:
    """Whether canonicalizing would change `jaxpr` (calls, squares spelled otherwise, repeats)."""
    if _hand_softmaxes(jaxpr) or _late_expansions(jaxpr)[0] or _slice_partitions(jaxpr):
        return True
    keys, filled, iotas, transposes, broadcasts, eqn_reads = set(), {}, {}, {}, set(), _read_vars(jaxpr)
    for eqn in jaxpr.eqns:
        if (_inlined_body(eqn) is not None or _squared(eqn) is not None or _filled_from(eqn, filled)
                or _weak_cast(eqn, eqn_reads) or eqn.primitive is aux_p or _take_along_unit_axes(eqn)
                or (_integer_cast(eqn) and eqn.invars[0] in broadcasts)
                or _iota_broadcast(eqn, iotas) or _folded_transpose(eqn, transposes)):
            return True
        if _broadcast(eqn):
            broadcasts.add(eqn.outvars[0])
        _note_filled(eqn, filled, None)
        _note_iota(eqn, iotas)
        _note_transpose(eqn, transposes)
        key = _cse_key(eqn, tuple(_literal_key(v) if isinstance(v, Literal) else v for v in eqn.invars))
        if key is not None:
            if key in keys:
                return True
            keys.add(key)
    return False


def canonicalize(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` in canonical form (the same jaxpr when it already is)."""
    if not _needs_rewriting(closed.jaxpr):
        return closed
    retrace = lambda c: jax.make_jaxpr(lambda *args: _inline_eval(c.jaxpr, c.consts, args))(
        *[v.aval for v in c.jaxpr.invars])
    closed = retrace(closed)
    # once more where inlining exposed a sum expanded late (jnp.var's, inside its jit), so that
    # repeats it leaves (`x - mean[..., None]` written twice) are merged too
    return retrace(closed) if _late_expansions(closed.jaxpr)[0] else closed


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
