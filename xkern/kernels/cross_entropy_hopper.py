"""Cross-entropy's value and gradient for Hopper GPUs in Gluon, reading the logits once.

cross_entropy._fwd (mean / sum reductions) reads each row twice, once for its logsumexp and once
for dx, and writes dx: three passes over the logits, 6.3 GB at 8192 x 128256 bf16, whose second
read comes from HBM (the rows do not stay in L2 between the passes at that width). Here one program
per SM keeps most of its row in shared memory, in a ring of 14 slots of 8192 logits (224 KB of the
227) that a loader warp fills by TMA:

    loader    1 warp: each of the program's rows in turn, chunk by chunk into the next free slot
              (ready / empty mbarriers per slot): the overflow chunks (see below), the first
              N_CHUNKS (at most 14), then the overflow chunks again
    compute   16 warps: the row's logsumexp from its chunks (the overflow ones freed at once), then
              from its tail, the part past the whole chunks, by plain loads, kept in registers; its
              loss; then dx from the same chunks, freeing each slot as it goes, so the loader's
              copies of the rest overlap this row's dx stores

A row of up to 16 chunks has no overflow: its tail past 14 chunks (2 chunks or less) stays in
registers, so at 8192 x 128256 (a tail of 13568) 2.1 GB are read and 2.1 GB written. Wider rows'
whole chunks past 14 go through the ring twice (read twice from HBM), the rest is the tail. Rows
narrower than 14 chunks share the ring (a 6-chunk row and the next two are in flight together).

H200, 8192 x 128256 bf16, value and gradient (session 34): 1.26-1.27 ms, 3.25-3.27x jax.jit's 4.13
(the Triton kernel: 1.82 in the same run, 2.27x); 1.31 with the tail read twice. What bounds it is
instruction issue as much as memory: about 16 instructions per logit (two exps, the running max
and sum, dx's two fmas, conversions) over 16 warps; 8 warps took 1.54 ms, the chunk loops unrolled
(an instruction cache overflow) 4.9, a running max per row of a chunk (shuffles each chunk) 4.9.
Wider rows (session 35, same run): 8192 x 151936 1.461 ms against the Triton kernel's 1.743 and the
tail's plain loads' 1.753 (4 overflow chunks); 4096 x 256000 1.416 against 1.744 and 1.739 (17).

Integer labels (ignore_index, label smoothing, z-loss) or one-hot targets at 16 bits, rows a
multiple of 8 wide (TMA's 16-byte strides) and at least MIN_COLS, where it wins; the rest keeps
cross_entropy._fwd, as does the interpreter (which cannot run Gluon), so tests check this kernel by
compiling it for sm_90 (and on a GPU, by value). The formulas and the handling of rows that are not
finite are cross_entropy._fwd's and _write_dx_row's, with the running max kept per thread (over its
8 logits of each row of a chunk) and the parts combined once per row.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from xkern.kernels import launch as L

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@builtin
def _reinterpret(smem, dtype, shape, layout, _semantic=None):
    """smem's bytes as another shape and layout (Triton 3.6: _reinterpret, 3.9: reinterpret)."""
    view = getattr(smem, "reinterpret", None) or smem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


BOX = gl.constexpr(256)  # logits a TMA copy brings (a box is at most 256 elements a side)
CHUNK_BOXES = gl.constexpr(32)  # boxes a chunk: 8192 logits, 16 KB at 16 bits, under one mbarrier
CHUNK = gl.constexpr(BOX.value * CHUNK_BOXES.value)
SLOTS = gl.constexpr(14)  # the ring: 224 KB of the 227 a program may have (3 KB left for barriers)
LOG2E = gl.constexpr(1.4426950408889634)
NUM_WARPS = 16  # compute warps (and the loader's 1): 8 left the exps' latency exposed (1.54 ms against 1.34)


@gluon.jit
def _issue_chunk(desc, bufs, ready, row, c, slot):
    """TMA copies of chunk c of row `row` into ring slot `slot`, under its barrier."""
    mbarrier.expect(ready.index(slot), CHUNK_BOXES * desc.block_type.nbytes)
    for b in range(CHUNK_BOXES):
        _tma_load(desc, [row, (c * CHUNK_BOXES + b) * BOX], ready.index(slot), bufs.index(slot * CHUNK_BOXES + b))


