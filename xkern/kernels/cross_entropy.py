"""Cross-entropy of logits against integer labels over the last axis: Triton kernels with an online
logsumexp (one row per program, streamed in BLOCK_N chunks), custom_vjp, batching, and the public
`cross_entropy`.

Per row of V logits x with label l, smoothing e and z-loss weight z (float32 inside):

    lse  = log(sum(exp(x)))
    loss = lse - (1 - e) * x[l] - (e / V) * sum(x) + z * lse^2          (0 where l == ignore_index)
    dx   = softmax(x) * (1 + 2 z lse) - (1 - e) * onehot(l) - e / V     (times the row's cotangent)

Under a soft cap c (Gemma 2's final logits), x is c * tanh(logits / c), computed as each logit is
read, and dx is multiplied by the cap's derivative, 1 - tanh^2: the capped logits are never written.

Two differentiation strategies, by reduction:
  mean / sum  the forward kernel also writes dx, pre-scaled by the reduction (1 / valid rows), in a
              second pass over the row (read back from L2 where it fits); the backward is dx * g,
              which XLA removes when g is the constant 1 of `jax.grad(loss)`. The logits are not
              saved, and the backward never reads them. On Hopper, for 16-bit rows of 24576 to
              152917 logits with integer labels, cross_entropy_hopper's kernel does this
              reading each row once (kept in shared memory): 3.25x jax.jit against 2.27x.
  none        each row has its own cotangent, unknown in the forward: the forward writes the losses
              and the per-row lse only (as its shift and log-sum); the backward kernel recomputes dx
              from the logits and lse in one pass (reading the logits once, writing dx once).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from xkern.kernels import launch as L  # first: it fixes Triton's mode before the kernels below exist
from xkern.kernels import cross_entropy_hopper
from xkern.kernels.launch import number_error, static_number
from xkern.fusion.triton_math import tanh, tanh_approx

import triton
import triton.language as tl

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
REDUCTIONS = ("mean", "sum", "none")
SELECTED = "selected"  # the kernels' one_hot option of one_hot_cross_entropy(selected=True)


def reference(logits, labels, ignore_index=None, label_smoothing=0.0, z_loss=0.0, reduction="mean", soft_cap=None):
    """The definition the kernels are checked against (and the `xla` backend)."""
    x = soft_capped(logits.astype(jnp.float32), soft_cap)
    n_cols = x.shape[-1]
    labels = int32_labels(labels, ignore_index)
    valid = jnp.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    in_range = (labels >= 0) & (labels < n_cols)
    picked = jnp.take_along_axis(x, jnp.where(in_range, labels, 0)[..., None], -1)[..., 0]
    picked = jnp.where(in_range, picked, jnp.nan)  # a label out of range is an error: NaN, loudly
    lse = jax.nn.logsumexp(x, -1)
    loss = lse - (1 - label_smoothing) * picked + z_loss * lse * lse
    if label_smoothing:
        loss = loss - label_smoothing * jnp.mean(x, -1)
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / jnp.maximum(jnp.sum(valid), 1)


def soft_capped(x, cap):
    """Logits under a soft cap (None: none), cap * tanh(x / cap), as Gemma 2 caps its final logits."""
    return x if not cap else jnp.tanh(x / cap) * cap


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _capped(x, SOFT_CAP: tl.constexpr, FAST_TANH: tl.constexpr):
    """float32 logits under a soft cap c (SOFT_CAP; 0: none): c tanh(x / c), and its derivative
    1 - tanh^2; else x and 1. tanh to a few ulp (triton_math.tanh), or, FAST_TANH (CUDA, 16-bit
    logits), PTX's approximation: relative error about 2^-11, below the 16-bit logits' own rounding
    (a bf16 logit near a cap of 30 is 0.125 from the next)."""
    if SOFT_CAP > 0:  # (one return: the compiler checks every return's type, even one not taken)
        if FAST_TANH:
            t = tanh_approx(x * (1.0 / SOFT_CAP))
        else:
            t = tanh(x * (1.0 / SOFT_CAP))
        y, slope = t * SOFT_CAP, 1.0 - t * t
    else:
        y, slope = x, 1.0
    return y, slope


@triton.jit
def _write_dx_row(x_ptr, dx_ptr, base, label, shift, log_sum, valid, factor, SMOOTHING: tl.constexpr,
                  Z_LOSS: tl.constexpr, ONE_HOT: tl.constexpr, SOFT_CAP: tl.constexpr, FAST_TANH: tl.constexpr,
                  N_COLS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of one row, times `factor` (the reduction's scale, or the row's cotangent), chunk by chunk;
    0 for an ignored row, and, as XLA, NaN across a row holding +inf. A label out of range (its loss
    NaN) takes nothing from the label: dx is the softmax's part alone, as the gradient of the
    program's gather, which drops an index out of range; so a row masked after the loss (HF's -100
    labels, where(labels != -100, loss, 0)) has a cotangent of 0 and a gradient of 0.
    ONE_HOT (a label out of range is a row of zeros): that row's dx is softmax * 0, NaN where the
    softmax is, as the program's gradient; smoothed (optax.smooth_labels), the row's target is
    SMOOTHING / N_COLS everywhere, of mass SMOOTHING: dx = SMOOTHING * softmax - SMOOTHING / N_COLS;
    with z-loss, softmax * (the target's mass + 2 * Z_LOSS * lse) less the target.
    The softmax is exp((x - shift) - log_sum), lse's two parts kept apart: their sum rounds away
    log_sum when the row's max is large (at 1e8, lse = max), which would make every p at the max 1.
    Under a soft cap: dx of the capped logits, times the cap's derivative."""
    cols = tl.arange(0, BLOCK_N)
    in_range = (label >= 0) & (label < N_COLS)
    lse = shift + log_sum
    log_sum = tl.where(log_sum == float("inf"), float("nan"), log_sum)  # a row holding +inf
    for start in range(0, N_COLS, BLOCK_N):
        mask = start + cols < N_COLS
        x, slope = _capped(tl.load(x_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32), SOFT_CAP,
                           FAST_TANH)
        p = tl.exp((x - shift) - log_sum)
        if ONE_HOT and (SMOOTHING != 0.0 or Z_LOSS != 0.0):  # the target's mass: SMOOTHING out of range
            p = p * (tl.where(in_range, 1.0, SMOOTHING) + 2.0 * Z_LOSS * lse)
        elif Z_LOSS != 0.0:
            p = p * (1.0 + 2.0 * Z_LOSS * lse)
        dx = p - tl.where(start + cols == label, 1.0 - SMOOTHING, 0.0)
        if SMOOTHING != 0.0:
            dx -= SMOOTHING / N_COLS
        if SOFT_CAP > 0:
            dx *= slope
        dx = tl.where(valid, dx * factor, p * 0.0 if ONE_HOT else 0.0)
        tl.store(dx_ptr + base + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_valid(label, in_range, ONE_HOT: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
               HAS_IGNORE: tl.constexpr, IGNORE_INDEX: tl.constexpr):
    """Whether a row's loss and gradient count: not ignored; with one-hot targets, a label in range,
    or any label once smoothed (its target is then SMOOTHING / N_COLS everywhere) or with z-loss."""
    if ONE_HOT:
        return in_range | (SMOOTHING != 0.0) | (Z_LOSS != 0.0)
    return (label != IGNORE_INDEX) | (not HAS_IGNORE)


@triton.jit
def _online_lse(x, m, ref, s):
    """One chunk of the online logsumexp: the running max m, its finite shift ref, sum of exp(x - ref)."""
    m = tl.maximum(m, tl.max(x, 0))
    new_ref = tl.where((m == m) & (tl.abs(m) != float("inf")), m, 0.0)
    # (s = 0 stays 0: the first finite max may be far below the placeholder 0, and 0 * inf would be NaN)
    s = tl.where(s > 0, s * tl.exp(ref - new_ref), s) + tl.sum(tl.exp(x - new_ref), 0)
    return m, new_ref, s


@triton.jit
def _neg_inf_outside(x_ptr, base, label, N_COLS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whether a row holds -inf outside the label's class (read again: only rows whose label's own
    logit is -inf get here, never under a soft cap, which maps -inf to -cap)."""
    cols = tl.arange(0, BLOCK_N)
    count = 0
    for start in range(0, N_COLS, BLOCK_N):
        mask = (start + cols < N_COLS) & (start + cols != label)
        x = tl.load(x_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        count += tl.sum((x == -float("inf")).to(tl.int32), 0)
    return count > 0


@triton.jit
def _fwd(x_ptr, labels_ptr, row_scale_ptr,  # inputs: logits [n_rows, N_COLS], labels, dx scale [n_rows]
         n_rows,
         loss_ptr, lse_ptr, dx_ptr,  # outputs: loss [n_rows]; lse [n_rows, 2] (shift, log of the sum
                                     # of exp(x - shift)); dx [n_rows, N_COLS] (WRITE_DX)
         N_COLS: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
         HAS_IGNORE: tl.constexpr, IGNORE_INDEX: tl.constexpr, ONE_HOT: tl.constexpr, WRITE_DX: tl.constexpr,
         SOFT_CAP: tl.constexpr, FAST_TANH: tl.constexpr, SELECTED: tl.constexpr, BLOCK_N: tl.constexpr):
    # Each program takes every num_programs-th row (see PROGRAMS_PER_SM for how many programs).
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)  # (a Python int in the interpreter)
        base = row * N_COLS
        label = tl.load(labels_ptr + row)
        in_range = (label >= 0) & (label < N_COLS)
        valid = _row_valid(label, in_range, ONE_HOT, SMOOTHING, Z_LOSS, HAS_IGNORE, IGNORE_INDEX)
        cols = tl.arange(0, BLOCK_N)
        # Online logsumexp with a scalar running max (one exp per element): the max is shifted to 0
        # when not finite, so rows of -inf give lse = -inf and rows holding +inf give +inf, as XLA.
        # Whole chunks load without a mask; the last, partial one (if any) with -inf past the row.
        m = -float("inf")
        ref = 0.0
        s = 0.0
        total = 0.0
        lowest = tl.full([BLOCK_N], float("inf"), tl.float32)  # ONE_HOT: per lane, see below
        for start in range(0, N_COLS // BLOCK_N * BLOCK_N, BLOCK_N):
            x, _ = _capped(tl.load(x_ptr + base + start + cols).to(tl.float32), SOFT_CAP, FAST_TANH)
            m, ref, s = _online_lse(x, m, ref, s)
            if SMOOTHING != 0.0:
                total += tl.sum(x, 0)
            if ONE_HOT and not SELECTED:
                lowest = tl.minimum(lowest, x)
        if N_COLS % BLOCK_N != 0:
            start = N_COLS // BLOCK_N * BLOCK_N
            mask = start + cols < N_COLS
            x = tl.load(x_ptr + base + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            if SOFT_CAP > 0:  # (past the row: -inf, not the cap's -c)
                x = tl.where(mask, _capped(x, SOFT_CAP, FAST_TANH)[0], -float("inf"))
            m, ref, s = _online_lse(x, m, ref, s)
            if SMOOTHING != 0.0:
                total += tl.sum(tl.where(mask, x, 0.0), 0)
            if ONE_HOT and not SELECTED:
                lowest = tl.minimum(lowest, tl.where(mask, x, float("inf")))
        log_sum = tl.log(s)
        lse = log_sum + ref
        picked, _ = _capped(tl.load(x_ptr + base + tl.where(in_range, label, 0)).to(tl.float32), SOFT_CAP, FAST_TANH)
        picked = tl.where(in_range, picked, float("nan"))
        loss = lse - (1.0 - SMOOTHING) * picked + Z_LOSS * lse * lse
        if ONE_HOT and (SMOOTHING != 0.0 or Z_LOSS != 0.0):  # out of range: the smoothing's mass, the z-loss
            loss = tl.where(in_range, loss, SMOOTHING * lse + Z_LOSS * lse * lse)
        if SMOOTHING != 0.0:
            loss -= SMOOTHING / N_COLS * total
        loss = tl.where(valid, loss, 0.0)
        if ONE_HOT and SMOOTHING == 0.0:
            # -sum(one_hot * log_softmax) multiplies every other class's log-probability by 0: NaN
            # wherever a logit is not finite. +inf and NaN show in the sum; -inf in the row's
            # lowest value (one min per element), unless it is the label's own, then counted.
            # SELECTED (XLA's select(one_hot, log_softmax, 0)): the label's log-probability alone
            not_finite = (log_sum != log_sum) | (log_sum == float("inf"))
            if SELECTED:
                not_finite &= in_range
            elif tl.min(lowest, 0) == -float("inf"):
                not_finite |= (picked != -float("inf")) | ~in_range
                if (picked == -float("inf")) & in_range:
                    not_finite |= _neg_inf_outside(x_ptr, base, label, N_COLS, BLOCK_N)
            loss = tl.where(not_finite, float("nan"), loss)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + 2 * row, ref)
        tl.store(lse_ptr + 2 * row + 1, log_sum)
        if WRITE_DX:
            _write_dx_row(x_ptr, dx_ptr, base, label, ref, log_sum, valid, tl.load(row_scale_ptr + row),
                          SMOOTHING, Z_LOSS, ONE_HOT, SOFT_CAP, FAST_TANH, N_COLS, BLOCK_N)


@triton.jit
def _bwd(x_ptr, labels_ptr, lse_ptr, g_ptr,  # inputs: logits [n_rows, N_COLS]; labels, lse (_fwd's), dloss
         n_rows,
         dx_ptr,  # output: dx [n_rows, N_COLS]
         N_COLS: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
         HAS_IGNORE: tl.constexpr, IGNORE_INDEX: tl.constexpr, ONE_HOT: tl.constexpr, SOFT_CAP: tl.constexpr,
         FAST_TANH: tl.constexpr, BLOCK_N: tl.constexpr):
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)  # (a Python int in the interpreter)
        base = row * N_COLS
        label = tl.load(labels_ptr + row)
        in_range = (label >= 0) & (label < N_COLS)
        valid = _row_valid(label, in_range, ONE_HOT, SMOOTHING, Z_LOSS, HAS_IGNORE, IGNORE_INDEX)
        _write_dx_row(x_ptr, dx_ptr, base, label, tl.load(lse_ptr + 2 * row), tl.load(lse_ptr + 2 * row + 1), valid,
                      tl.load(g_ptr + row),
                      SMOOTHING, Z_LOSS, ONE_HOT, SOFT_CAP, FAST_TANH, N_COLS, BLOCK_N)


# --------------------------------------------------------------------------------------------------
# Configs and launchers
# --------------------------------------------------------------------------------------------------

def default_config(n_cols: int, backend: str) -> L.Config:
    """Rows streamed in chunks. From the H200 sweep (benchmarks/results/h200-ce-sweep.json,
    8192x128256 bf16): 4096-wide chunks with 4 warps are best for value and gradient (1.567 ms) and
    within 4% of the best forward (8192 / 4 warps)."""
    if backend == "interpret":
        return L.Config.of(BLOCK_N=min(L.next_pow2(n_cols), 1 << 14))
    block_n = min(L.next_pow2(n_cols), 4096)
    return L.Config.of(BLOCK_N=block_n, num_warps=max(1, min(4, block_n // 256)))


def programs(n_rows: int, backend: str) -> int:
    """How many programs share the rows (each loops over every programs-th row)."""
    if backend == "interpret":
        return n_rows
    return max(1, min(n_rows, PROGRAMS_PER_SM * getattr(jax.devices()[0], "core_count", 132)))


# Swept on an H200 (h200-cross-entropy-sweep.json): 1-8 programs per SM, meant to keep the rows in
# flight within L2 for the dx pass, were all slower than one program per row (this cap).
PROGRAMS_PER_SM = 64


def _launch_fwd(x2, labels, row_scale, *, backend, config, constexprs, in_place=False, **_):
    """in_place: dx overwrites the logits (each row's dx pass reads a chunk before writing it), for
    callers whose logits are a temporary (linear_cross_entropy)."""
    n_rows, n_cols, lead = L.n_rows(x2), x2.shape[-1], x2.shape[:-1]
    consts = _with_tanh(constexprs, x2.dtype, backend)
    aliases = {0: 2} if in_place and consts["WRITE_DX"] else None
    if backend == "triton" and cross_entropy_hopper.applies(n_cols, x2.dtype.itemsize, consts) and L.hopper():
        return cross_entropy_hopper.launch_fwd(x2, labels, row_scale, uncapped(consts), backend, aliases)
    outs = [jax.ShapeDtypeStruct(lead, jnp.float32), jax.ShapeDtypeStruct((*lead, 2), jnp.float32),
            jax.ShapeDtypeStruct(x2.shape if consts["WRITE_DX"] else (1,), x2.dtype)]
    return L.launch(_fwd, x2, labels, row_scale, n_rows, kernel="cross_entropy_fwd", out_shapes=outs,
                    grid=(programs(n_rows, backend),), config=config, backend=backend, constexprs=consts,
                    aliases=aliases)


def _launch_bwd(x2, labels, lse, g, *, backend, config, constexprs, in_place=False, **_):
    out = jax.ShapeDtypeStruct(x2.shape, x2.dtype)
    return L.launch(_bwd, x2, labels, lse, g, L.n_rows(x2), kernel="cross_entropy_bwd", out_shapes=[out],
                    grid=(programs(L.n_rows(x2), backend),), config=config, backend=backend,
                    constexprs=_with_tanh(constexprs, x2.dtype, backend), aliases={0: 0} if in_place else None)


def _with_tanh(constexprs, dtype, backend) -> dict:
    """The constexprs with FAST_TANH decided: PTX's tanh for a soft cap of 16-bit logits on CUDA."""
    consts = dict(constexprs)
    consts["FAST_TANH"] = bool(consts["SOFT_CAP"]) and backend == "triton" and dtype != jnp.float32 \
        and L.vendor() == "cuda"
    return consts


def uncapped(consts: dict) -> dict:
    """cross_entropy_hopper's constexprs: the kernel takes no soft cap (applies declines one)."""
    return {name: value for name, value in consts.items() if name not in ("SOFT_CAP", "FAST_TANH")}


def _batch_fwd(args, dims, **params):
    """Rows fold like every row kernel's (L.batch_rows), except the [1] dx placeholder of a forward
    that does not write dx, which each example gets back as is."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    write_dx = dict(params["constexprs"])["WRITE_DX"]

    def relaunch(*folded, **params):
        loss, lse, dx = _launch_fwd(*folded, **params)
        return loss, lse, dx if write_dx else jnp.broadcast_to(dx, (size, 1))

    return L.batch_rows(relaunch)(args, dims, **params)


L.def_batching("cross_entropy_fwd", _batch_fwd)
L.def_batching("cross_entropy_bwd", L.batch_rows(_launch_bwd))


def _split(params) -> L.Split:
    """Rows split across devices, along any of their dims (the views keep them: _rows_views), the
    mean's 1 / valid rows computed outside, over all rows; the [1] dx placeholder of a forward that
    does not write dx is shared. A vocabulary sharded across devices (tensor parallelism's logits,
    x @ w with w sharded by column) splits too, where _vocab_splits: each device launches on its
    own classes (_vocab_fwd, _vocab_bwd)."""
    in_place = bool(params["aliases"])
    consts = dict(params["constexprs"])
    fwd = params["kernel"].endswith("_fwd")
    dx = L.ROWS if not fwd or consts["WRITE_DX"] else L.SHARED
    vocab, last = {}, len(params["out_shapes"][0].shape) - (0 if fwd else 1)  # (the rows' dims: loss's, dx's less one)
    if _vocab_splits(consts):
        vocab = dict(heads_args=(last, None, None) if fwd else (last, None, None, None),
                     heads_outs=(None, None, last if dx == L.ROWS else None) if fwd else (last,),
                     heads_fits=lambda parts: True,
                     heads_relaunch=functools.partial(_vocab_fwd if fwd else _vocab_bwd, in_place=in_place))
    relaunch = _launch_fwd if fwd else _launch_bwd
    return L.with_row_dims(L.Split((L.ROWS,) * (3 if fwd else 4), (L.ROWS, L.ROWS, dx) if fwd else (L.ROWS,),
                                   functools.partial(relaunch, in_place=in_place), **vocab), last)


def vocab_splits(one_hot: bool, smoothing: float, z_loss: float, ignores_a_class: bool = False) -> bool:
    """Whether the kernels split along a sharded vocabulary (_vocab_fwd): not smoothed (its terms
    read every class and the whole row's length), nor one-hot targets with a z-loss (a label out of
    range would take a rule of its own in the backward kernel), nor an ignore_index that is a class
    (a device's own index of its label could equal it)."""
    return smoothing == 0.0 and not (one_hot and z_loss != 0.0) and not ignores_a_class


def _vocab_splits(consts: dict) -> bool:
    ignores_a_class = consts["HAS_IGNORE"] and 0 <= consts["IGNORE_INDEX"] < consts["N_COLS"]
    return vocab_splits(consts["ONE_HOT"], consts["SMOOTHING"], consts["Z_LOSS"], ignores_a_class)


def _local_labels(labels, heads, n_local: int, consts: dict):
    """Each row's label among this device's classes, n_local (out of range: no class of its) where
    another device has it, ignore_index kept; and whether this device has it."""
    local = labels - jax.lax.axis_index(heads) * n_local
    owned = (local >= 0) & (local < n_local)
    local = jnp.where(owned, local, n_local)
    if consts["HAS_IGNORE"]:
        local = jnp.where(labels == consts["IGNORE_INDEX"], labels, local)
    return local, owned


def _global_lse(lse, heads):
    """Each row's (shift, log_sum) over every device's classes from each device's own: a logsumexp
    of logsumexps, shifted by the largest finite max (a device's share of -inf logits has none;
    one holding +inf or NaN has log_sum +inf or NaN, which carries through)."""
    shift, log_sum = lse[..., 0], lse[..., 1]
    top = jax.lax.pmax(jnp.where(jnp.isfinite(log_sum), shift, -jnp.inf), heads)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    log_sum = jnp.log(jax.lax.psum(jnp.exp(shift - top + log_sum), heads))
    return jnp.stack([top, log_sum], -1)


def _vocab_fwd(x2, labels, row_scale, *, heads, backend, config, constexprs, in_place=False, **_):
    """_launch_fwd on one device's classes: the kernel's logsumexp of them, combined across devices
    (two all-reduces of a float per row), the label's logit from the device that has it (a third),
    each row's loss from those as the kernel computes it, then dx, if asked for, from the backward
    kernel at the whole row's logsumexp (one more pass over the logits than the one-device kernel,
    which writes dx as it goes: it knows the row's lse by then)."""
    consts, n_local = dict(constexprs), x2.shape[-1]
    local, owned = _local_labels(labels, heads, n_local, consts)
    part = {**consts, "N_COLS": n_local, "WRITE_DX": False, "ONE_HOT": False, "SELECTED": False}
    _, lse, _ = _launch_fwd(x2, local, row_scale, backend=backend, config=config, constexprs=part)
    lse = _global_lse(lse, heads)
    at_label = jnp.take_along_axis(x2, jnp.clip(local, 0, n_local - 1)[..., None], -1)[..., 0]
    picked = jax.lax.psum(jnp.where(owned, soft_capped(at_label.astype(jnp.float32), consts["SOFT_CAP"] or None), 0.0),
                          heads)
    loss = _vocab_loss(x2, labels, owned & (at_label == -jnp.inf), lse, picked, heads, consts)
    if not consts["WRITE_DX"]:
        return loss, lse, jnp.zeros((1,), x2.dtype)
    (dx,) = _vocab_bwd(x2, labels, lse, row_scale, heads=heads, backend=backend, config=config,
                       constexprs={k: v for k, v in consts.items() if k not in ("WRITE_DX", "SELECTED")},
                       in_place=in_place)
    return loss, lse, dx


def _vocab_loss(x2, labels, label_at_neg_inf, lse, picked, heads, consts):
    """Each row's loss, as _fwd computes it, from the whole row's lse and the label's logit (NaN for
    a label out of range); one-hot targets: 0 there, and NaN where the program's 0 * log_softmax is
    (a row holding +inf or NaN, or, but for XLA's select, -inf outside the label's class: this
    device's -infs less its label's own, label_at_neg_inf)."""
    in_range = (labels >= 0) & (labels < consts["N_COLS"])
    total = lse[..., 0] + lse[..., 1]
    if not consts["ONE_HOT"]:
        loss = total - jnp.where(in_range, picked, jnp.nan) + consts["Z_LOSS"] * total * total
        return jnp.where(labels == consts["IGNORE_INDEX"], 0.0, loss) if consts["HAS_IGNORE"] else loss
    loss = jnp.where(in_range, total - picked, 0.0)  # (no z-loss: vocab_splits)
    not_finite = jnp.isnan(lse[..., 1]) | (lse[..., 1] == jnp.inf)
    if consts["SELECTED"]:
        not_finite &= in_range
    elif not consts["SOFT_CAP"]:  # (a cap maps -inf to -cap)
        others = jnp.sum(x2 == -jnp.inf, -1, dtype=jnp.int32) - label_at_neg_inf
        not_finite |= jax.lax.psum(others, heads) > 0
    return jnp.where(not_finite, jnp.nan, loss)


def _vocab_bwd(x2, labels, lse, g, *, heads, backend, config, constexprs, in_place=False, **_):
    """_launch_bwd on one device's classes, at the whole row's lse: no collective. One-hot targets:
    the rule of integer labels (a label another device has: the softmax's part alone) where the
    label is in range, and a cotangent of 0 where it is not (a target of 0: dx = softmax * 0)."""
    consts = dict(constexprs)
    local, _ = _local_labels(labels, heads, x2.shape[-1], consts)
    if consts["ONE_HOT"]:
        g = jnp.where((labels >= 0) & (labels < consts["N_COLS"]), g, 0.0)
    return _launch_bwd(x2, local, lse, g, backend=backend, config=config,
                       constexprs={**consts, "N_COLS": x2.shape[-1], "ONE_HOT": False}, in_place=in_place)


L.def_split("cross_entropy_fwd", _split)
L.def_split("cross_entropy_bwd", _split)


# --------------------------------------------------------------------------------------------------
# Differentiation
# --------------------------------------------------------------------------------------------------

def _consts(n_cols, ignore_index, smoothing, z_loss, write_dx=None, one_hot=False, soft_cap=None) -> dict:
    """The kernels' constexprs (FAST_TANH is decided at launch, by _with_tanh); one_hot: False, True
    or SELECTED (the forward's SELECTED: the backward's dx is the same)."""
    consts = {"N_COLS": n_cols, "SMOOTHING": float(smoothing), "Z_LOSS": float(z_loss),
              "HAS_IGNORE": ignore_index is not None,
              "IGNORE_INDEX": -1 if ignore_index is None else int(ignore_index), "ONE_HOT": bool(one_hot),
              "SOFT_CAP": float(soft_cap or 0.0), "FAST_TANH": False}
    return consts if write_dx is None else {**consts, "WRITE_DX": write_dx, "SELECTED": one_hot == SELECTED}


def _row_scale(labels, ignore_index, reduction):
    """Each row's factor in the reduced loss: 1 / valid rows for "mean" (0 rows: 0), else 1."""
    valid = jnp.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    if reduction == "mean":
        return valid, jnp.full(labels.shape, 1.0, jnp.float32) / jnp.maximum(jnp.sum(valid), 1)
    return valid, jnp.ones(labels.shape, jnp.float32)


def _reduce(loss, labels, ignore_index, reduction):
    valid, _ = _row_scale(labels, ignore_index, reduction)
    if reduction == "none":
        return loss
    total = jnp.sum(loss)
    return total if reduction == "sum" else total / jnp.maximum(jnp.sum(valid), 1)


@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _ce(x2, labels, ignore_index, smoothing, z_loss, reduction, backend, config, one_hot=False, soft_cap=None):
    """(The loss reduced, each row's (shift, log_sum): its logsumexp's two parts, each row's loss; the
    last two's cotangents are not read: loss_rows gives them their gradients.)"""
    consts = _consts(x2.shape[-1], ignore_index, smoothing, z_loss, write_dx=False, one_hot=one_hot, soft_cap=soft_cap)
    scale = jnp.zeros(labels.shape, jnp.float32)
    loss, lse, _ = _launch_fwd(x2, labels, scale, backend=backend, config=config, constexprs=consts)
    return _reduce(loss, labels, ignore_index, reduction), lse, loss


def _ce_fwd(x2, labels, ignore_index, smoothing, z_loss, reduction, backend, config, one_hot=False, soft_cap=None):
    write_dx = reduction != "none"
    consts = _consts(x2.shape[-1], ignore_index, smoothing, z_loss, write_dx=write_dx, one_hot=one_hot,
                     soft_cap=soft_cap)
    _, scale = _row_scale(labels, ignore_index, reduction)
    loss, lse, dx = _launch_fwd(x2, labels, scale, backend=backend, config=config, constexprs=consts)
    out = _reduce(loss, labels, ignore_index, reduction)
    if write_dx:
        return (out, lse, loss), (dx, labels)
    return (out, lse, loss), (x2, labels, lse)


def _ce_bwd(ignore_index, smoothing, z_loss, reduction, backend, config, one_hot, soft_cap, residuals, g):
    g = g[0]
    if reduction != "none":
        dx, labels = residuals
        # dx already holds the reduction's scale: g is the cotangent of the scalar loss (usually
        # the constant 1 of jax.grad, which XLA folds away).
        return (dx * g.astype(dx.dtype)).astype(dx.dtype), None
    x2, labels, lse = residuals
    consts = _consts(x2.shape[-1], ignore_index, smoothing, z_loss, one_hot=one_hot, soft_cap=soft_cap)
    (dx,) = _launch_bwd(x2, labels, lse, g.astype(jnp.float32), backend=backend, config=config,
                        constexprs=consts)
    return dx, None


_ce.defvjp(_ce_fwd, _ce_bwd)


def row_weights(labels, ignore_index, reduction, weights):
    """Each row's factor in the reduced loss, float32 (see cross_entropy's weights): _row_scale's
    without weights; else the weights, 0 on ignored rows, over their sum for "mean" (0 where the
    sum is 0)."""
    valid, scale = _row_scale(labels, ignore_index, reduction)
    if weights is None:
        return scale
    weights = weights.reshape(labels.shape).astype(jnp.float32) * valid
    if reduction != "mean":
        return weights
    total = jnp.sum(weights)
    return weights / jnp.where(total == 0, 1.0, total)


def weighted_rows(loss, weights, zero_where_unweighted):
    """loss * weights per row; zero_where_unweighted: rows of weight 0 give 0 even where their loss
    is not finite, as where(mask, loss, 0) does (loss * 0 would be NaN there)."""
    if zero_where_unweighted:
        return jnp.where(weights != 0, loss * weights, 0.0)
    return loss * weights


def _sum(loss, weights, zero_where_unweighted):
    """sum(loss * weights) over the rows (see weighted_rows)."""
    return jnp.sum(weighted_rows(loss, weights, zero_where_unweighted))


@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9, 10))
def _weighted_sum(x2, labels, weights, ignore_index, smoothing, z_loss, backend, config, zero_where_unweighted=False,
                  one_hot=False, soft_cap=None):
    """(sum(loss * weights) over the rows (see _sum), each row's lse pair and loss as _ce's); differentiated,
    the forward also writes dx (scaled by each row's weight: NaN * 0 where a row of weight 0 is not
    finite, as jax.jit's gradient of either form), and the weights' gradient is the rows' losses."""
    consts = _consts(x2.shape[-1], ignore_index, smoothing, z_loss, write_dx=False, one_hot=one_hot, soft_cap=soft_cap)
    loss, lse, _ = _launch_fwd(x2, labels, weights, backend=backend, config=config, constexprs=consts)
    return _sum(loss, weights, zero_where_unweighted), lse, loss


def _weighted_sum_fwd(x2, labels, weights, ignore_index, smoothing, z_loss, backend, config,
                      zero_where_unweighted=False, one_hot=False, soft_cap=None):
    consts = _consts(x2.shape[-1], ignore_index, smoothing, z_loss, write_dx=True, one_hot=one_hot, soft_cap=soft_cap)
    loss, lse, dx = _launch_fwd(x2, labels, weights, backend=backend, config=config, constexprs=consts)
    return (_sum(loss, weights, zero_where_unweighted), lse, loss), (dx, loss)


def _weighted_sum_bwd(ignore_index, smoothing, z_loss, backend, config, zero_where_unweighted, one_hot, soft_cap,
                      residuals, g):
    dx, loss = residuals
    g = g[0]
    return (dx * g.astype(dx.dtype)).astype(dx.dtype), None, loss * g


_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def loss_rows(x2, labels, lse, rows, ignore_index, smoothing, z_loss, one_hot, soft_cap, backend, config):
    """Each row's loss `rows`, from a forward kernel (with its lse pair): its gradient, where it has
    one, by the backward kernel, as reduction="none"'s (one more pass). With labels of -1 and no
    options (no target), `rows` is the rows' logsumexp, and its gradient their softmax."""
    return rows


def _loss_rows_fwd(x2, labels, lse, rows, ignore_index, smoothing, z_loss, one_hot, soft_cap, backend, config):
    return rows, (x2, labels, lse)


def _loss_rows_bwd(ignore_index, smoothing, z_loss, one_hot, soft_cap, backend, config, residuals, g):
    x2, labels, lse = residuals
    consts = _consts(x2.shape[-1], ignore_index, smoothing, z_loss, one_hot=one_hot, soft_cap=soft_cap)
    (dx,) = _launch_bwd(x2, labels, lse, g.astype(jnp.float32), backend=backend, config=config, constexprs=consts)
    return dx, None, jnp.zeros_like(lse), jnp.zeros_like(g)


loss_rows.defvjp(_loss_rows_fwd, _loss_rows_bwd)


def _outputs(out, lse, rows, x2, labels1, shape, options: tuple, backend, config, return_lse: bool,
             return_rows: bool):
    """out, or (out, what was asked for beside it): each row's logsumexp, each row's loss, float32 of
    the labels' `shape`, each with its gradient. options: (ignore_index, smoothing, z_loss, one_hot,
    soft_cap), the kernels'."""
    lse, extra = jax.lax.stop_gradient(lse), []
    if return_lse:
        no_target = jnp.full(labels1.shape, -1, jnp.int32)
        extra.append(loss_rows(x2, no_target, lse, lse[..., 0] + lse[..., 1], None, 0.0, 0.0, False, options[-1],
                               backend, config).reshape(shape))
    if return_rows:
        extra.append(loss_rows(x2, labels1, lse, jax.lax.stop_gradient(rows), *options, backend, config).reshape(shape))
    return (out, *extra) if extra else out


def _reference_outputs(out, rows, logits, soft_cap, return_lse: bool, return_rows: bool):
    """_outputs' for the reference path (backend "xla", or no rows): rows, the reference's own."""
    extra = [jax.nn.logsumexp(soft_capped(logits.astype(jnp.float32), soft_cap), -1)] if return_lse else []
    return (out, *extra, *([rows] if return_rows else [])) if extra or return_rows else out


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------

INT32 = np.iinfo(np.int32)


def _rows_views(logits, labels):
    """The kernels' views: logits [*rows, V], labels [*rows], the rows' dims kept, so that a mesh
    sharding any of them splits the launches there (launch.with_row_dims)."""
    x2 = L.rows_view(logits)
    return x2, labels.reshape(x2.shape[:-1])


def int32_labels(labels, ignore_index=None):
    """`labels` as int32, as the kernels read them. A wider label beyond int32's range (int64 under
    jax_enable_x64, uint32) would wrap onto a class or onto ignore_index: it becomes INT32.max
    instead (INT32.max - 1 when that is ignore_index), out of [0, V) as it was."""
    xp = np if isinstance(labels, (np.ndarray, np.generic)) else jnp  # numpy's: before jnp.asarray wraps them
    labels = xp.asarray(labels)
    wide = np.iinfo(labels.dtype)
    if wide.min < INT32.min or wide.max > INT32.max:
        inside = xp.clip(labels, max(wide.min, INT32.min), min(wide.max, INT32.max))
        labels = xp.where(inside == labels, labels, INT32.max - int(ignore_index == INT32.max))
    return jnp.asarray(labels).astype(jnp.int32)


def _check(logits, labels, ignore_index, label_smoothing, z_loss, reduction, op="cross_entropy", weights=None):
    """Raises for a bad argument; returns (label_smoothing, z_loss) as Python floats (see check_soft_cap)."""
    if not hasattr(logits, "dtype") or not hasattr(logits, "shape"):
        raise TypeError(f"{op}: logits must be a jax or numpy array; got {type(logits).__name__}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: logits must have dtype float32, bfloat16 or float16; got {logits.dtype}")
    if logits.ndim == 0:
        raise ValueError(f"{op}: logits must have a class axis (last); got a scalar")
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{op}: labels must be an integer array; got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: labels must have shape {tuple(logits.shape[:-1])} (logits without "
                         f"the class axis); got {tuple(labels.shape)}")
    if ignore_index is not None and (not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool)):
        raise TypeError(f"{op}: ignore_index must be an int or None; got {ignore_index!r}")
    if ignore_index is not None and not INT32.min <= ignore_index <= INT32.max:
        # the kernels compare it with int32 labels (as a constant of theirs)
        raise ValueError(f"{op}: ignore_index must be in int32's range [{INT32.min}, {INT32.max}]; "
                         f"got {ignore_index!r}")
    smoothing, z = static_number(label_smoothing), static_number(z_loss)
    if smoothing is None or not 0.0 <= smoothing <= 1.0:
        raise number_error(op, "label_smoothing", "a number in [0, 1]", label_smoothing)
    if z is None or not (z >= 0 and math.isfinite(z)):
        raise number_error(op, "z_loss", "a non-negative number", z_loss)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    check_weights(op, labels, weights)
    return smoothing, z


