"""Every import of `jax._src` and every version shim, in one place.

jax's public API covers most of what xkern needs; what it lacks is imported here, so that a jax
upgrade that moves something breaks this file alone.
"""
import contextlib
import functools
import os
import sys
import sysconfig
import threading

import jax
from jax._src import source_info_util as _source_info
from jax._src.dispatch import apply_primitive  # eager evaluation of a primitive


def user_context(source_info):
    """A context in which new equations get `source_info` (the user's line), not the interpreter's."""
    name_stack = _source_info.current_name_stack() + source_info.name_stack
    return _source_info.user_context(source_info.traceback, name_stack=name_stack)


def bind_equation(eqn, invals, params=None, source_info=None) -> list:
    """Bind `eqn`'s primitive to `invals` (with `params` in place of its own), as jax.core.eval_jaxpr
    does: the user's source info (or `source_info`) and the equation's context kept. Returns a list
    of outputs."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns = []
    if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
        subfuns, bind_params = bind_params
    with user_context(source_info or eqn.source_info), eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


# canonicalize stops the gradient of a hand-written softmax's maximum, as jax.nn.softmax does, so
# that patterns see one spelling; where no kernel takes that softmax, its equations run as written
# (run_equation): the maximum's gradient, zero in exact arithmetic, keeps each row's gradient summing
# to zero in bf16 (attention's bf16 gradients through it were 3x closer to float32's than without).
HAND_SOFTMAX_SCOPE = "xkern_hand_softmax_shift"


def run_equation(eqn, invals, params=None) -> list:
    """bind_equation, where the program runs as the user wrote it: a stop_gradient canonicalize put
    into a hand-written softmax (in HAND_SOFTMAX_SCOPE) is the identity it was."""
    if eqn.primitive.name == "stop_gradient" and HAND_SOFTMAX_SCOPE in str(eqn.source_info.name_stack):
        return list(invals)
    return bind_equation(eqn, invals, params)


def typed_as(value, aval):
    """`value` with `aval`'s weak type, where only that differs: a kernel's result is strongly typed
    where the program's was weak (`jnp.where(x > 0, 1., 2.)`), which would change how the caller's
    arithmetic promotes it. (jax's public convert_element_type only makes values strong.)"""
    weak = getattr(aval, "weak_type", False)
    if getattr(jax.typeof(value), "weak_type", weak) == weak:
        return value
    from jax._src.lax.lax import _convert_element_type
    return _convert_element_type(value, aval.dtype, weak_type=weak)


_XKERN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Where installed libraries live (flax, optax...): a line of theirs is not the user's own.
_LIBRARY_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})


def summarize_source(source_info) -> str:
    """'file.py:12:4 (fn)' for the user frame an equation came from: the innermost outside jax and
    xkern (a function of jax's own, xkern.explain(jax.nn.softmax), is reached through xkern's trace:
    then 'unknown' rather than xkern's line). Where that frame is an installed library's (flax's
    LayerNorm), the user's own line that called it comes first: 'model.py:9:8 (Block.__call__),
    in flax/linen/normalization.py:216 (_normalize)'."""
    frames = [f for f in _source_info.user_frames(source_info.traceback) if not f.file_name.startswith(_XKERN_DIR)]
    if not frames:
        return "unknown"
    innermost = frames[0]
    library = next((d for d in _LIBRARY_DIRS if innermost.file_name.startswith(d)), None)
    own = next((f for f in frames if not f.file_name.startswith(_LIBRARY_DIRS)), None)
    if library is None or own is None:
        return _source_info._summarize_frame(innermost)
    return (f"{_source_info._summarize_frame(own)}, in {os.path.relpath(innermost.file_name, library)}:"
            f"{innermost.start_line} ({innermost.function_name})")


def varying_axes(aval) -> frozenset:
    """The mesh axes over which a value inside shard_map varies (its 'vma'); empty outside."""
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset(getattr(aval, "vma", ()))


def spec_like(aval) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct of `aval` with its weak type and, inside shard_map, the mesh axes it varies
    over (a body traced again from such specs types its values as jax did)."""
    extra = {"weak_type": getattr(aval, "weak_type", False)}
    takes = _spec_params()
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None and mat.varying and "manual_axis_type" in takes:
        extra.update(manual_axis_type=mat, sharding=aval.sharding)  # (a manual mesh's sharding)
    elif getattr(aval, "vma", None) and "vma" in takes:
        extra["vma"] = aval.vma
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, **extra)


@functools.cache
def _spec_params() -> frozenset:
    """The keywords this jax's ShapeDtypeStruct takes (the varying axes' one was renamed)."""
    import inspect
    return frozenset(inspect.signature(jax.ShapeDtypeStruct).parameters)


def explicit_mesh(avals):
    """The mesh of Explicit axes that one of `avals` is typed on (jax.set_mesh; values' types carry
    their shardings there), or None."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    for a in avals:
        mesh = getattr(getattr(a, "sharding", None), "mesh", None)
        if explicit is not None and mesh is not None and explicit in getattr(mesh, "axis_types", ()):
            return mesh
    return None


