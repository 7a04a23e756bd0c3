"""Generated kernels as ops: a fusion group's Triton kernel (xkern/fusion), launched on [rows, cols]
views of its inputs, differentiated by XLA (the backward is jax.vjp of the group's own equations,
so gradients are exact and nothing extra is saved but the group's inputs), and batched by folding
the vmapped axis into the rows, or else by vmapping the group's equations.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from xkern import _compat
from xkern.fusion import codegen
from xkern.fusion.grouping import Group
from xkern.kernels import launch as L
from xkern.tuning import autotune
from xkern.tuning.configs import one_block_rows
from xkern.tuning.timing import time_pipelined


@dataclasses.dataclass(frozen=True, eq=False)
class Fused:
    """Everything needed to run one fusion group; hashed by identity (an equation param)."""
    name: str
    source: str
    group: Group
    eqns: tuple  # the equations it computes, in order (a matmul's first)
    input_vars: tuple  # the program values it reads, in kernel order
    input_kinds: tuple  # full / row / col / scalar, or a / b for a matmul's operands
    output_kinds: tuple
    output_avals: tuple
    k: int = 0  # a matmul's contraction length (0: no matmul)

    @property
    def n_cols(self) -> int:
        return self.group.n_cols

    def reference(self, *inputs) -> list:
        """The group computed by XLA: its own equations, bound one by one."""
        return self._evaluate(dict(zip(self.input_vars, inputs)), self.eqns)

    def epilogue(self, product, *others) -> list:
        """A matmul group's epilogue alone, from the product and the other inputs."""
        env = dict(zip(self.input_vars[2:], others))
        env[self.eqns[0].outvars[0]] = product
        return self._evaluate(env, self.eqns[1:])

    def _evaluate(self, env: dict, eqns) -> list:
        read = lambda v: v.val if isinstance(v, Literal) else env[v]
        for eqn in eqns:
            env[eqn.outvars[0]] = _compat.run_equation(eqn, [read(v) for v in eqn.invars])[0]
        return [env[v] for v, _ in self.group.outputs]

    @functools.cached_property
    def with_product(self) -> "Fused":
        """The same matmul kernel, also writing the product (the backward pass's residual)."""
        product = self.eqns[0].outvars[0]
        group = dataclasses.replace(self.group, outputs=[*self.group.outputs, (product, "full")])
        name, source = codegen.generate(group, None, matmul_out=product,
                                        exact_dot=np.dtype(self.input_vars[0].aval.dtype) == np.float32,
                                        eqns_in_order=self.eqns[1:])
        return _registered(dataclasses.replace(self, name=name, source=source, group=group,
                                               output_kinds=(*self.output_kinds, "full"),
                                               output_avals=(*self.output_avals, product.aval)))


_REGISTERED: set[str] = set()  # kernel names with their batching and split rules registered


def _registered(fused: "Fused") -> "Fused":
    """`fused`, its kernel's batching and split rules registered (one per kernel name: the launch's
    `info` says which group)."""
    if fused.name not in _REGISTERED:
        _REGISTERED.add(fused.name)
        L.def_batching(fused.name, _batch)
        L.def_split(fused.name, _split)
    return fused


def build(group: Group, eqns, dot: int | None = None) -> Fused:
    """The kernel for `group`; with `dot` (an equation index), as the epilogue of that matmul."""
    read, computed, k = inputs(group, eqns, dot), [eqns[i] for i in group.eqns], 0
    if dot is None:
        name, source = codegen.generate(group, eqns)
    else:
        (a, b), out = eqns[dot].invars, eqns[dot].outvars[0]
        computed, k = [eqns[dot]] + computed, int(b.aval.shape[0])
        exact = np.dtype(a.aval.dtype) == np.float32
        name, source = codegen.generate(group, eqns, matmul_out=out, exact_dot=exact)
    fused = Fused(name, source, group, tuple(computed), tuple(v for v, _ in read),
                  tuple(kind for _, kind in read), tuple(kind for _, kind in group.outputs),
                  tuple(v.aval for v, _ in group.outputs), k)
    return _registered(fused)


