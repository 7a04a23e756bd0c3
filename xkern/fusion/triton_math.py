"""Device functions that generated kernels call where triton.language has no portable builtin
(tanh, log1p, expm1, erfc), a different NaN rule (lax.max / reduce_max propagate NaN) or costs more
instructions than the result needs (sigmoid)."""
from xkern.kernels import launch  # first: it fixes Triton's compile/interpret mode

import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRETED = tl.constexpr(launch.INTERPRET)


@triton.jit
def reciprocal_one_plus_exp2(w):
    # 1 / (1 + 2^w), to a few ulp over the whole range: 0 at w = inf, 1 at -inf. fast_dividef is a
    # reciprocal and a multiply (CUDA and ROCm), where `/` and tl.fdiv add range checks and
    # rescaling (tl.fdiv here: 18 instructions an element in gelu(x * a + b) * c, sm_90 SASS;
    # fast_dividef: 14; tanh's form before: 27). Its only inexact range, a denominator above
    # 2^126, gives 0 instead of a result below 1.2e-38.
    d = 1.0 + tl.exp2(w)
    if _INTERPRETED:  # the interpreter has no libdevice
        return 1.0 / d
    return libdevice.fast_dividef(1.0, d)


@triton.jit
def sigmoid(x):
    return reciprocal_one_plus_exp2(x * -1.4426950408889634)


@triton.jit
def tanh_absolute(x):
    # tanh to ~1e-7 absolute error (not relative: 1 - e cancels near 0), for a tanh that is added to
    # a number of order 1 (gelu's 1 + tanh), where only absolute error shows; the series of `tanh`
    # cost 8-11% of a generated gelu kernel on an H200 (it is issue-bound).
    e = tl.exp(-2.0 * tl.abs(x))
    t = tl.fdiv(1.0 - e, 1.0 + e)  # not IEEE-rounded: ~2 ulp, far fewer instructions than `/`
    return tl.where(x < 0, -t, t)


@triton.jit
def tanh_approx(x):
    # PTX's tanh.approx.f32 (CUDA only): one special-function instruction, relative error about
    # 2^-11, below a 16-bit value's own rounding; for soft caps of 16-bit logits and scores.
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def tanh(x):
    # (1 - e) / (1 + e) with e = exp(-2|x|): never overflows; exact sign and limits at +-inf. Below
    # |x| = 0.1, 1 - e cancels (at 1e-4, 3e-5 relative error; 1e-30 gave 0): the odd Taylor series
    # there instead (next term 62/2835 x^9: 2e-10 relative at 0.1), which keeps -0 and tiny x exact.
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.1, series, tanh_absolute(x))


@triton.jit
def log1p(x):
    # Goldberg: log(u) * x / (u - 1) with u = 1 + x keeps full precision for tiny x.
    u = 1.0 + x
    exact = tl.where(u == float("inf"), u, tl.log(u) * (x / (u - 1.0)))  # inf / inf would be NaN
    return tl.where(u == 1.0, x, exact)


@triton.jit
def expm1(x):
    # Kahan: (u - 1) * x / log(u) with u = exp(x), exact near 0; large |x| falls back to u - 1.
    u = tl.exp(x)
    small = (u - 1.0) * (x / tl.log(u))
    return tl.where(u == 1.0, x, tl.where(tl.abs(x) < 0.5, small, u - 1.0))


@triton.jit
def erfc(x):
    # 1 - erf(x) is 0 past x ~ 4 (erfc(4) = 1.5e-8), which ndtr / norm.cdf then log: Numerical
    # Recipes' Chebyshev fit erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), relative error below
    # 1.2e-7 for every z >= 0; erfc(-z) = 2 - erfc(z). 0 at inf, 2 at -inf, NaN kept.
    z = tl.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = -1.13520398 + t * (1.48851587 + t * p)
    p = 0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * p))
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * p))
    tail = t * tl.exp(p - z * z)
    return tl.where(x < 0, 2.0 - tail, tail)


# NaN wins, as in XLA; of +0 and -0, max is +0 and min -0 in either order. The sign of a zero is read
# from its bits: arithmetic on zeros, -(-a - b), did not survive the compile for the GPU (min of +0
# and -0 came out +0 on an H100). The generated kernels compute in float32; `a` may be a literal.
@triton.jit
def _sign_bit(a):
    return tl.cast(a, tl.float32).to(tl.int32, bitcast=True) < 0


@triton.jit
def max_nan(a, b):
    a_negative = _sign_bit(a)
    return tl.where((a > b) | (a != a), a, tl.where((a == b) & ~a_negative, a, b))


@triton.jit
def min_nan(a, b):
    a_negative = _sign_bit(a)
    return tl.where((a < b) | (a != a), a, tl.where((a == b) & a_negative, a, b))