def reshape_after(x, shape, leading: int):
    """x.reshape(shape) where its first `leading` dims stay as they are: on a mesh of Explicit axes,
    typed with their sharding (jax types only simple reshapes of a sharded array by itself)."""
    aval = jax.typeof(x)
    if explicit_mesh([aval]) is None:
        return x.reshape(shape)
    return jax.lax.reshape(x, shape, out_sharding=jax.sharding.PartitionSpec(*tuple(aval.sharding.spec)[:leading]))


def repeat(x, repeats: int, axis: int):
    """jnp.repeat, typed as x is on a mesh of Explicit axes (where jax asks which sharding to give)."""
    aval = jax.typeof(x)
    sharding = aval.sharding if explicit_mesh([aval]) is not None else None
    return jax.numpy.repeat(x, repeats, axis=axis, out_sharding=sharding)


def first_dims_alike(arrays: list) -> list:
    """The arrays with dim 0 sharded alike, as the first one sharded there is, on a mesh of Explicit
    axes (jax.vmap over dim 0 wants that); elsewhere as they are."""
    avals = [jax.typeof(a) for a in arrays]
    if explicit_mesh(avals) is None:
        return list(arrays)
    specs = [tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec)) for a in avals]
    first = next((spec[0] for spec in specs if spec[0] is not None), None)
    return [a if spec[0] == first else jax.sharding.reshard(a, jax.sharding.PartitionSpec(first, *spec[1:]))
            for a, spec in zip(arrays, specs)]


def resharded(value, sharding):
    """value with `sharding`, where the two differ (and `sharding` is of a mesh: the types carry one)."""
    if (not sharding.mesh.axis_names or jax.typeof(value).sharding.spec == sharding.spec
            or value.dtype == jax.dtypes.float0):
        return value
    return jax.sharding.reshard(value, sharding)


def shaped_array_like(shape, dtype, avals, sharding=None):
    """A ShapedArray of `shape` and `dtype` that varies over every mesh axis one of `avals` varies
    over (shard_map's type of a value computed on each device from those), on their mesh; or,
    outside shard_map, typed with `sharding` where one is given (a mesh of Explicit axes)."""
    from jax._src import core
    varying = frozenset().union(*map(varying_axes, avals))
    if not varying:
        return core.ShapedArray(shape, dtype) if sharding is None else core.ShapedArray(shape, dtype, sharding=sharding)
    mesh = next(a.sharding.mesh for a in avals if varying_axes(a))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if hasattr(core, "ManualAxisType"):
        return core.ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=core.ManualAxisType(varying=varying))
    return core.ShapedArray(shape, dtype, sharding=sharding, vma=varying)


def vary(x, axes: tuple):
    """x typed as varying over the mesh axes `axes` too (inside shard_map)."""
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


__all__ = ["apply_primitive", "bind_equation", "user_context", "summarize_source", "eval_context", "body_context",
           "wrapping_differentiated",
           "varying_axes", "spec_like", "shaped_array_like", "vary",
           "partitioned_lowering", "manual_lowering", "require_devices_when_lowering", "spec_of"]


@contextlib.contextmanager
def body_context(eqn):
    """The context jax traced `eqn`'s body in, for tracing it again (planning it, rebuilding it with
    kernels): inside shard_map, its mesh axes bound and manual, as the body's values were typed."""
    from jax._src import config, shard_map
    parts = [getattr(shard_map, n, None) for n in ("_extend_axis_env", "use_abstract_mesh", "_as_manual_mesh")]
    if eqn.primitive.name != "shard_map" or None in parts:  # (a jax without them: traced as before)
        yield
        return
    extend_axis_env, use_abstract_mesh, as_manual_mesh = parts
    params = eqn.params
    manual = params.get("newly_manual_axes", params.get("manual_axes", frozenset()))
    with contextlib.ExitStack() as stack:
        stack.enter_context(extend_axis_env(params["mesh"], manual))
        stack.enter_context(use_abstract_mesh(as_manual_mesh(params["mesh"], manual)))
        if hasattr(config, "_check_vma"):
            stack.enter_context(config._check_vma(params.get("check_vma", True)))
        yield