def default_config(n_rows: int, n_cols: int, backend: str, fused: Fused | None = None) -> L.Config:
    """The matmul template's heuristic tiles, or the one-block row config (xkern/tuning/configs.py)."""
    if fused is not None and fused.k:
        return matmul_configs(n_rows, n_cols, fused.k, backend)[0]
    return one_block_rows(n_rows, n_cols, backend)


# Tile shapes (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) the tuner tries for the matmul
# template, the first being the heuristic. Hopper: wgmma wants BLOCK_M a multiple of 64 and 4-8
# warps; deeper pipelines hide HBM latency; the best tile with TMA loads or without (on an H200,
# 8192^3 + bias + gelu: 682 / 637 TFLOP/s) comes first. ROCm: 64-wide wavefronts, LDS of 64 KB, and Triton's AMD
# pipeliner works with 2 stages.
MATMUL_TILES = {
    "cuda": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4),
             (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4)],
    "rocm": [(128, 128, 64, 8, 2), (256, 256, 64, 8, 2), (256, 128, 64, 8, 2), (128, 128, 32, 4, 2),
             (64, 128, 64, 4, 2)],
}


def tma_fits(k: int, n: int, itemsize: int) -> bool:
    """Whether TMA descriptors can describe the operands [M, K] and [K, N]: row strides must be
    multiples of 16 bytes."""
    return (k * itemsize) % 16 == 0 and (n * itemsize) % 16 == 0


def matmul_configs(m: int, n: int, k: int, backend: str, vendor: str = "cuda",
                   tma: bool = False, programs: int = 0) -> list[L.Config]:
    """Candidate tiles for a matmul with an epilogue (heuristic first), clamped to the problem;
    tl.dot wants tiles of at least 16. `tma`: the operands can be loaded by TMA (tma_fits, and a
    device with it): each tile with TMA loads first, then the two first tiles with pointer loads.
    `programs` (the device's SM count, with `tma`): the two first TMA tiles also persistent, that
    many programs looping over the tiles (PROGRAMS; 0: one program per tile)."""
    tile = lambda size, cap: max(16, min(L.next_pow2(size), cap))
    if backend == "interpret":
        return [L.Config.of(BLOCK_M=tile(m, 64), BLOCK_N=tile(n, 64), BLOCK_K=tile(k, 64), GROUP_M=8,
                            TMA=False, PROGRAMS=0)]
    tiles = MATMUL_TILES[vendor]
    variants = [(t, False, 0) for t in tiles]
    if tma:
        variants = ([(t, True, 0) for t in tiles] + [(t, True, programs) for t in tiles[:2] if programs]
                    + variants[:2])
    configs = []
    for (bm, bn, bk, warps, stages), use_tma, n_programs in variants:
        config = L.Config.of(BLOCK_M=tile(m, bm), BLOCK_N=tile(n, bn), BLOCK_K=tile(k, bk), GROUP_M=8,
                             TMA=use_tma, PROGRAMS=n_programs, num_warps=warps, num_stages=stages)
        if config not in configs:
            configs.append(config)
    return configs


