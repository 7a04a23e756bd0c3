"""Kernels in sharded programs: each launch splits along its arrays' leading dim, as they are sharded.

A custom call is opaque to XLA's partitioner (Shardy or GSPMD): left alone, each launch in a program
over several devices would gather its operands onto every device and compute the whole array there,
and hand back a replicated result. So each op family says how its kernels split
(`launch.def_split`): which operands and outputs have the split dim as dim 0 (the rows of a row
kernel, the batch of attention), which are the same on every device (a norm's scale), and how to
launch the kernel again on one device's share. A launch in a program over several devices is
lowered through jax's custom_partitioning with that rule: the leading dim keeps the sharding it
has (data parallelism: the batch), every other dim is gathered, and each device launches the kernel
on its own rows. A family may name a second split, of heads (attention's and rope's: tensor
parallelism shards q's and k/v's heads over a "model" axis) or of columns (generated kernels' and
GLUs': the features of x @ w1, w1 sharded by column): each device then launches on its examples and
its heads or columns, and an output reduced along them (a generated row sum; attention's dk and dv
where its queries split along a sharded sequence) is all-reduced.
Where shares combine by more than that (cross-entropy over a sharded vocabulary: a logsumexp of
the devices' logsumexps), the family's `heads_relaunch` runs its own collectives; softmax and
generated groups that compute from a row reduction give way there to XLA on each share, the row
statistics all-reduced, as jax.jit computes them. A launch that cannot split (no rule, the split dim not sharded, or not divisible by the device
count) runs whole on every device, as before.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from xkern import _compat
from xkern.kernels import launch as L


def splits(ctx) -> bool:
    """Whether a launch lowered in `ctx` is in a program that XLA will partition over several devices
    (not inside shard_map, where each device already sees its own shard)."""
    return _compat.partitioned_lowering(ctx)


def lower(ctx, arrays, params, rule):
    """Lower one launch through custom_partitioning with its family's split rule."""
    def whole(*arrays):  # custom_partitioning reads the signature: no keywords
        return _whole(*arrays, params=params)

    call = custom_partitioning(whole)
    call.def_partition(
        partition=functools.partial(_partition, params=params, rule=rule),
        infer_sharding_from_operands=functools.partial(_infer, params=params, rule=rule),
        propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
        sharding_rule=_sharding_rule(params, ctx.avals_in, rule),
        decode_shardings=False)  # read by _split_axes, which also takes what jax cannot decode
    return mlir.lower_fun(lambda *a: call(*a), multiple_results=True)(ctx, *arrays)


def _whole(*arrays, params):
    """The launch as written: what custom_partitioning traces for shapes, and runs on one device."""
    return L.xkern_kernel_p.bind(*arrays, **params)


def _alternatives(split) -> list:
    """The launch's Split and those of its other second splits (Split.heads_else), in order."""
    out = [split]
    while out[-1].heads_else is not None:
        out.append(out[-1].heads_else)
    return out


def _sharding_rule(params, in_avals, rule) -> SdyShardingRule:
    """For Shardy: dim 0 of every split operand and output is one factor ("rows"), each heads dim one
    of a factor per size (q's heads, k's: GQA; another second split's, factors of its own), and every
    other dim a factor of its own that must be replicated (rows and heads are whole in each kernel)."""
    splits = _alternatives(rule(params))
    own = []

    def mapping(kind, roles, heads_of, shapes):
        out = []
        for i, (role, shape) in enumerate(zip(roles, shapes)):
            dims = []
            for d in range(len(shape)):
                heads = [k for k, h in enumerate(heads_of) if h and d == h[i]]
                if d == 0 and role == L.ROWS:
                    dims.append("rows")
                elif heads:
                    dims.append(f"heads{shape[d]}" if heads[0] == 0 else f"heads{heads[0]}_{shape[d]}")
                else:
                    own.append(f"{kind}{i}d{d}")
                    dims.append(own[-1])
            out.append(tuple(dims))
        return tuple(out)

    operands = mapping("in", splits[0].args, [s.heads_args for s in splits], [a.shape for a in in_avals])
    results = mapping("out", splits[0].outs, [s.heads_outs for s in splits],
                      [s.shape for s in params["out_shapes"]])
    return SdyShardingRule(operands, results, need_replication_factors=tuple(own))