def eval_context():
    """A context in which jax operations run now, even inside a trace (the autotuner times kernels
    while the user's program is being traced; without this its timing runs would be staged into it)."""
    from jax._src import core
    return core.eval_context()


def partitioned_lowering(ctx) -> bool:
    """Whether the lowering context `ctx` is a program that XLA partitions over several devices
    (jit over sharded arrays), not one device's view (shard_map, pmap, a single device)."""
    from jax._src import sharding_impls
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return set(axis_context.manual_axes) != set(axis_context.mesh.axis_names)
    return False


def manual_lowering(ctx) -> bool:
    """Whether `ctx` lowers one device's share of a partitioned program (shard_map, or a share that
    custom_partitioning builds)."""
    from jax._src import sharding_impls
    return isinstance(ctx.module_context.axis_context, sharding_impls.SPMDAxisContext)


def require_devices_when_lowering(primitive) -> None:
    """jax passes the device assignment to lowering only for primitives that ask (custom_partitioning
    needs it, and xkern's launches lower through it in sharded programs)."""
    from jax._src import dispatch
    dispatch.prim_requires_devices_during_lowering.add(primitive)


def spec_of(sharding, mesh):
    """The PartitionSpec over `mesh` of an operand's sharding as the partitioner hands it to a
    custom_partitioning rule, or None where it has none (a sharding on one device, unknown kinds)."""
    from jax._src import sharding_impls
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return spec
    hlo = getattr(sharding, "_hlo_sharding", None)
    if hlo is None or hlo.is_maximal():
        return None
    try:
        return sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
    except (AssertionError, ValueError):
        return None


# --------------------------------------------------------------------------------------------------
# Functions differentiated inside a traced program
# --------------------------------------------------------------------------------------------------

_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_XKERN_DIR = os.path.dirname(__file__) + os.sep
_XKERN_API = os.path.join(os.path.dirname(__file__), "api.py")
_differentiated = threading.local()


def _install_linearize_hook() -> None:
    """Every reverse-mode derivative in jax (grad, value_and_grad, vjp, and Flax's helpers, which call
    them) starts at `ad.linearize(fun, primals, is_vjp=True, ...)`; wrap it once, so that inside
    `wrapping_differentiated` `fun` passes through the active wrapper first."""
    from jax._src.interpreters import ad
    if getattr(ad.linearize, "_xkern_hook", False):
        return
    original = ad.linearize

    @functools.wraps(original)
    def linearize(traceable, primals, *args, **kwargs):
        wrap = getattr(_differentiated, "wrap", None)
        # Reverse mode only (vjp, grad), and not under forward mode (jacfwd of jacrev): xkern's ops
        # are custom_vjp functions, which jax cannot differentiate forwards.
        # Nor inside a function already replaced (jax traces it within this call): a derivative taken
        # there (a gradient penalty, MAML's inner step) is differentiated again by the outer one, and
        # xkern's backward kernels have no derivatives of their own; its forward is still planned
        # with the outer function's program, whose kernels are differentiated once.
        if (wrap is not None and kwargs.get("is_vjp") and not _asked_by_xkern()
                and not getattr(_differentiated, "inside", False)
                and not any(isinstance(p, ad.JVPTracer) for p in primals)):
            _differentiated.inside = True
            try:
                has_aux = kwargs.get("has_aux", args[0] if args else False)
                return original(wrap(traceable, has_aux), primals, *args, **kwargs)
            finally:
                _differentiated.inside = False
        return original(traceable, primals, *args, **kwargs)

    linearize._xkern_hook = True
    ad.linearize = linearize


def _asked_by_xkern() -> bool:
    """Whether the code that asked jax for this derivative is xkern's own (a kernel's backward rule,
    the planner), not the user's: the first caller outside jax decides. xkern/api.py calls the
    user's function itself (xkern.jit(jax.grad(loss)): jax.grad's own frames, then api.py's), so
    there a derivative is the user's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_JAX_DIR):
        frame = frame.f_back
    return (frame is not None and frame.f_code.co_filename.startswith(_XKERN_DIR)
            and frame.f_code.co_filename != _XKERN_API)


@contextlib.contextmanager
def wrapping_differentiated(wrap):
    """A context in which every function the user's code differentiates in reverse mode is replaced
    by `wrap(fun, has_aux)` before jax differentiates it (None: nothing is replaced); has_aux: fun
    returns (out, aux), aux not differentiated."""
    _install_linearize_hook()
    previous = getattr(_differentiated, "wrap", None)
    _differentiated.wrap = wrap
    try:
        yield
    finally:
        _differentiated.wrap = previous