def _random_like(views) -> list:
    """Random device arrays shaped and typed like the kernel's inputs (for timing candidates)."""
    rng = np.random.default_rng(0)
    out = []
    for v in views:
        dtype = np.dtype(v.dtype)
        if dtype == np.bool_:
            value = rng.random(v.shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            value = rng.integers(-100, 100, v.shape)
        else:
            value = rng.standard_normal(v.shape, dtype=np.float32)
        out.append(jax.device_put(np.asarray(value).astype(dtype)))
    return out


def _config(fused: Fused, views, n_rows: int, backend: str) -> L.Config:
    """The launch config: tuned (and cached on disk) for a matmul on a GPU, else the heuristic."""
    if not fused.k:
        return default_config(n_rows, fused.n_cols, backend)
    a, b = views[0].dtype, views[1].dtype
    tma = L.tma_supported() and tma_fits(fused.k, fused.n_cols, min(np.dtype(a).itemsize, np.dtype(b).itemsize))
    programs = getattr(jax.devices()[0], "core_count", 0) if tma else 0
    candidates = matmul_configs(n_rows, fused.n_cols, fused.k, backend, L.vendor(), tma, programs)
    # Keyed by the problem, not the epilogue: the tiles that win are the matmul's.
    key = f"{n_rows}x{fused.n_cols}x{fused.k}|{a}|{b}"

    first = []  # the first candidate's results (autotune.agrees)

    def measure(config):
        samples = _random_like(views)
        step = jax.jit(lambda *v: _launch_views(v, fused, backend, config))
        autotune.agrees(first, step(*samples))
        return time_pipelined(step, *samples, min_seconds=0.02)

    return autotune.tuned("matmul_epilogue", key, candidates, measure, backend,
                          version=autotune.version_of(*codegen.MATMUL_PROLOGUE))


def _lead(fused: Fused) -> tuple:
    """The group's rows as the kernel's views keep them: every leading dim (one of 1 where there are
    none), so that a mesh sharding any of them splits the launch there (_split), where one merged
    dim of rows could not stay sharded along a dim under another (heads under a batch)."""
    return tuple(fused.group.rows) or (1,)


def _views(fused: Fused, inputs) -> tuple[list, int]:
    """Inputs as the kernel reads them: full [*rows, cols], row [*rows], col [cols], scalar [1];
    a matmul's operands as [*rows, K] and [K, cols]. The kernel reads them flat, rows by rows."""
    n_cols, lead = fused.n_cols, _lead(fused)
    shaped = {"full": (*lead, n_cols), "row": lead, "col": (n_cols,), "scalar": (1,),
              "a": (*lead, fused.k), "b": (fused.k, n_cols)}
    # (asarray: a Python number differentiated eagerly reaches here as jax's TypedFloat, no array)
    views = [jax.numpy.asarray(x).reshape(shaped[k]) for x, k in zip(inputs, fused.input_kinds)]
    return views, int(np.prod(lead, dtype=np.int64))


def _rows_of(views, fused: Fused) -> tuple:
    """The leading dims of this launch's rows (a device's share where they are split); the group's
    where no input has them (a group of column values broadcast to rows, which never splits them)."""
    for view, kind in zip(views, fused.input_kinds):
        if kind in ("full", "row", "a"):
            return tuple(view.shape if kind == "row" else view.shape[:-1])
    return _lead(fused)


def _launch_views(views, fused: Fused, backend: str, config: L.Config,
                  aliases: dict | None = None, n_cols: int | None = None) -> list:
    """n_cols: the columns of this launch (a device's share where they are split), else the group's."""
    n_cols, lead = n_cols or fused.n_cols, _rows_of(views, fused)
    n_rows = int(np.prod(lead, dtype=np.int64))
    outs = [jax.ShapeDtypeStruct((*lead, n_cols) if k == "full" else lead, a.dtype)
            for k, a in zip(fused.output_kinds, fused.output_avals)]
    fn = codegen.load(fused.name, fused.source)
    constexprs, grid = {"N_COLS": n_cols}, L.cdiv(n_rows, config["BLOCK_M"])
    if fused.k:
        constexprs.update(K=fused.k, DOT_F32=backend == "interpret")
        grid *= L.cdiv(n_cols, config["BLOCK_N"])
        grid = min(grid, config["PROGRAMS"] or grid)  # persistent: each program loops over tiles
    return L.launch(fn, *views, n_rows, kernel=fused.name, out_shapes=outs, grid=(grid,),
                    config=config, backend=backend, constexprs=constexprs, info=fused, aliases=aliases)


def run(fused: Fused, inputs, backend: str, aliases: dict | None = None) -> list:
    """Each program reads its own tile of every full-size input before writing that tile of its
    outputs, so an output may be written over a full-size input (`aliases`)."""
    views, n_rows = _views(fused, inputs)
    if n_rows == 0:  # no program to launch; every output has the rows
        return [jax.numpy.zeros(a.shape, a.dtype) for a in fused.output_avals]
    outs = _launch_views(views, fused, backend, _config(fused, views, n_rows, backend), aliases)
    return [o.reshape(a.shape) for o, a in zip(outs, fused.output_avals)]


def op(fused: Fused, backend: str, epilogue_vjp=None, aliases: dict | None = None):
    """The group as a differentiable function of its inputs. The backward pass is XLA's: the vjp of
    the group's equations from its inputs. For a matmul group: the epilogue's derivative from the
    saved product (`epilogue_vjp(product, *others, *cotangents)`, the rewriter's generated kernel for
    it, or else XLA's vjp), then the two gradient matmuls (no matmul is recomputed).
    aliases {input: output}: outputs written over inputs that die here (the memory plan's), when
    not differentiated (the backward pass would keep those inputs)."""
    @L.varying_alike
    @jax.custom_vjp
    def fused_op(*inputs):
        return run(fused, inputs, backend, aliases)

    def fwd(*inputs):
        if not fused.k:
            return run(fused, inputs, backend), inputs
        *outs, product = run(fused.with_product, inputs, backend)
        return outs, (inputs, product)

    def bwd(residuals, cotangents):  # (each gradient typed as its input: launch._typed_vjp)
        if not fused.k:
            return _vjp(fused.reference, _typed(residuals, fused.input_vars), list(cotangents))
        (a, b, *others), product = residuals
        a, b, *others = _typed((a, b, *others), fused.input_vars)
        if epilogue_vjp is not None:
            d_product, *d_others = epilogue_vjp(product, *others, *cotangents)
        else:
            (product,) = _typed((product,), fused.eqns[0].outvars)
            d_product, *d_others = _vjp(fused.epilogue, (product, *others), list(cotangents))
        dot = fused.eqns[0]
        d_a, d_b = _vjp(lambda a, b: _compat.bind_equation(dot, [a, b])[0], (a, b), d_product)
        return (d_a, d_b, *d_others)

    fused_op.defvjp(fwd, bwd)
    return fused_op


# Under a mesh of Explicit axes the program's values are typed with their shardings, the kernels'
# outputs with none: the backward's jax.vjp of the group's equations takes each operand as the program
# typed it (a select takes only operands of one sharding) and cotangents of its outputs' types, and
# the custom_vjp wants each gradient of its input's type.

def _typed(values, program_vars) -> list:
    """The values with the shardings the program typed them with."""
    return [_compat.resharded(x, v.aval.sharding) for x, v in zip(values, program_vars)]


def _vjp(f, primals, cotangents):
    """f's vjp at `primals`, applied to `cotangents` given f's outputs' shardings."""
    outs, f_vjp = jax.vjp(f, *primals)
    return f_vjp(jax.tree.map(lambda c, o: _compat.resharded(c, jax.typeof(o).sharding), cotangents, outs))


def _batch(args, dims, *, info, backend, config, **params):
    fused: Any = info
    n_arrays = len(fused.input_kinds)
    arrays, arr_dims = args[:n_arrays], dims[:n_arrays]
    foldable = all(d is None or k in ("full", "row", "a") for k, d in zip(fused.input_kinds, arr_dims))
    size = next(a.shape[d] for a, d in zip(arrays, arr_dims) if d is not None)
    if foldable:  # one launch over batch * rows; col and scalar inputs are shared
        folded = []
        for a, d, k in zip(arrays, arr_dims, fused.input_kinds):
            if k in ("full", "row", "a"):
                a = jax.numpy.broadcast_to(a, (size, *a.shape)) if d is None else jax.numpy.moveaxis(a, d, 0)
                a = a.reshape(size * a.shape[1], *a.shape[2:])
            folded.append(a)
        outs = _launch_views(folded, fused, backend, config)
        return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0] * len(outs)
    # Otherwise: the group's own equations, vmapped, on the views (XLA computes this launch).
    def on_views(*views):
        shaped = [v.reshape(x.aval.shape) for v, x in zip(views, fused.input_vars)]
        lead = _lead(fused)
        return [o.reshape((*lead, fused.n_cols) if k == "full" else lead)
                for o, k in zip(fused.reference(*shaped), fused.output_kinds)]
    outs = jax.vmap(on_views, in_axes=list(arr_dims))(*arrays)
    return outs, [0] * len(outs)


