"""The lax primitive -> Triton expression table: one small function per primitive.

Inside a generated kernel every floating value is float32 (half-precision inputs are upcast on load,
and a convert_element_type to a half type rounds through it, so rounding points match the program);
int32 values stay int32 and booleans are int1. Each rule returns a source fragment.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

SUPPORTED_DTYPES = frozenset({"float32", "bfloat16", "float16", "int32", "bool"})
FLOATS = frozenset({"float32", "bfloat16", "float16"})
TL_DTYPE = {"float32": "tl.float32", "bfloat16": "tl.bfloat16", "float16": "tl.float16",
            "int32": "tl.int32", "bool": "tl.int1"}


def dtype_name(aval) -> str:
    """numpy's name for an array dtype; a typed PRNG key's own (`key<fry>`, not a numpy dtype)."""
    return _dtype_name(aval.dtype)


@functools.cache  # (numpy's dtype.name takes microseconds, and the passes ask it of every equation)
def _dtype_name(dtype) -> str:
    return str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype).name


def xla_selects_bool_product(chain: tuple) -> bool:
    """Whether XLA, on this process's platform, computes x * m, m a bool converted through the dtype
    names `chain` (the last is the product's), as select(m, x, 0): then a non-finite x where m is
    false gives 0, not NaN (0 * inf), and a replacement must do the same. It depends on the platform
    and the dtypes (seen: the GPU selects in float32, bfloat16 and float16; the CPU not in bfloat16,
    which it computes as float32 between converts that hide the mask), so XLA is asked: a product
    of NaN by a converted False, compiled and run once per platform and chain."""
    return _selects(jax.default_backend(), tuple(chain))


@functools.cache
def _selects(platform: str, chain: tuple) -> bool:
    def product(x, m):
        for name in chain:
            m = m.astype(name)
        return x * m

    x, m = np.full(1, np.nan, jax.numpy.dtype(chain[-1])), np.zeros(1, bool)
    with jax.ensure_compile_time_eval():  # (inside a trace too: run here, not staged into it)
        return bool(np.asarray(jax.jit(product)(x, m))[0] == 0)


def _binary(op):
    return lambda a, eqn: f"({a[0]} {op} {a[1]})"


def _call(fn):
    return lambda a, eqn: f"{fn}({', '.join(a)})"


def _is_float(eqn, i=0) -> bool:
    return dtype_name(eqn.invars[i].aval) in FLOATS


def _div(a, eqn):
    return f"({a[0]} / {a[1]})"  # floats only: `supported` leaves integer division to XLA


def _integer_pow(a, eqn):
    y = eqn.params["y"]
    if y == 0:
        return f"(tl.zeros_like({a[0]}) + 1)"  # 1 for inf and NaN too, as XLA (x * 0 + 1 is NaN)
    body = " * ".join([a[0]] * abs(y))
    return f"({body})" if y > 0 else f"(1.0 / ({body}))"


def _convert(a, eqn):
    src, dst = dtype_name(eqn.invars[0].aval), np.dtype(eqn.params["new_dtype"]).name
    if dst == "bool":
        return f"({a[0]} != 0)"
    if dst in ("bfloat16", "float16"):  # round to the half type, keep computing in float32
        return f"{a[0]}.to({TL_DTYPE[dst]}).to(tl.float32)"
    if dst == "float32":
        return a[0] if src in FLOATS else f"{a[0]}.to(tl.float32)"
    return f"{a[0]}.to({TL_DTYPE[dst]})"


def _select_n(a, eqn):
    pred = a[0] if dtype_name(eqn.invars[0].aval) == "bool" else f"({a[0]} != 0)"
    return f"tl.where({pred}, {a[2]}, {a[1]})"


def _sign(a, eqn):
    x = a[0]
    if _is_float(eqn):  # NaN stays NaN, as lax.sign
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, {x}))"
    return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0))"


def _neg(a, eqn):
    # Triton before 3.7 negates a float as 0 - x, which is +0 for x = +0: XLA's neg gives -0.
    return f"({a[0]} * -1.0)" if _is_float(eqn) else f"(-{a[0]})"


def _max(a, eqn):
    return f"max_nan({a[0]}, {a[1]})" if _is_float(eqn) else f"tl.maximum({a[0]}, {a[1]})"


def _min(a, eqn):
    return f"min_nan({a[0]}, {a[1]})" if _is_float(eqn) else f"tl.minimum({a[0]}, {a[1]})"


def _clamp(a, eqn):
    lo, x, hi = a
    return _min([_max([x, lo], eqn), hi], eqn)


ELEMENTWISE = {
    "add": _binary("+"), "sub": _binary("-"), "mul": _binary("*"), "div": _div,
    "add_any": _binary("+"),  # the sum of cotangents in a backward pass
    "max": _max, "min": _min, "clamp": _clamp,
    "neg": _neg, "abs": _call("tl.abs"), "sign": _sign,
    "exp": _call("tl.exp"), "exp2": _call("tl.exp2"), "log": _call("tl.log"),
    "log1p": _call("log1p"), "expm1": _call("expm1"), "sqrt": _call("tl.sqrt"),
    "rsqrt": _call("tl.rsqrt"), "tanh": _call("tanh"), "logistic": _call("sigmoid"),
    "erf": _call("tl.erf"), "erfc": _call("erfc"),
    "sin": _call("tl.sin"), "cos": _call("tl.cos"),
    "floor": _call("tl.floor"), "ceil": _call("tl.ceil"),
    "integer_pow": _integer_pow, "square": lambda a, e: f"({a[0]} * {a[0]})",
    "one_minus_square": lambda a, e: f"(1.0 - {a[0]} * {a[0]})",  # jax 0.11's tanh derivative
    "convert_element_type": _convert, "select_n": _select_n,
    "lt": _binary("<"), "le": _binary("<="), "gt": _binary(">"), "ge": _binary(">="),
    "eq": _binary("=="), "ne": _binary("!="),
    "and": _binary("&"), "or": _binary("|"), "xor": _binary("^"),
    "not": lambda a, e: f"(~{a[0]})" if dtype_name(e.invars[0].aval) != "bool" else f"({a[0]} == 0)",
    "is_finite": lambda a, e: f"(tl.abs({a[0]}) < float('inf'))",
    "stop_gradient": lambda a, e: a[0], "copy": lambda a, e: a[0], "copy_p": lambda a, e: a[0],
}
FLOAT_ONLY = frozenset({"exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "logistic",
                        "one_minus_square", "erf", "erfc", "sin", "cos", "floor", "ceil", "is_finite"})
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
SHAPE_OPS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})


def supported(eqn) -> str | None:
    """Why `eqn` cannot go into a generated kernel, or None if it can."""
    name = eqn.primitive.name
    if name not in ELEMENTWISE and name not in REDUCTIONS and name not in SHAPE_OPS:
        return f"primitive {name}"
    for v in (*eqn.invars, *eqn.outvars):
        if dtype_name(v.aval) not in SUPPORTED_DTYPES:
            return f"dtype {dtype_name(v.aval)}"
    if name in FLOAT_ONLY and not _is_float(eqn):
        return f"{name} on {dtype_name(eqn.invars[0].aval)}"
    # Cases where Triton's result is undefined and XLA's is defined: keep them with XLA.
    if name == "div" and not _is_float(eqn):
        return "integer division (division by zero is defined in XLA, not in Triton)"
    if (name == "convert_element_type" and _is_float(eqn)
            and np.dtype(eqn.params["new_dtype"]).name in ("int32",)):
        return "float to integer conversion (NaN and out-of-range values differ)"
    if name == "select_n" and len(eqn.invars) != 3:
        return "select_n with more than two cases"
    return None


def reduction(eqn, value: str, mask: str) -> str:
    """A last-axis reduction of a [BLOCK_M, BLOCK_N] value to [BLOCK_M, 1], masked lanes neutral."""
    kind = REDUCTIONS[eqn.primitive.name]
    is_float = _is_float(eqn)
    if kind == "sum":
        neutral = "0.0" if is_float else "0"
        return f"tl.sum(tl.where({mask}, {value}, {neutral}), axis=1)[:, None]"
    if is_float:
        neutral = "-float('inf')" if kind == "max" else "float('inf')"
        fn = "max_nan" if kind == "max" else "min_nan"
        return f"tl.reduce(tl.where({mask}, {value}, {neutral}), 1, {fn})[:, None]"
    neutral = "-2147483648" if kind == "max" else "2147483647"
    return f"tl.{kind}(tl.where({mask}, {value}, {neutral}), axis=1)[:, None]"


def literal(value, aval) -> str:
    v = np.asarray(value).item()
    name = dtype_name(aval)
    if name == "bool":
        return "1" if v else "0"
    if name in FLOATS:
        if np.isnan(v):
            return "float('nan')"
        if np.isinf(v):
            return "float('inf')" if v > 0 else "-float('inf')"
        return repr(float(v))
    return str(int(v))