def _axes_along(mesh, dims, arg_shapes) -> tuple:
    """The mesh axes of the first operand sharded along its dim in `dims` (None: not looked at)."""
    for dim, arg in zip(dims, arg_shapes):
        spec = _compat.spec_of(arg.sharding, mesh) if dim is not None else None
        if spec and len(spec) > dim and spec[dim] is not None:
            return spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
    return ()


def _split_axes(mesh, split, arg_shapes, out_shapes) -> tuple:
    """The mesh axes dim 0 is split over: those of the first split operand that is sharded there, if
    every split dim divides evenly; () for a launch that runs whole."""
    if mesh.empty:
        return ()
    axes = _axes_along(mesh, [0 if role == L.ROWS else None for role in split.args], arg_shapes)
    parts = math.prod(mesh.shape[a] for a in axes)
    dims = [a.shape[0] for role, a in zip(split.args, arg_shapes) if role == L.ROWS]
    dims += [s.shape[0] for role, s in zip(split.outs, out_shapes) if role == L.ROWS]
    if parts <= 1 or any(d % parts for d in dims) or (split.fits and not split.fits(parts)):
        return ()
    return axes


def _heads_axes(mesh, split, arg_shapes, out_shapes, rows: tuple) -> tuple:
    """The mesh axes the heads are split over (tensor parallelism): those of the first operand
    sharded along its heads dim, if they are not the rows' and every heads dim divides evenly."""
    if mesh.empty or not split.heads_args:
        return ()
    axes = _axes_along(mesh, split.heads_args, arg_shapes)
    parts = math.prod(mesh.shape[a] for a in axes)
    dims = [a.shape[d] for d, a in zip(split.heads_args, arg_shapes) if d is not None]
    dims += [s.shape[d] for d, s in zip(split.heads_outs, out_shapes) if d is not None]
    if parts <= 1 or set(axes) & set(rows) or any(d % parts for d in dims) or not split.heads_fits(parts):
        return ()
    return axes


def _sharding(mesh, axes, role, cut_dims=()):
    """An operand's or output's sharding: dim 0 over the rows' axes (SUMMED outputs come back whole:
    _summed), each second split's dim over its axes (cut_dims: (dim or None, axes) per cut)."""
    by_dim = {}
    if role == L.ROWS and axes:
        by_dim[0] = axes if len(axes) > 1 else axes[0]
    for dim, heads in cut_dims:
        if dim is not None:
            by_dim[dim] = heads if len(heads) > 1 else heads[0]
    return NamedSharding(mesh, PartitionSpec(*(by_dim.get(d) for d in range(max(by_dim, default=-1) + 1))))


def _shardings(mesh, split, axes, cuts, out_shapes):
    """(operands', outputs') shardings of a launch split over these rows' axes and these cuts."""
    at = lambda dims, i: dims[i] if dims else None
    return (tuple(_sharding(mesh, axes, role, [(at(c.heads_args, i), h) for c, h in cuts])
                  for i, role in enumerate(split.args)),
            [_sharding(mesh, axes, role, [(at(c.heads_outs, i), h) for c, h in cuts])
             for i, role in enumerate(split.outs)])


def _chosen(mesh, split, arg_shapes, out_shapes) -> tuple:
    """(the Split whose second split the operands' shardings take, or the first; the rows' axes; the
    cuts, [(Split, its heads' axes)]): the first alternative whose dims are sharded, and where it
    splits along a dim of the rows (Split.heads_rows), every later such one sharded over other axes."""
    axes = _split_axes(mesh, split, arg_shapes, out_shapes)
    cuts = []
    for alternative in _alternatives(split):
        if cuts and not (cuts[0][0].heads_rows and alternative.heads_rows):
            continue
        taken = axes + tuple(a for _, heads in cuts for a in heads)
        heads = _heads_axes(mesh, alternative, arg_shapes, out_shapes, taken)
        if heads:
            cuts.append((alternative, heads))
    return (cuts[0][0] if cuts else split), axes, cuts