def _split(params) -> L.Split:
    """Rows split across devices: full, row and matmul-operand (a) inputs and every output have
    them as dim 0; col and scalar inputs and the matmul's weight (b) are shared. A second split
    along the columns, as tensor parallelism shards a hidden activation (the features of x @ w1,
    w1 sharded by column), where the group's row outputs combine across devices (_row_reductions):
    full inputs and outputs have them as their last dim, col inputs as dim 0, the weight b as dim 1;
    each device launches on its columns, whose count N_COLS is then its share's. Else along another
    of the rows' dims (the views keep them all: _lead), as tensor parallelism shards heads
    ([batch, seq, heads, head_dim]) or sequence parallelism a sequence: rows are independent, so
    each device launches on its share of them."""
    fused: Any = params["info"]
    roles = tuple(L.ROWS if k in ("full", "row", "a") else L.SHARED for k in fused.input_kinds)
    reduced = _row_reductions(fused.group, fused.eqns)
    by_cols = reduced is not None or not fused.k  # (else: _on_shares, XLA's)
    n_lead = len(_lead(fused))
    cols_dim = {"full": n_lead, "col": 0, "b": 1}  # the dim of a kernel operand that holds the columns

    def relaunch(*views, backend, config, aliases, **_):
        n_cols = next((v.shape[cols_dim[k]] for v, k in zip(views, fused.input_kinds) if k in cols_dim),
                      fused.n_cols)
        if fused.k and config["TMA"] and not tma_fits(fused.k, n_cols, np.dtype(views[1].dtype).itemsize):
            config = config.replace(TMA=False, PROGRAMS=0)  # a share's rows of b too short for TMA
        return _launch_views(views, fused, backend, config, dict(aliases) or None, n_cols)

    split = L.Split(roles, (L.ROWS,) * len(fused.output_kinds), relaunch, fits=lambda parts: L.ROWS in roles)
    if by_cols:
        split = dataclasses.replace(
            split, heads_args=tuple(cols_dim.get(k) for k in fused.input_kinds),
            heads_outs=tuple(n_lead if k == "full" else None for k in fused.output_kinds),
            heads_fits=lambda parts: True, heads_reduced=reduced or (),
            heads_relaunch=_on_shares if reduced is None else None)
    return L.with_row_dims(split, n_lead)