@gluon.jit
def _online_lse(x, m, ref, s):
    """cross_entropy._online_lse over each thread's 8 logits of each row of a chunk, in the thread
    alone (no shuffles): running max m, its finite shift ref, sum of exp(x - ref) (NaN carried in
    s; all -inf gives s = 0). The row's parts are combined once, at its end (_combine)."""
    m = gl.maximum(m, gl.max(x, 2))
    new_ref = gl.where((m == m) & (gl.abs(m) != float("inf")), m, 0.0)
    s = gl.where(s > 0, s * gl.exp2((ref - new_ref) * LOG2E), s)
    s += gl.sum(gl.exp2((x - new_ref[:, :, None]) * LOG2E), 2)
    return m, new_ref, s


@gluon.jit
def _chunk_lse(chunks, ready, empty, j, layout: gl.constexpr, m, ref, s, total, lowest, SMOOTHING: gl.constexpr,
               FIND_NEG_INF: gl.constexpr, FREE: gl.constexpr):
    """_online_lse over the ring's j-th copy, once it has landed, with its sum and lowest value;
    FREE: its slot freed after (an overflow chunk, read again for dx)."""
    slots: gl.constexpr = ready.type.shape[0]
    mbarrier.wait(ready.index(j % slots), (j // slots) & 1)
    x = chunks.index(j % slots).load(layout).to(gl.float32)
    if FREE:
        mbarrier.arrive(empty.index(j % slots), count=1)
    m, ref, s = _online_lse(x, m, ref, s)
    if SMOOTHING != 0.0:
        total += gl.sum(x, 2)
    if FIND_NEG_INF:
        lowest = gl.minimum(lowest, gl.min(x, 2))
    return m, ref, s, total, lowest


@gluon.jit
def _tail_lse(tail, cols, m, ref, s, total, lowest, SMOOTHING: gl.constexpr, FIND_NEG_INF: gl.constexpr,
              N_COLS: gl.constexpr):
    """_online_lse over a block of the tail (its lanes past the row hold -inf), its sum and its
    lowest value (FIND_NEG_INF)."""
    x = tail.to(gl.float32)
    m, ref, s = _online_lse(x, m, ref, s)
    if SMOOTHING != 0.0:
        total += gl.sum(gl.where(cols < N_COLS, x, 0.0), 2)
    if FIND_NEG_INF:
        lowest = gl.minimum(lowest, gl.min(gl.where(cols < N_COLS, x, float("inf")), 2))
    return m, ref, s, total, lowest


@gluon.jit
def _neg_inf_beside(x_ptr, base, label, N_COLS: gl.constexpr):
    """Whether the row holds -inf anywhere but at the label (read again, in blocks of 2 logits a
    thread, so that it needs few registers beside the tail kept in them: only for a row whose
    label's logit is -inf, rare)."""
    cols = gl.arange(0, 2 * 32 * gl.num_warps(), gl.BlockedLayout([2], [32], [gl.num_warps()], [0]))
    found = gl.zeros_like(cols)
    for start in range(0, N_COLS, cols.shape[0]):
        x = gl.load(x_ptr + base + start + cols, mask=start + cols < N_COLS, other=0.0)
        found |= ((x == -float("inf")) & (start + cols != label)).to(gl.int32)
    return gl.max(found, 0) > 0


@gluon.jit
def _combine(m, ref, s):
    """(shift, log_sum) of a row from its threads' parts: the same step, over the parts."""
    m_row = gl.max(gl.max(m, 1), 0)
    shift = gl.where((m_row == m_row) & (gl.abs(m_row) != float("inf")), m_row, 0.0)
    part = gl.where(s > 0, s * gl.exp2((ref - shift) * LOG2E), s)
    return shift, gl.log(gl.sum(gl.sum(part, 1), 0))


@gluon.jit
def _dx(x, cols, label, shift, log_sum2, scale, hit, miss, valid, ONE_HOT: gl.constexpr):
    """_write_dx_row's dx for logits x at columns cols, with the row's constants folded (one fma for
    the exponent, one for the result): log_sum2 = log_sum * LOG2E, scale = factor * (the target's
    mass + 2 Z_LOSS lse), hit / miss = the target at the label / elsewhere, times factor. 0 where
    the row is not valid; ONE_HOT: factor is 0 there instead, so dx = softmax * 0, NaN where the
    softmax is, as the one-hot program's gradient."""
    p = gl.exp2((x - shift) * LOG2E - log_sum2)
    dx = p * scale + gl.where(cols == label, -hit, -miss)
    return dx if ONE_HOT else gl.where(valid, dx, 0.0)


@gluon.constexpr_function
def _overflow(n_cols, n_chunks):
    """Whole chunks past the first n_chunks that go through the ring (twice): none where the rest
    is 2 chunks or less (kept in registers, 16 a thread at 16 warps)."""
    rest = n_cols - n_chunks * CHUNK.value
    return rest // CHUNK.value if rest > 2 * CHUNK.value else 0


@gluon.jit
def _issue_next(desc, bufs, ready, empty, row, c, j):
    """Chunk c of row `row` into the ring's j-th slot (j counted over all the program's copies), once
    the compute warps have freed it."""
    slots: gl.constexpr = ready.type.shape[0]
    mbarrier.wait(empty.index(j % slots), ((j // slots) & 1) ^ 1)  # (a fresh barrier passes phase 1)
    _issue_chunk(desc, bufs, ready, row, c, j % slots)
    return j + 1


@gluon.jit
def _loader(desc, bufs, ready, empty, n_rows, N_CHUNKS: gl.constexpr, OVER: gl.constexpr):
    """1 warp: each of the program's rows in turn, into the ring's slots as the compute warps free
    them: its OVER overflow chunks (past the first N_CHUNKS) for the logsumexp, its first N_CHUNKS
    (kept for dx), then the overflow chunks again for dx."""
    j = 0
    for row in range(gl.program_id(0), n_rows, gl.num_programs(0)):
        for c in range(OVER):
            j = _issue_next(desc, bufs, ready, empty, row, N_CHUNKS + c, j)
        for c in range(N_CHUNKS):
            j = _issue_next(desc, bufs, ready, empty, row, c, j)
        for c in range(OVER):
            j = _issue_next(desc, bufs, ready, empty, row, N_CHUNKS + c, j)


@gluon.jit
def _rows(x_ptr, labels_ptr, row_scale_ptr, n_rows, loss_ptr, lse_ptr, dx_ptr, chunks, ready, empty,
          N_COLS: gl.constexpr, SMOOTHING: gl.constexpr, Z_LOSS: gl.constexpr, HAS_IGNORE: gl.constexpr,
          IGNORE_INDEX: gl.constexpr, ONE_HOT: gl.constexpr, SELECTED: gl.constexpr, N_CHUNKS: gl.constexpr):
    """The compute warps: each row's loss and lse from its chunks (its overflow chunks, streamed
    through the ring, then its first N_CHUNKS, then its tail), then its dx (the first N_CHUNKS from
    the ring, freeing them, the overflow chunks streamed again, the tail).
    ONE_HOT: cross_entropy._fwd's one-hot targets (a label out of range a row of zeros; unsmoothed,
    a logit of -inf beside the label makes the loss NaN, found by a running min, one more
    instruction a logit; SELECTED: it does not, as XLA's select(one_hot, log_softmax, 0))."""
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    # a chunk as [boxes, 32, 8]: each thread holds 8 consecutive logits (16 bytes) of each of its rows
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [gl.num_warps(), 1, 1], [2, 1, 0])
    part_layout: gl.constexpr = gl.SliceLayout(2, layout)
    cols = (gl.arange(0, CHUNK_BOXES, gl.SliceLayout(1, part_layout))[:, None, None] * BOX
            + gl.arange(0, 32, gl.SliceLayout(0, part_layout))[None, :, None] * 8
            + gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :])
    # a tail of up to 2 chunks past the first N_CHUNKS is kept in registers (16 a thread, at 16
    # warps); past that, whole chunks overflow through the ring (read twice), the rest in registers
    OVER: gl.constexpr = _overflow(N_COLS, N_CHUNKS)
    PER_ROW: gl.constexpr = N_CHUNKS + 2 * OVER  # the ring's copies a row
    RESIDENT: gl.constexpr = (N_CHUNKS + OVER) * CHUNK  # (where the tail starts)
    TAIL: gl.constexpr = N_COLS - RESIDENT
    FIND_NEG_INF: gl.constexpr = ONE_HOT and SMOOTHING == 0.0 and not SELECTED
    it = 0
    for row in range(gl.program_id(0), n_rows, gl.num_programs(0)):
        j0 = it * PER_ROW  # the ring's count of copies before this row's
        base = row.to(gl.int64) * N_COLS
        label = gl.load(labels_ptr + row)
        in_range = (label >= 0) & (label < N_COLS)
        if ONE_HOT:  # (cross_entropy._row_valid's)
            valid = in_range | (SMOOTHING != 0.0) | (Z_LOSS != 0.0)
        else:
            valid = (label != IGNORE_INDEX) | (not HAS_IGNORE)
        picked = gl.load(x_ptr + base + gl.where(in_range, label, 0)).to(gl.float32)
        # the tail: up to 2 blocks of CHUNK loaded now and kept for dx
        tail = gl.load(x_ptr + base + RESIDENT + cols, mask=RESIDENT + cols < N_COLS, other=-float("inf"))
        if TAIL > CHUNK:
            tail2 = gl.load(x_ptr + base + RESIDENT + CHUNK + cols, mask=RESIDENT + CHUNK + cols < N_COLS,
                            other=-float("inf"))

        # the row's logsumexp: the chunks in shared memory (the overflow's freed at once), then the tail
        m = gl.full([CHUNK_BOXES, 32], -float("inf"), gl.float32, part_layout)
        ref = gl.zeros([CHUNK_BOXES, 32], gl.float32, part_layout)
        s = gl.zeros([CHUNK_BOXES, 32], gl.float32, part_layout)
        total = gl.zeros([CHUNK_BOXES, 32], gl.float32, part_layout)
        lowest = gl.full([CHUNK_BOXES, 32], float("inf"), gl.float32, part_layout)
        for c in range(OVER):
            m, ref, s, total, lowest = _chunk_lse(chunks, ready, empty, j0 + c, layout, m, ref, s, total, lowest,
                                                  SMOOTHING, FIND_NEG_INF, True)
        for c in range(N_CHUNKS):  # (not unrolled: 14 chunks' code, twice, overflowed the instruction cache)
            m, ref, s, total, lowest = _chunk_lse(chunks, ready, empty, j0 + OVER + c, layout, m, ref, s, total,
                                                  lowest, SMOOTHING, FIND_NEG_INF, False)
        if TAIL > 0:
            m, ref, s, total, lowest = _tail_lse(tail, RESIDENT + cols, m, ref, s, total, lowest, SMOOTHING,
                                                 FIND_NEG_INF, N_COLS)
        if TAIL > CHUNK:
            m, ref, s, total, lowest = _tail_lse(tail2, RESIDENT + CHUNK + cols, m, ref, s, total, lowest,
                                                 SMOOTHING, FIND_NEG_INF, N_COLS)
        shift, log_sum = _combine(m, ref, s)
        lse = shift + log_sum
        picked = gl.where(in_range, picked, float("nan"))
        loss = lse - (1.0 - SMOOTHING) * picked + Z_LOSS * lse * lse
        if ONE_HOT and (SMOOTHING != 0.0 or Z_LOSS != 0.0):  # out of range: the smoothing's mass, the z-loss
            loss = gl.where(in_range, loss, SMOOTHING * lse + Z_LOSS * lse * lse)
        if SMOOTHING != 0.0:
            loss -= SMOOTHING / N_COLS * gl.sum(gl.sum(total, 1), 0)
        loss = gl.where(valid, loss, 0.0)
        if FIND_NEG_INF:  # cross_entropy._fwd's: 0 * inf is NaN wherever a logit is not finite
            not_finite = (log_sum != log_sum) | (log_sum == float("inf"))
            if gl.min(gl.min(lowest, 1), 0) == -float("inf"):
                not_finite |= (picked != -float("inf")) | ~in_range
                if (picked == -float("inf")) & in_range:
                    not_finite |= _neg_inf_beside(x_ptr, base, label, N_COLS)
            loss = gl.where(not_finite, float("nan"), loss)
        gl.store(loss_ptr + row, loss)
        gl.store(lse_ptr + 2 * row, shift)
        gl.store(lse_ptr + 2 * row + 1, log_sum)

        # dx: each chunk from shared memory, its slot then freed for the loader's next row
        factor = gl.load(row_scale_ptr + row)
        log_sum2 = gl.where(log_sum == float("inf"), float("nan"), log_sum) * LOG2E  # (a row holding +inf: NaN)
        if ONE_HOT:  # (see _dx)
            factor = gl.where(valid, factor, 0.0)
        if ONE_HOT and (SMOOTHING != 0.0 or Z_LOSS != 0.0):  # the target's mass: SMOOTHING out of range
            scale = factor * (gl.where(in_range, 1.0, SMOOTHING) + 2.0 * Z_LOSS * lse)
        elif Z_LOSS != 0.0:
            scale = factor * (1.0 + 2.0 * Z_LOSS * lse)
        else:
            scale = factor
        hit = (1.0 - SMOOTHING + SMOOTHING / N_COLS) * factor  # (the smoothing's e / N_COLS on every class)
        miss = SMOOTHING / N_COLS * factor
        for c in range(N_CHUNKS):
            slot = (j0 + OVER + c) % SLOTS
            x = chunks.index(slot).load(layout).to(gl.float32)
            mbarrier.arrive(empty.index(slot), count=1)  # (after every warp's read: the arrive syncs them)
            dx = _dx(x, cols, label - c * CHUNK, shift, log_sum2, scale, hit, miss, valid, ONE_HOT)
            gl.store(dx_ptr + base + c * CHUNK + cols, dx.to(dtype))
        for c in range(OVER):  # (the overflow chunks again, as the first N_CHUNKS free their slots)
            j = j0 + OVER + N_CHUNKS + c
            mbarrier.wait(ready.index(j % SLOTS), (j // SLOTS) & 1)
            x = chunks.index(j % SLOTS).load(layout).to(gl.float32)
            mbarrier.arrive(empty.index(j % SLOTS), count=1)
            at = (N_CHUNKS + c) * CHUNK
            dx = _dx(x, cols, label - at, shift, log_sum2, scale, hit, miss, valid, ONE_HOT)
            gl.store(dx_ptr + base + at + cols, dx.to(dtype))
        # (the tail's lanes past the row hold -inf: their dx, not stored, is finite)
        if TAIL > 0:
            dx = _dx(tail.to(gl.float32), cols, label - RESIDENT, shift, log_sum2, scale, hit, miss, valid, ONE_HOT)
            gl.store(dx_ptr + base + RESIDENT + cols, dx.to(dtype), mask=RESIDENT + cols < N_COLS)
        if TAIL > CHUNK:
            at = RESIDENT + CHUNK
            dx = _dx(tail2.to(gl.float32), cols, label - at, shift, log_sum2, scale, hit, miss, valid, ONE_HOT)
            gl.store(dx_ptr + base + at + cols, dx.to(dtype), mask=at + cols < N_COLS)
        it += 1


@gluon.jit
def lse_dx(x_ptr, labels_ptr, row_scale_ptr, n_rows, loss_ptr, lse_ptr, dx_ptr,
           N_COLS: gl.constexpr, SMOOTHING: gl.constexpr, Z_LOSS: gl.constexpr, HAS_IGNORE: gl.constexpr,
           IGNORE_INDEX: gl.constexpr, ONE_HOT: gl.constexpr, WRITE_DX: gl.constexpr, SELECTED: gl.constexpr,
           N_CHUNKS: gl.constexpr, GLUON: gl.constexpr):
    """cross_entropy._fwd with WRITE_DX: loss [n_rows], lse [n_rows, 2] (shift,
    log of the sum of exp(x - shift)) and dx [n_rows, N_COLS] of logits x [n_rows, N_COLS] (16-bit),
    dx scaled by row_scale. Grid: at most one program per SM (its shared memory), each taking every
    num_programs-th row. N_CHUNKS: the chunks of a row kept in shared memory (N_COLS // CHUNK at most).
    (WRITE_DX: cross_entropy's constexpr, here True.)"""
    gl.static_assert(WRITE_DX, "cross_entropy_hopper.lse_dx: dx written")
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    box_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    desc = tma.make_tensor_descriptor(x_ptr, [n_rows, N_COLS], [N_COLS, 1], [1, BOX], box_layout)
    bufs = gl.allocate_shared_memory(dtype, [SLOTS * CHUNK_BOXES, 1, BOX], box_layout)
    chunks = _reinterpret(bufs, dtype, [SLOTS, CHUNK_BOXES, 32, 8], flat)  # (the same bytes, row-major)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(SLOTS):
        mbarrier.init(ready.index(c), count=1)
        mbarrier.init(empty.index(c), count=1)
    gl.warp_specialize([
        (_rows, (x_ptr, labels_ptr, row_scale_ptr, n_rows, loss_ptr, lse_ptr, dx_ptr, chunks, ready, empty, N_COLS,
                 SMOOTHING, Z_LOSS, HAS_IGNORE, IGNORE_INDEX, ONE_HOT, SELECTED, N_CHUNKS)),
        (_loader, (desc, bufs, ready, empty, n_rows, N_CHUNKS, _overflow(N_COLS, N_CHUNKS))),
    ], [1], [24])


lse_dx.xkern_maxnreg = 96  # registers at launch: 17 warps, rounded up to 20, x 32 x 96 fit the SM's 65536


def n_chunks(n_cols: int) -> int:
    """The chunks of a row kept in shared memory (the rest overflows through the ring or is its tail)."""
    return min(SLOTS.value, n_cols // CHUNK.value)


def config(n_cols: int) -> L.Config:
    """The kernel's config (GLUON marks it for cross_entropy._launch_fwd)."""
    return L.Config.of(N_CHUNKS=n_chunks(n_cols), GLUON=1, num_warps=NUM_WARPS, num_stages=1)


# Where it wins (H200, value and gradient, 8192 rows, the Triton kernel in the same run; sessions 34
# and 35): rows of 3 chunks or more. Narrower rows stay in L2 between the Triton kernel's passes
# (16384: 0.241 ms against 0.199). Rows past 16 chunks overflow through the ring and still win
# (151936: 1.461 against 1.743; 256000, 4096 rows: 1.416 against 1.744), where reading the overflow
# by plain loads had lost at 256000 (1.74 against 1.64).
MIN_COLS = 3 * CHUNK.value


def applies(n_cols: int, itemsize: int, consts: dict) -> bool:
    """Whether the problem is this kernel's (consts: cross_entropy's constexprs): 16-bit logits,
    dx written, no soft cap, rows a multiple of 8 wide (TMA's 16-byte strides) and at least MIN_COLS
    wide."""
    return itemsize == 2 and consts["WRITE_DX"] and not consts.get("SOFT_CAP") and n_cols % 8 == 0 \
        and MIN_COLS <= n_cols


def launch_fwd(x2, labels, row_scale, consts: dict, backend: str, aliases=None):
    """(loss, lse, dx) as cross_entropy._launch_fwd returns them."""
    import jax
    import jax.numpy as jnp

    n_rows, n_cols, lead = L.n_rows(x2), x2.shape[-1], x2.shape[:-1]
    outs = [jax.ShapeDtypeStruct(lead, jnp.float32), jax.ShapeDtypeStruct((*lead, 2), jnp.float32),
            jax.ShapeDtypeStruct(x2.shape, x2.dtype)]
    programs = min(n_rows, getattr(jax.devices()[0], "core_count", 132))
    return L.launch(lse_dx, x2, labels, row_scale, n_rows, kernel="cross_entropy_fwd", out_shapes=outs,
                    grid=(programs,), config=config(n_cols), backend=backend, constexprs=consts, aliases=aliases)