def _partition(mesh, arg_shapes, result_shape, *, params, rule):
    out_shapes = params["out_shapes"]
    split, axes, cuts = _chosen(mesh, rule(params), arg_shapes, out_shapes)
    heads = tuple(a for _, cut_axes in cuts for a in cut_axes)

    def lower_fn(*local):
        if not axes and not heads:
            return _whole(*local, params=params)
        if heads and split.heads_relaunch:
            return split.heads_relaunch(*local, heads=heads, rows=axes, **params)
        outs = split.relaunch(*local, **params)
        outs = [_summed(o, s.shape[0], axes + heads) if role == L.SUMMED and (axes or heads) else o
                for o, s, role in zip(outs, out_shapes, split.outs)]
        if heads and split.heads_reduced:  # each device reduced its own columns: combined here
            outs = [_ALL_REDUCE[how](o, heads) if how else o for o, how in zip(outs, split.heads_reduced)]
        return outs

    arg_shardings, out_shardings = _shardings(mesh, split, axes, cuts, out_shapes)
    return mesh, lower_fn, out_shardings, arg_shardings


_ALL_REDUCE = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _infer(mesh, arg_shapes, result_shape, *, params, rule):
    """GSPMD's propagation (Shardy uses the sharding rule instead): outputs split as the operands."""
    split, axes, cuts = _chosen(mesh, rule(params), arg_shapes, params["out_shapes"])
    return _shardings(mesh, split, axes, cuts, params["out_shapes"])[1]


def typed_shardings(avals, params) -> list:
    """Under a mesh of Explicit axes: the shardings of a launch's outputs as the partitioner gives
    them (each split output's dim 0 over the rows' axes, its heads dim over the heads'), replicated
    for a launch that cannot split, so that the program's types say what XLA computes."""
    mesh = _compat.explicit_mesh(avals)
    rule = L._SPLIT_RULES.get(params["kernel"])
    if rule is None:
        return [NamedSharding(mesh, PartitionSpec())] * len(params["out_shapes"])
    return _infer(mesh, avals, None, params=params, rule=rule)


def _summed(partials, rows: int, axes):
    """Partial sums (only their total is read) as the whole launch's `rows` rows, the same on every
    device: the devices' totals summed across them in the first row, zeros after. One all-reduce of
    a row, where leaving the partials split would make XLA gather them all for the sum that reads
    them (Shardy cannot tell that their rows split as the operands' do)."""
    total = jax.lax.psum(jnp.sum(partials, 0, keepdims=True), axes)
    return jnp.concatenate([total, jnp.zeros((rows - 1, *partials.shape[1:]), partials.dtype)])


# --------------------------------------------------------------------------------------------------
# Functions of many launches split along their rows: the LM head's scan over chunks
# --------------------------------------------------------------------------------------------------
# linear_cross_entropy runs its chunks of rows through a scan. Left to XLA, a scan over rows sharded
# across devices gathers them onto every device, and each computes every chunk (data parallelism
# lost, N times the work). rows_call runs such a function on each device's rows instead.

def rows_call(fn, args, roles, out_roles, cols=None, n_lead: int = 1):
    """fn(*args, cols_axes) -> outputs, on each device's rows where a mesh shards them: the first
    n_lead dims of the ROWS operands and outputs are the rows' (a batch and a sequence: any of them
    may be sharded); SHARED operands are whole on every device; SUMMED outputs are each device's
    partial sums, added across the rows' devices. cols = (operand, dim): a dim
    of a SHARED operand (the LM head's vocabulary) that may stay sharded, as may the same dim of
    each output whose out_roles entry is (role, dim); then fn gets those mesh axes as cols_axes
    and combines across them itself, else (). On a mesh of Explicit axes (types give the
    shardings) through shard_map; else through custom_partitioning, which sees them after
    propagation (under vmap: fn as written)."""
    mesh = _compat.explicit_mesh([jax.typeof(a) for a in args])
    if mesh is not None:
        specs = [_compat.spec_of(jax.typeof(a).sharding, mesh) for a in args]
        return _rows_shard_map(fn, args, roles, out_roles, cols, mesh, specs, n_lead)
    call = custom_partitioning(lambda *a: tuple(fn(*a, cols_axes=())))
    call.def_partition(
        partition=lambda mesh, arg_shapes, result_shape: _rows_partition(
            mesh, arg_shapes, fn, roles, out_roles, cols, n_lead),
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: _rows_shardings(
            mesh, _rows_axes(mesh, arg_shapes, roles, cols, n_lead), roles, out_roles, cols)[1],
        propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
        sharding_rule=_rows_rule(args, roles, out_roles, cols, jax.eval_shape(lambda *a: fn(*a, cols_axes=()), *args),
                                 n_lead),
        decode_shardings=False)
    batched = jax.custom_batching.custom_vmap(lambda *a: call(*a))
    batched.def_vmap(lambda size, in_batched, *a: (
        jax.vmap(lambda *b: tuple(fn(*b, cols_axes=())), in_axes=[0 if b else None for b in in_batched])(*a),
        (True,) * len(out_roles)))
    return list(batched(*args))