_ALL_REDUCED = {"reduce_sum": (jax.numpy.sum, jax.lax.psum), "reduce_max": (jax.numpy.max, jax.lax.pmax),
                "reduce_min": (jax.numpy.min, jax.lax.pmin)}


def _on_shares(*views, heads, info, **_):
    """A group whose kernel cannot split its columns (it computes from a row reduction: x - max(x),
    a hand-written logsumexp) on this device's share of rows and columns, by XLA, as jax.jit computes
    it: its equations on [rows, cols] views (row values [rows, 1], column values [1, cols]), each
    row reduction all-reduced across the devices (`heads`) before anything reads it. Launching the
    kernel would gather every row onto every device first."""
    fused: Fused = info
    lead = _rows_of(views, fused)
    cols = next(v.shape[-1] for v, k in zip(views, fused.input_kinds) if k in ("full", "col"))
    rows = int(np.prod(lead, dtype=np.int64))
    as_2d = {"full": lambda v: v.reshape(rows, cols), "row": lambda v: v.reshape(rows, 1),
             "col": lambda v: v[None, :], "scalar": lambda v: v.reshape(())}
    env = {var: as_2d[k](v) for var, v, k in zip(fused.input_vars, views, fused.input_kinds)}
    read = lambda v: np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]
    for eqn in fused.eqns:
        args, name = [read(v) for v in eqn.invars], eqn.primitive.name
        if name in _ALL_REDUCED:
            local, across = _ALL_REDUCED[name]
            out = across(local(jax.numpy.broadcast_to(args[0], (rows, cols)), 1, keepdims=True), heads)
        elif name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
            out = args[0]  # (the same [rows, 1], [1, cols] or scalar view: broadcast where read)
        else:
            shape = np.broadcast_shapes(*(np.shape(a) for a in args))
            out = _compat.run_equation(eqn, [jax.numpy.broadcast_to(a, shape) for a in args])[0]
        env[eqn.outvars[0]] = out
    return [jax.numpy.broadcast_to(env[v], (rows, cols)).reshape(*lead, cols) if k == "full" else
            jax.numpy.broadcast_to(env[v], (rows, 1)).reshape(lead) for v, k in fused.group.outputs]


_COMBINED = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