def check_soft_cap(op, soft_cap) -> float | None:
    """soft_cap as a Python float, or None; raises unless it is None or a positive finite number."""
    if soft_cap is None:
        return None
    cap = static_number(soft_cap)
    if cap is None or not (cap > 0 and math.isfinite(cap)):
        raise number_error(op, "soft_cap", "None or a positive finite number", soft_cap)
    return cap


def check_bool(op, name, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool; got {value!r}")


def check_weights(op, labels, weights):
    """Raises unless weights is None or a float array of labels' shape."""
    if weights is not None and not (hasattr(weights, "dtype") and jnp.issubdtype(weights.dtype, jnp.floating)
                                    and tuple(weights.shape) == tuple(labels.shape)):
        raise ValueError(f"{op}: weights must be None or a float array of labels' shape {tuple(labels.shape)}; "
                         f"got {getattr(weights, 'dtype', type(weights).__name__)} "
                         f"{tuple(getattr(weights, 'shape', ()))}")


def check_mask(op, labels, weights, mask):
    """Raises unless mask is None, or a bool array of labels' shape given with weights."""
    if mask is None:
        return
    if weights is None:
        raise ValueError(f"{op}: mask is given with weights (the rows' factors); got weights=None")
    if not (hasattr(mask, "dtype") and mask.dtype == jnp.bool_ and tuple(mask.shape) == tuple(labels.shape)):
        raise ValueError(f"{op}: mask must be None or a bool array of labels' shape {tuple(labels.shape)}; "
                         f"got {getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")


def cross_entropy(logits, labels, *, ignore_index: int | None = None, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, reduction: str = "mean", weights=None, soft_cap: float | None = None,
                  return_lse: bool = False, return_rows: bool = False, backend: str | None = None):
    """Softmax cross-entropy of `logits` [..., V] against integer `labels` [...], float32 math.

    ignore_index: rows with this label add 0 to the loss and get zero gradients; "mean" divides by
        the number of other rows (0 when there are none). Labels outside [0, V) otherwise give NaN
        (int64 ones beyond int32's range too: they are not wrapped into it).
    label_smoothing: the target puts 1 - e on the label and e / V on every class (optax's form).
    z_loss: adds z * logsumexp(logits)^2 per row (PaLM's auxiliary loss).
    reduction: "mean", "sum" or "none" (a float32 loss per row, shaped like labels).
    weights: a float per row (labels' shape), such as a padding mask: "none" returns weights * loss,
        "sum" their sum, "mean" that sum over the sum of the weights (0 where they sum to 0; ignored
        rows weigh 0). Given here rather than applied to reduction="none"'s rows, the gradient is
        still made in the forward pass.
    soft_cap: the loss of the logits capped first, soft_cap * tanh(logits / soft_cap) (Gemma 2's
        final logits), in the kernels' float32: the capped logits are never written.
    return_lse, return_rows: also return each row's logsumexp of the (capped) logits, and each row's
        loss before weights and reduction (0 where ignored), float32 shaped like labels, from the
        same pass: (loss, lse, rows), as asked (a z-loss or a loss's sum kept for metrics). Where they
        are differentiated, their gradients take one more pass over the logits each.
    """
    label_smoothing, z_loss = _check(logits, labels, ignore_index, label_smoothing, z_loss, reduction,
                                     weights=weights)
    soft_cap = check_soft_cap("cross_entropy", soft_cap)
    check_bool("cross_entropy", "return_lse", return_lse)
    check_bool("cross_entropy", "return_rows", return_rows)
    backend = L.resolve_backend(backend)
    logits, labels = jnp.asarray(logits), int32_labels(labels, ignore_index)
    asked = dict(return_lse=return_lse, return_rows=return_rows)
    if backend == "xla" or logits.size == 0:  # (no rows, or no classes: each row's loss is NaN)
        rows = reference(logits, labels, ignore_index, label_smoothing, z_loss, "none", soft_cap)
        if weights is not None and reduction != "none":
            out = jnp.sum(rows * row_weights(labels, ignore_index, reduction, weights))
        else:
            out = reference(logits, labels, ignore_index, label_smoothing, z_loss, reduction, soft_cap)
            out = out if weights is None else out * weights  # (reduction "none")
        return _reference_outputs(out, rows, logits, soft_cap, **asked)
    n_cols = logits.shape[-1]
    (x2, labels1), config = _rows_views(logits, labels), default_config(n_cols, backend)
    if weights is not None and reduction != "none":
        out, lse, rows = _weighted_sum(x2, labels1, row_weights(labels, ignore_index, reduction, weights).reshape(labels1.shape),
                                       ignore_index, label_smoothing, z_loss, backend, config, False, False, soft_cap)
    else:
        out, lse, rows = _ce(x2, labels1, ignore_index, label_smoothing, z_loss, reduction, backend, config, False,
                             soft_cap)
        out = out.reshape(labels.shape) if reduction == "none" else out
        out = out if weights is None else out * weights  # (reduction "none")
    options = (ignore_index, label_smoothing, z_loss, False, soft_cap)
    return _outputs(out, lse, rows, x2, labels1, labels.shape, options, backend, config, **asked)


def where_masked_sum(logits, labels, mask, *, scale=1.0, z_loss: float = 0.0, soft_cap: float | None = None,
                     return_lse: bool = False, return_rows: bool = False, backend: str | None = None):
    """sum(where(mask, loss, 0)) * scale over the rows (mask: a bool per row; scale: a scalar, such
    as 1 / the count of true rows, or one per row, such as 1 / its sequence's count), as programs mask padding after the loss (where(labels != -100,
    loss, 0)), the gradient made in the forward pass: jax.jit's value and gradient, a masked row's
    gradient NaN where its logits make the softmax NaN (0 * NaN in jax.jit's backward). The scale
    is each kept row's weight, so the forward's dx is final. What the patterns replace such programs
    with. return_lse, return_rows: as cross_entropy's (every row's, masked ones too)."""
    backend = L.resolve_backend(backend)
    soft_cap = check_soft_cap("where_masked_sum", soft_cap)
    check_bool("where_masked_sum", "return_lse", return_lse)
    check_bool("where_masked_sum", "return_rows", return_rows)
    logits, labels = jnp.asarray(logits), int32_labels(labels)
    mask = jnp.asarray(mask).reshape(labels.shape)
    weights = jnp.where(mask, jnp.asarray(scale, jnp.float32), 0.0)
    asked = dict(return_lse=return_lse, return_rows=return_rows)
    if backend == "xla" or logits.size == 0:
        rows = reference(logits, labels, z_loss=z_loss, reduction="none", soft_cap=soft_cap)
        return _reference_outputs(jnp.sum(jnp.where(mask, rows * weights, 0.0)), rows, logits, soft_cap, **asked)
    n_cols = logits.shape[-1]
    (x2, labels1), config = _rows_views(logits, labels), default_config(n_cols, backend)
    out, lse, rows = _weighted_sum(x2, labels1, weights.reshape(labels1.shape), None, 0.0, float(z_loss), backend, config,
                                   True, False, soft_cap)
    options = (None, 0.0, float(z_loss), False, soft_cap)
    return _outputs(out, lse, rows, x2, labels1, labels.shape, options, backend, config, **asked)


def one_hot_cross_entropy(logits, labels, *, label_smoothing: float = 0.0, z_loss: float = 0.0, weights=None,
                          mask=None, soft_cap: float | None = None, return_lse: bool = False,
                          return_rows: bool = False, selected: bool = False, backend: str | None = None):
    """-sum(one_hot(labels, V) * log_softmax(logits), -1) per row, float32, as programs write it
    (optax.softmax_cross_entropy of a one-hot target): a label outside [0, V) is a row of zeros, so
    its loss and gradient are 0; a logit that is not finite outside the label's class makes the
    row's loss NaN (0 * inf), and its gradient is the softmax's. What the patterns replace such
    programs with; for new code, `cross_entropy` says what it means. label_smoothing e: the target
    smoothed as optax.smooth_labels does, (1 - e) * one_hot + e / V (a label out of range: e / V
    everywhere). z_loss: plus z * logsumexp(logits)^2 on every row, whatever its label.
    weights: a float per row (labels' shape): then sum(loss * weights) over the rows (a mean: 1 / n
    each), the gradient made in the forward pass. mask: with weights, a bool per row; rows where it is
    false add 0 even where their loss is NaN (as where(mask, loss * weights, 0); XLA computes
    loss * mask.astype(float) so). soft_cap, return_lse, return_rows: as cross_entropy's.
    selected: the program's one_hot * log_softmax is select(one_hot, log_softmax, 0), as XLA computes
    it on some platforms and dtypes (xkern.fusion.lowering.xla_selects_bool_product): then only the
    label's log-probability counts, and a logit of -inf outside its class does not make the loss NaN."""
    label_smoothing, z_loss = _check(logits, labels, None, label_smoothing, z_loss, "none", "one_hot_cross_entropy",
                                     weights=weights)
    soft_cap = check_soft_cap("one_hot_cross_entropy", soft_cap)
    check_bool("one_hot_cross_entropy", "return_lse", return_lse)
    check_bool("one_hot_cross_entropy", "return_rows", return_rows)
    check_bool("one_hot_cross_entropy", "selected", selected)
    backend = L.resolve_backend(backend)
    check_mask("one_hot_cross_entropy", labels, weights, mask)
    logits, labels = jnp.asarray(logits), int32_labels(labels)
    if mask is not None:
        weights = jnp.where(mask, weights.astype(jnp.float32), 0.0)
    n_cols = logits.shape[-1]
    asked = dict(return_lse=return_lse, return_rows=return_rows)
    if backend == "xla" or logits.size == 0:
        target = (1.0 - label_smoothing) * jax.nn.one_hot(labels, n_cols) + label_smoothing / max(n_cols, 1)
        x = soft_capped(logits.astype(jnp.float32), soft_cap)
        products = target * jax.nn.log_softmax(x, -1)
        products = jnp.where(target != 0, products, 0.0) if selected else products
        rows = -jnp.sum(products, -1) + z_loss * jnp.square(jax.nn.logsumexp(x, -1))
        out = rows if weights is None else _sum(rows, weights.astype(jnp.float32).reshape(rows.shape),
                                                 mask is not None)
        return _reference_outputs(out, rows, logits, soft_cap, **asked)
    (x2, labels1), config = _rows_views(logits, labels), default_config(n_cols, backend)
    one_hot = SELECTED if selected else True
    if weights is not None:
        out, lse, rows = _weighted_sum(x2, labels1, weights.reshape(labels1.shape).astype(jnp.float32), None, label_smoothing,
                                       z_loss, backend, config, mask is not None, one_hot, soft_cap)
    else:
        out, lse, rows = _ce(x2, labels1, None, label_smoothing, z_loss, "none", backend, config, one_hot, soft_cap)
        out = out.reshape(labels.shape)
    options = (None, label_smoothing, z_loss, one_hot, soft_cap)
    return _outputs(out, lse, rows, x2, labels1, labels.shape, options, backend, config, **asked)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile cases
# --------------------------------------------------------------------------------------------------

def aot_cases():
    """(name, kernel, signature, config[, targets]) for both kernels, plain and with every option,
    and cross_entropy_hopper's."""
    for dtype in ("fp32", "bf16"):
        for n_cols in (1000, 128256):
            one_hot = [{"ONE_HOT": True}, {"ONE_HOT": True, "SMOOTHING": 0.1},
                       {"ONE_HOT": True, "SMOOTHING": 0.1, "Z_LOSS": 1e-4}] if (dtype, n_cols) == ("bf16", 128256) else []
            for options in ({}, {"SMOOTHING": 0.1, "Z_LOSS": 1e-4, "HAS_IGNORE": True, "IGNORE_INDEX": -100},
                            *one_hot):
                consts = {**_consts(n_cols, None, 0.0, 0.0), **options}
                config = default_config(n_cols, "triton").replace(**consts)
                kind = ("/one_hot" if "ONE_HOT" in options else "/options") if options else ""
                kind += "_smoothed" if "ONE_HOT" in options and "SMOOTHING" in options else ""
                kind += "_z_loss" if "ONE_HOT" in options and "Z_LOSS" in options else ""
                tag = f"cross_entropy/{dtype}/n{n_cols}{kind}"
                yield (f"{tag}/fwd", _fwd,
                       {"x_ptr": f"*{dtype}", "labels_ptr": "*i32", "row_scale_ptr": "*fp32",
                        "n_rows": "i32", "loss_ptr": "*fp32", "lse_ptr": "*fp32", "dx_ptr": f"*{dtype}"},
                       config.replace(WRITE_DX=True, SELECTED=False))
                yield (f"{tag}/bwd", _bwd,
                       {"x_ptr": f"*{dtype}", "labels_ptr": "*i32", "lse_ptr": "*fp32",
                        "g_ptr": "*fp32", "n_rows": "i32", "dx_ptr": f"*{dtype}"}, config)
    # cross_entropy_hopper's kernel (Hopper only): 14 chunks and a tail, 6 chunks with every option;
    # one-hot targets with a tail kept (a -inf beside the label NaN or, SELECTED, not), 17 chunks overflowing through the ring, and 3 chunks,
    # one-hot, smoothed, with z-loss
    for dtype, n_cols, options in (("bf16", 128256, {}),
                                   ("fp16", 50304, {"SMOOTHING": 0.1, "Z_LOSS": 1e-4, "HAS_IGNORE": True,
                                                    "IGNORE_INDEX": -100}),
                                   ("bf16", 128256, {"ONE_HOT": True}), ("bf16", 128256, {"ONE_HOT": True, "SELECTED": True}),
                                   ("bf16", 256000, {}),
                                   ("bf16", 32000, {"ONE_HOT": True, "SMOOTHING": 0.1, "Z_LOSS": 1e-4})):
        consts = {**_consts(n_cols, None, 0.0, 0.0, write_dx=True), **options}
        kind = ("/one_hot" if "ONE_HOT" in options else "") + ("/selected" if "SELECTED" in options else "") + (
            "/options" if set(options) - {"ONE_HOT", "SELECTED"} else "")
        name = f"cross_entropy/{dtype}/n{n_cols}{kind}/lse_dx"
        yield (name, cross_entropy_hopper.lse_dx,
               {"x_ptr": f"*{dtype}", "labels_ptr": "*i32", "row_scale_ptr": "*fp32", "n_rows": "i32",
                "loss_ptr": "*fp32", "lse_ptr": "*fp32", "dx_ptr": f"*{dtype}"},
               cross_entropy_hopper.config(n_cols).replace(**uncapped(consts)), ("sm_90",))
    # a soft cap (Gemma 2's vocabulary): tanh in full everywhere, PTX's approximation on CUDA
    for fast, targets in ((False, None), (True, ("sm_90",))):
        config = default_config(256000, "triton").replace(**{**_consts(256000, None, 0.0, 0.0, soft_cap=30.0),
                                                             "FAST_TANH": fast})
        tag = f"cross_entropy/bf16/n256000/soft_cap{'_fast_tanh' if fast else ''}"
        yield (f"{tag}/fwd", _fwd, {"x_ptr": "*bf16", "labels_ptr": "*i32", "row_scale_ptr": "*fp32", "n_rows": "i32",
                                    "loss_ptr": "*fp32", "lse_ptr": "*fp32", "dx_ptr": "*bf16"},
               config.replace(WRITE_DX=True, SELECTED=False), *([targets] if targets else []))
        yield (f"{tag}/bwd", _bwd, {"x_ptr": "*bf16", "labels_ptr": "*i32", "lse_ptr": "*fp32", "g_ptr": "*fp32",
                                    "n_rows": "i32", "dx_ptr": "*bf16"}, config, *([targets] if targets else []))