def _role(role):
    return role[0] if isinstance(role, tuple) else role


def _rows_axes(mesh, arg_shapes, roles, cols, n_lead) -> tuple:
    """(the rows' mesh axes, one tuple per leading dim; the cols' mesh axes): those each leading dim
    of the first ROWS operand is sharded over, where it divides evenly; those of the cols dim."""
    specs = [_compat.spec_of(a.sharding, mesh) for a in arg_shapes]
    along = lambda spec, d: (spec[d] if isinstance(spec[d], tuple) else (spec[d],)) \
        if spec is not None and len(spec) > d and spec[d] is not None else ()
    first = next(i for i, r in enumerate(roles) if r == L.ROWS)
    rows = [along(specs[first], d) for d in range(n_lead)]
    rows = tuple(axes if arg_shapes[first].shape[d] % math.prod(mesh.shape[a] for a in axes) == 0 else ()
                 for d, axes in enumerate(rows))
    vocab = along(specs[cols[0]], cols[1]) if cols else ()
    vocab = () if set(vocab) & {a for axes in rows for a in axes} else vocab
    return rows, vocab


def _rows_shardings(mesh, axes, roles, out_roles, cols):
    """(operands', outputs') shardings for these (rows', cols') axes."""
    rows, vocab = axes
    entry = lambda a: None if not a else a if len(a) > 1 else a[0]

    def sharding(role, cols_dim):
        by_dim = dict(enumerate(entry(a) for a in rows)) if _role(role) == L.ROWS else {}
        if cols_dim is not None and vocab:
            by_dim[cols_dim] = entry(vocab)
        return NamedSharding(mesh, PartitionSpec(*(by_dim.get(d) for d in range(max(by_dim, default=-1) + 1))))
    args = tuple(sharding(r, cols[1] if cols and i == cols[0] else None) for i, r in enumerate(roles))
    outs = tuple(sharding(r, r[1] if isinstance(r, tuple) else None) for r in out_roles)
    return args, outs


def _rows_local(fn, out_roles, lead, vocab):
    """fn on one device's share: SUMMED outputs added across the rows' devices."""
    rows = tuple(a for axes in lead for a in axes)

    def local(*arrays):
        outs = fn(*arrays, cols_axes=vocab)
        return tuple(jax.lax.psum(o, rows) if _role(r) == L.SUMMED and rows else o for o, r in zip(outs, out_roles))
    return local


def _rows_partition(mesh, arg_shapes, fn, roles, out_roles, cols, n_lead):
    axes = _rows_axes(mesh, arg_shapes, roles, cols, n_lead)
    arg_shardings, out_shardings = _rows_shardings(mesh, axes, roles, out_roles, cols)
    return mesh, _rows_local(fn, out_roles, *axes), out_shardings, arg_shardings


def _rows_rule(args, roles, out_roles, cols, out_avals, n_lead) -> SdyShardingRule:
    """For Shardy: each leading dim of the ROWS operands and outputs one factor, the cols dims
    another, every other dim a factor of its own that must be replicated."""
    own = []

    def factors(kind, i, role, cols_dim, ndim):
        dims = []
        for d in range(ndim):
            if d < n_lead and _role(role) == L.ROWS:
                dims.append(f"rows{d}")
            elif d == cols_dim:
                dims.append("cols")
            else:
                own.append(f"{kind}{i}d{d}")
                dims.append(own[-1])
        return tuple(dims)
    operands = tuple(factors("in", i, r, cols[1] if cols and i == cols[0] else None, jnp.ndim(a))
                     for i, (r, a) in enumerate(zip(roles, args)))
    results = tuple(factors("out", i, r, r[1] if isinstance(r, tuple) else None, len(a.shape))
                    for i, (r, a) in enumerate(zip(out_roles, out_avals)))
    return SdyShardingRule(operands, results, need_replication_factors=tuple(own))