def _row_reductions(group: Group, eqns) -> tuple | None:
    """Per output, how its shares combine where the group's launches split along the columns: None
    for a full output (each device writes its columns), "sum" / "max" / "min" for a row output that
    is a reduction's result (each device reduces its columns; partition.py all-reduces them), also
    scaled or cast after it (a mean). None for the whole group, whose columns then do not split,
    where a reduction's result is read by anything but that (x - max(x) in the group: each device
    would subtract its own max), or a row output is computed otherwise."""
    producers = {e.outvars[0]: e for e in eqns}
    scalars = {v for v, kind in group.inputs if kind == "scalar"}
    reduced = set()  # values computed from a reduction inside the group
    for e in eqns:
        read = any(v in reduced for v in e.invars if not isinstance(v, Literal))
        if read and e.primitive.name in _COMBINED:
            return None
        if read or e.primitive.name in _COMBINED:
            reduced.update(e.outvars)
    if any(v in reduced for v, kind in group.outputs if kind == "full"):
        return None
    combined = []
    for v, kind in group.outputs:
        how = None if kind == "full" else _reduction_of(v, producers, scalars)
        if kind != "full" and how is None:
            return None
        combined.append(how)
    return tuple(combined)


def _reduction_of(v, producers: dict, scalars: set) -> str | None:
    """How shares of the row value v combine: its reduction's, through what commutes with it after
    (a reshape adding unit dims, keepdims'; a cast, for a sum only one that does not narrow it: the
    shares would each be rounded before their sum; for a sum, a product or quotient by a number: a
    mean's division), else None."""
    number = lambda u: isinstance(u, Literal) or u in scalars
    eqn, scaled, narrowed = producers.get(v), False, False
    while eqn is not None and eqn.primitive.name not in _COMBINED:
        name, ins = eqn.primitive.name, eqn.invars
        if name == "convert_element_type":
            narrowed |= np.dtype(eqn.outvars[0].aval.dtype).itemsize < np.dtype(ins[0].aval.dtype).itemsize
            v = ins[0]
        elif name in ("broadcast_in_dim", "reshape") and eqn.outvars[0].aval.size == ins[0].aval.size:
            v = ins[0]
        elif name == "mul" and len(ins) == 2 and any(map(number, ins)) and not all(map(number, ins)):
            v, scaled = ins[1] if number(ins[0]) else ins[0], True
        elif name == "div" and len(ins) == 2 and number(ins[1]) and not number(ins[0]):
            v, scaled = ins[0], True
        else:
            return None
        eqn = producers.get(v)
    how = None if eqn is None else _COMBINED[eqn.primitive.name]
    if scaled and how != "sum":  # (a max times a negative number is a min)
        return None
    return None if narrowed and how == "sum" else how


def split_dims(group: Group, eqns, dot: int | None = None):
    """For rewrite.unsplit_sharding: the dims of the kernel's input i (of ndim dims; with `dot`, a
    matmul's index, its operands a and b first, as `inputs`) that its launches split, as _split's
    alternatives: the rows' first dim and either the columns, where they split (_row_reductions:
    the last dim of full and col inputs and of the weight b, never a contraction), or any of the
    rows' other dims. eqns: the program's, which the indices name."""
    by_cols = _row_reductions(group, [eqns[i] for i in group.eqns]) is not None
    kinds = [kind for _, kind in inputs(group, eqns, dot)]
    n_rows_dims = len(group.rows)

    def dims(i: int, ndim: int) -> list:
        of_rows = kinds[i] in ("full", "row", "a")
        first = {0} if of_rows and n_rows_dims else set()
        alternatives = [first | set(range(1, n_rows_dims))] if of_rows and n_rows_dims > 1 else []
        if by_cols:
            alternatives.insert(0, first | ({ndim - 1} if kinds[i] in ("full", "col", "b") else set()))
        return alternatives or [first]
    return dims


def inputs(group: Group, eqns, dot: int | None = None) -> list:
    """The kernel's inputs, (program value, kind): a matmul's operands a and b first, then the
    group's others (not the product, which the kernel computes)."""
    if dot is None:
        return list(group.inputs)
    (a, b), product = eqns[dot].invars, eqns[dot].outvars[0]
    return [(a, "a"), (b, "b")] + [(v, kind) for v, kind in group.inputs if v is not product]


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: generated kernels of representative programs
# --------------------------------------------------------------------------------------------------

_PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "int32": "*i32", "bool": "*i1"}


def _matmul_signature(fused: Fused) -> dict:
    """Pointer types in the order codegen names them: a, b, then inK for the group's other inputs."""
    ptr = lambda v: _PTR[np.dtype(v.aval.dtype).name]
    dot_out = fused.eqns[0].outvars[0]
    signature = {"a_ptr": ptr(fused.input_vars[0]), "b_ptr": ptr(fused.input_vars[1])}
    for k, (v, _) in enumerate(fused.group.inputs):
        if v is not dot_out:
            signature[f"in{k}_ptr"] = ptr(v)
    signature["n_rows"] = "i32"
    signature.update({f"out{k}_ptr": _PTR[np.dtype(a.dtype).name] for k, a in enumerate(fused.output_avals)})
    return signature


def _sample_programs():
    import jax.numpy as jnp

    def layer_norm(x, scale):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(var + 1e-6) * scale).astype(jnp.bfloat16)

    def activations(x, b):
        y = x.astype(jnp.float32) + b
        # sums, not products: gelu(y) * z or silu(y) * z would be taken by the glu patterns
        return (jax.nn.gelu(y) + jnp.tanh(y) + jnp.log1p(jnp.abs(y)) + jax.nn.gelu(y, approximate=False)
                + jax.nn.silu(y))

    def integers(a, b):
        return jnp.where((a > b) & (a != 0), a - b, jnp.maximum(a, b) * 2), a.max(-1)

    yield layer_norm, (jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16),
                       jax.ShapeDtypeStruct((4096,), jnp.float32))
    yield activations, (jax.ShapeDtypeStruct((64, 8192), jnp.bfloat16),
                        jax.ShapeDtypeStruct((8192,), jnp.float32))
    yield integers, (jax.ShapeDtypeStruct((64, 1000), jnp.int32),
                     jax.ShapeDtypeStruct((64, 1000), jnp.int32))

    def row_extremes(x, mask):
        shifted = jnp.where(mask, x - x.max(-1, keepdims=True), -1e9)
        return jnp.exp(shifted) * x.min(-1, keepdims=True), jnp.isfinite(x)

    yield row_extremes, (jax.ShapeDtypeStruct((64, 2048), jnp.float32),
                         jax.ShapeDtypeStruct((64, 2048), jnp.bool_))

    def linear_gelu(x, w, b, r):
        return jax.nn.gelu(x @ w + b) + r

    yield linear_gelu, tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16)
                             for s in ((4096, 1024), (1024, 4096), (4096,), (4096, 4096)))


def aot_cases():
    """(name, kernel, signature, config[, targets]) for the generated kernels of a few representative
    programs; a matmul template at each vendor's heuristic tile (TMA loads on sm_90 too, one program
    per tile and persistent)."""
    from xkern import pipeline

    for program, specs in _sample_programs():
        plan = pipeline.plan(jax.make_jaxpr(program)(*specs), "interpret")  # every group, no costing
        for fused in (f.fused for p in plan.walk() for f in p.fusions.values()):
            n_rows = int(np.prod(fused.group.rows))
            signature = {f"in{k}_ptr": _PTR[np.dtype(v.aval.dtype).name]
                         for k, (v, _) in enumerate(fused.group.inputs)}
            signature["n_rows"] = "i32"
            signature.update({f"out{k}_ptr": _PTR[np.dtype(a.dtype).name]
                              for k, a in enumerate(fused.output_avals)})
            config = default_config(n_rows, fused.n_cols, "triton", fused).replace(N_COLS=fused.n_cols)
            name, fn = f"generated/{program.__name__}/{fused.name}", codegen.load(fused.name, fused.source)
            if not fused.k:
                yield name, fn, signature, config
                continue
            signature, k = _matmul_signature(fused), dict(K=fused.k, DOT_F32=False, N_COLS=fused.n_cols)
            for vendor, targets, tma in (("cuda", ("sm_90",), True), ("cuda", ("sm_90", "sm_80"), False),
                                         ("rocm", ("gfx942", "gfx90a"), False)):
                configs = matmul_configs(n_rows, fused.n_cols, fused.k, "triton", vendor, tma, programs=132)
                yield f"{name}/{vendor}{'/tma' if tma else ''}", fn, signature, configs[0].replace(**k), targets
                if tma:  # and the persistent variant of that tile
                    persistent = next(c for c in configs if c["PROGRAMS"])
                    yield f"{name}/{vendor}/tma/persistent", fn, signature, persistent.replace(**k), targets