def _rows_shard_map(fn, args, roles, out_roles, cols, mesh, specs, n_lead):
    """rows_call on a mesh of Explicit axes: the shardings are the operands' types."""
    first = next(i for i, r in enumerate(roles) if r == L.ROWS)
    spec = lambda i, d: specs[i][d] if specs[i] is not None and len(specs[i]) > d else None
    flat = lambda entry: () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    rows, vocab = tuple(flat(spec(first, d)) for d in range(n_lead)), flat(spec(*cols)) if cols else ()
    arg_shardings, out_shardings = _rows_shardings(mesh, (rows, vocab), roles, out_roles, cols)
    args = [jax.sharding.reshard(a, s) for a, s in zip(args, arg_shardings)]  # (rows' others: weights, labels)
    return list(jax.shard_map(_rows_local(fn, out_roles, rows, vocab), mesh=mesh,
                              in_specs=tuple(s.spec for s in arg_shardings),
                              out_specs=tuple(s.spec for s in out_shardings), check_vma=False)(*args))


# --------------------------------------------------------------------------------------------------
# The interpreter inside a partitioned program (CPU)
# --------------------------------------------------------------------------------------------------
# A host callback (jax.pure_callback) is registered with the module being lowered, and the module of
# one device's share that custom_partitioning builds is not the program's: its callbacks never
# reach the executable. So there, on CPU, the interpreter runs as a custom call of its own: a C
# function (ctypes) that finds its launch by key and reads and writes XLA's buffers in place. It
# cannot report an error to XLA: a kernel that raises prints its traceback and leaves NaN outputs.

_LAUNCHES: dict[str, dict] = {}
_LAUNCHES_LOCK = threading.Lock()
_TARGET = "xkern_interpret_cpu"
_SIGNATURE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p)


def _host_array(pointer, aval) -> np.ndarray:
    nbytes = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
    if nbytes == 0:
        return np.zeros(aval.shape, aval.dtype)
    buffer = (ctypes.c_char * nbytes).from_address(pointer)
    return np.frombuffer(buffer, np.dtype(aval.dtype)).reshape(aval.shape)


def _run_custom_call(out, ins, opaque, opaque_len, status):
    params = _LAUNCHES[ctypes.string_at(opaque, opaque_len).decode()]
    in_avals, out_shapes = params["in_avals"], params["launch"]["out_shapes"]
    arrays = [_host_array(ins[i], a).copy() for i, a in enumerate(in_avals)]
    pointers = [out] if len(out_shapes) == 1 else [ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[i]
                                                   for i in range(len(out_shapes))]
    results = [_host_array(p, s) for p, s in zip(pointers, out_shapes)]
    try:
        values = L._run_interpreted(*arrays, **params["launch"])
    except Exception:  # noqa: BLE001 (nothing can be raised through XLA from here: see above)
        import traceback
        traceback.print_exc()
        values = [np.full(s.shape, np.nan, s.dtype) if np.issubdtype(s.dtype, np.floating)
                  else np.zeros(s.shape, s.dtype) for s in out_shapes]
    for result, value in zip(results, values):
        result[...] = value


@functools.cache
def _register_target() -> None:
    function = _SIGNATURE(_run_custom_call)
    _register_target.keep = function  # the C pointer lives as long as the Python object
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p,
                                                                   ctypes.c_void_p)
    capsule = new_capsule(ctypes.cast(function, ctypes.c_void_p).value, b"xla._CUSTOM_CALL_TARGET", None)
    jax.ffi.register_ffi_target(_TARGET, capsule, platform="cpu", api_version=0)
    # A launch still running at exit calls back into a Python that is shutting down, and the process
    # never ends: wait for every result first.
    atexit.register(lambda: [a.block_until_ready() for a in jax.live_arrays()])


def lower_interpreted(ctx, arrays, params):
    """One launch through the interpreter as a CPU custom call (see above)."""
    _register_target()
    with _LAUNCHES_LOCK:
        key = f"{params['kernel']}:{len(_LAUNCHES)}"
        _LAUNCHES[key] = {"in_avals": list(ctx.avals_in), "launch": params}
    return jax.ffi.ffi_lowering(_TARGET, api_version=3, backend_config=key)(ctx, *arrays)
