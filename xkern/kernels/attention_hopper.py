"""Attention for Hopper GPUs in Gluon, FlashAttention-3's way: the forward, and the backward in one kernel.

Gluon (`triton.experimental.gluon`) is Triton at the level of its layouts: warp partitions,
mbarriers and asynchronous warpgroup products are written out rather than left to Triton's passes.
Triton 3.6's automatic warp specialization (attention.py's _fwd_warp_specialized) runs each
consumer warpgroup's products synchronously and cannot mask inside its loop, so a causal forward
there needs a second kernel for the diagonal blocks. The forward has three partitions per program
of 128 query rows:

    loader      1 warp: streams k and v blocks by TMA into a 2-stage ring (ready / empty mbarriers)
    consumers   2 warpgroups, 64 query rows each, each releasing a buffer when it is done with it:
                S_j = q k_j^T and O += P_{j-1} v_{j-1} are issued together, and S_j's softmax runs
                while the second product is still on the tensor cores; the key blocks that cross
                the causal diagonal are masked in a loop of their own (one loop with a branch
                spilled registers).

H200, bf16, b4 s4096 h32 d128 (tools_tmp probe, same runs): causal forward 517 TFLOP/s against 458
for the warp-specialized kernel and its diagonal pass, b1 s16384 causal 615 against 560, GQA 32/8
619 against 597, and a tie without masking (584 against 573; 581 against 599 in another run). At
head dim 256 the same kernel, in 64-key blocks, took b2 s4096 h16 from 600 to 669 and causal from
425 to 558 (session 33, same run; cuDNN 657 / 555). At 64 it lost (402 against 432, causal 338
against 392: its softmax, not its products, bounds it there), so the Triton kernels keep that.

The backward (`bwd`) gives dk, dv and dq from one pass over the scores, where attention.py's
kernels take two (dk/dv per key block, dq per query block, each recomputing S and dP: seven
products of a query block and a key block where five suffice). One program per 128 keys of a key
head; a 1-warp loader streams 64-row blocks of q and do (every query head of the group), with
their rows of lse and delta, into a ring; two consumer warpgroups own 64 keys each, with dk and dv in registers. Per query block each
computes S^T and dP^T, then dV += P^T do and dK += dS^T q, writes its dS^T into shared memory,
meets the other at an mbarrier, and takes half of dQ's columns over all 128 keys (dS k[:, half]).
That half goes through shared memory to a float32 accumulator in global memory by a TMA reduction
(L2 adds in bulk: per-thread atomics made the same kernel 1.6x slower), zeroed by the launch; dq
is the accumulator scaled, in XLA. H200, fwd+bwd with the Gluon forward, same run as the two-kernel
backward: 519 TFLOP/s against 469-478, causal 451 against 390, b1 s16384 causal 533 against 469,
GQA 32/8 524 against 456-476. Loading lse and delta by TMA with q and do, rather than by each
consumer at the start of its step (a global load's latency, before its first exp), gained 4-8%
more (session 33, same run: 513 / 447 / 533 against 493 / 430 / 494 for plain / causal / GQA).
Without the dq reductions (dq then wrong, its product and store kept) the kernel gave 549 / 469 /
563 in that run: the 8.6 GB of float32 adds into L2 at s4096 cost 6-7%. Head dims 64 and 128 (at 64
after the Triton forward: 417 against the two kernels' 371, cuDNN 420).

At head dim 256 dk and dv for 64 keys would take a warpgroup 256 registers; `bwd_wide` splits
their columns between the two warpgroups instead (see WIDE_BLOCK_N); it lost to the Triton pair on
the H200, so BWD_WIDE leaves it off.

Hopper only (wgmma): the interpreter cannot run Gluon, so on a CPU the same problems take the
Triton kernels, and tests check these by compiling them for sm_90 (and on a GPU, by value).
"""
from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from xkern.kernels import launch as L

# Triton 3.9 renamed the TMA load (3.6: async_copy_global_to_shared, now a deprecated alias)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """tma.async_atomic_add as Triton 3.9 has it: Triton 3.6's Gluon builds the op but has no call."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_36

# 2**x for the scores' softmax, split between the two units that can compute it. MUFU's ex2 gives
# 16 results a clock per SM against the tensor cores' 4096 flops: at head dim 128 the forward's two
# products take 512 flops a score, so its exps alone need half the products' time, and at 64 all of
# it. Of every 4 scores a thread holds, the kernels' EXP2 go instead to the FMA units (128 lanes a
# clock, 10 instructions each): 2**floor(x) from the bits of a float add rounded down, times a cubic
# for 2**frac(x) (relative error 8.6e-5, under a bf16 rounding's 2e-3; exactly 1 at x = 0; 0 below
# -126 and at -inf; NaN stays NaN; x must be < 128, as a softmax's x - max <= 0 is). 0: ex2 alone.
# 0 on Hopper, as measured (h200-attention-exp2-sweep-session37.json): every split lost, up to 10%
# (d128 forward 504 TFLOP/s with 2 against 558 with 0). An exp moved off MUFU frees 1/16 of a clock
# there but takes 10/128 of the SM's issue slots, and the softmax's other ~6 instructions a score
# already take 6/128: the split trades MUFU for issue bandwidth, which binds first. (Blackwell's
# tensor cores are twice as fast against the same MUFU: where FlashAttention-4 splits.)
FWD_EXP2 = 0
BWD_EXP2 = 0
# The forward's two consumers take turns to issue their products (FlashAttention-3's ping-pong
# scheduling, by a pair of mbarriers): without it both issue as soon as their data is in, and their
# softmaxes tend to run at the same time, leaving the tensor cores idle meanwhile. H200, same run
# (h200-attention-pingpong-sweep-session39.json): b4 s4096 h32 d128 forward 603 TFLOP/s against 582
# without (cuDNN 582-583), forward+backward 532 against 527; causal it lost (505 against 522, b1
# s16384 593 against 607, d256 598 against 618): the causal blocks' imbalance between the two
# consumers (the diagonal's masked steps) makes one wait for the other's turn. So: unmasked, at
# head dims up to FWD_PINGPONG_MAX_HEAD_DIM, where FWD_PINGPONG is 1. Head dim 256 unmasked (b2 s4096
# h16) on an H100, the only card lent then (h100-attention-pingpong-d256-session43.json): forward 693
# TFLOP/s against 674 without (cuDNN 630-635); forward+backward 382 against 386, the backward's kernels
# the same (two processes' noise).
FWD_PINGPONG = 1
FWD_PINGPONG_MAX_HEAD_DIM = 256
EXP2_PACK = gl.constexpr(4)
_EXP2_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 4 + ["f"] * 4))


@gluon.constexpr_function
def exp2_ptx(poly):
    """PTX for 2**x over 4 consecutive registers ($4.. in, $0.. out): the first `poly` by the
    polynomial, the rest by ex2.approx. (A constexpr function: its source keys Triton's cache.)"""
    import struct

    f32 = lambda x: "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]  # a PTX float literal
    shift = f32(12582912.0 + 127)  # 1.5 * 2**23 + 127: adding it leaves 127 + floor(x) in the low bits
    c1, c2, c3 = map(f32, (0.6951168179512024, 0.22764484584331512, 0.07706718146800995))  # minimax, [0, 1)
    lines = ["{", ".reg .f32 xc, r, fr, p;", ".reg .b32 e;"]
    for i in range(4):
        out, x = f"${i}", f"${i + 4}"
        if i >= poly:
            lines.append(f"ex2.approx.ftz.f32 {out}, {x};")
            continue
        lines += [f"max.NaN.f32 xc, {x}, {f32(-127.0)};", f"add.rm.f32 r, xc, {shift};",
                  f"sub.f32 fr, r, {shift};", "sub.f32 fr, xc, fr;",  # frac(x), in [0, 1)
                  f"fma.rn.f32 p, fr, {c3}, {c2};", f"fma.rn.f32 p, p, fr, {c1};", "fma.rn.f32 p, p, fr, 0f3F800000;",
                  "mov.b32 e, r;", "shl.b32 e, e, 23;", f"mul.f32 {out}, p, e;"]  # 2**floor(x): 127 + floor as exponent
    return "\n".join(lines + ["}"])


@gluon.jit
def _exp2(x, POLY: gl.constexpr):
    """2**x of a float32 tensor, POLY of every 4 by the FMA units (see FWD_EXP2)."""
    if POLY == 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(exp2_ptx(POLY), _EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True,
                                         pack=EXP2_PACK)


BLOCK_M = 128  # query rows per program (64 per consumer warpgroup)
# Keys per block, by head dim: at 256 a consumer's [64, 256] float32 output takes 128 registers, and
# 64-key score tiles keep the rest within its 240.
FWD_BLOCK_N = {128: 128, 256: 64}
BLOCK_N = FWD_BLOCK_N[128]
HEAD_DIM = 128
STAGES = 2  # k/v buffers: q and two stages of k and v take 160 KB of the 227 KB (192 KB at head dim 256)
# Registers per thread at launch: 12 warps (4 asked: one consumer warpgroup; the other and the
# loader's warp round up to two more) x 32 threads x 168 fit the SM's 65536; the partitions then
# rebalance to 240 for each consumer and 24 for the loader.
MAXNREG = 168
LPT_HEADS = gl.constexpr(4)  # the causal forward runs its longest blocks first over groups of this many heads


@gluon.jit
def _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, row0, col, n_blocks,
            BLOCK_N: gl.constexpr):
    """k and v blocks 0 .. n_blocks-1 (rows row0 + j * BLOCK_N of the [batch * sk, kv heads * D]
    views, columns col ..), each into its ring slot once both consumers released it."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    for j in range(n_blocks):
        s = j % stages
        phase = (j // stages) & 1
        mbarrier.wait(k_empty.index(s), phase ^ 1)  # (a fresh barrier passes phase 1: the first round)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [row0 + j * BLOCK_N, col], k_ready.index(s), k_bufs.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        _tma_load(v_desc, [row0 + j * BLOCK_N, col], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _longest_first(HEADS_PER_GROUP: gl.constexpr):
    """(rank, head) of this program of a causal grid (blocks, heads), whose block `rank` is its
    head's rank-th longest: programs start in order of the linear id, so each group of
    HEADS_PER_GROUP heads (about one wave of programs, sharing L2) runs its longest blocks first,
    over all its heads. Longest first within each head alone left the last head's longest block to
    start near the end, a tail: at head dim 256 (b2 s4096 h16, 32 blocks a head) this took the
    causal forward from 534-559 TFLOP/s to 588-601 (session 33); at 128 it measured the same."""
    n_blocks = gl.num_programs(0)
    heads = gl.num_programs(1)
    p = gl.program_id(1) * n_blocks + gl.program_id(0)
    group = p // (HEADS_PER_GROUP * n_blocks)
    in_group = gl.minimum(HEADS_PER_GROUP, heads - group * HEADS_PER_GROUP)
    r = p - group * HEADS_PER_GROUP * n_blocks
    return r // in_group, group * HEADS_PER_GROUP + r % in_group


@gluon.jit
def _causal_mask(s, first_row, first_col, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = first_col + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
    return gl.where(cols[None, :] <= rows[:, None], s, -float("inf"))


@gluon.jit
def _take_turn(turns, t, WG: gl.constexpr):
    """Wait for this warpgroup's t-th turn to issue its products (FlashAttention-3's ping-pong: the
    two consumers alternate, so one's products run on the tensor cores while the other's softmax
    runs). turns: two count-1 mbarriers, one per warpgroup; warpgroup 0 goes first (a fresh barrier
    passes phase 1), each turn passed by the other's arrival."""
    mbarrier.wait(turns.index(WG), (t & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turns, WG: gl.constexpr):
    mbarrier.arrive(turns.index(1 - WG), count=1)


@gluon.jit
def _step(j, p, m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turns, zeros_s, first_row,
          QK_SCALE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr,
          p_layout: gl.constexpr, rows_o: gl.constexpr, s_layout: gl.constexpr, EXP2: gl.constexpr,
          PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Key block j >= 1: S_j = q k_j^T and O += P_{j-1} v_{j-1} issued together (in this warpgroup's
    turn, with PINGPONG), S_j's online softmax while the second runs, then O rescaled to the new row
    maxima. Returns P_j's state."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    ks = j % stages
    vs = (j - 1) % stages
    mbarrier.wait(k_ready.index(ks), (j // stages) & 1)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(vs), ((j - 1) // stages) & 1)
    if PINGPONG:
        _take_turn(turns, j, WG)
    s = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
    if PINGPONG:
        _pass_turn(turns, WG)
    s = warpgroup_mma_wait(1, deps=(s, ))  # S_j done; P_{j-1} v_{j-1} may still run
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _causal_mask(s, first_row, j * BLOCK_N, ROWS, BLOCK_N, s_layout)
    m_new = gl.maximum(m_i, gl.max(s, 1) * QK_SCALE)
    alpha = gl.exp2(m_i - m_new)
    p = _exp2(s * QK_SCALE - m_new[:, None], EXP2)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(vs), count=1)
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    return p, m_new, l_i, acc


@gluon.jit
def _consumer(q_smem, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turns, o_ptr, lse_ptr, sink_ptr,
              n_blocks, first_row, bh, sq, h, QK_SCALE: gl.constexpr, HEADS: gl.constexpr, D: gl.constexpr,
              CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              EXP2: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr):
    """One warpgroup's ROWS query rows (q_smem, from first_row) against key blocks 0 .. n_blocks-1:
    o and its log2-domain lse, as attention._fwd_store writes them (with the row's sink, as
    attention._sink_key adds it). Every row sees a key (causal: its own), so no row is empty."""
    num_warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    mbarrier.wait(q_bar, 0)
    zeros_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(k_ready.index(0), 0)  # key block 0 alone: its softmax starts the pipeline
    if PINGPONG:
        _take_turn(turns, 0, WG)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    if PINGPONG:
        _pass_turn(turns, WG)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if CAUSAL:
        if BLOCK_N > first_row + 1:
            s = _causal_mask(s, first_row, 0, ROWS, BLOCK_N, s_layout)
    m_i = gl.max(s, 1) * QK_SCALE
    p = _exp2(s * QK_SCALE - m_i[:, None], EXP2)
    l_i = gl.sum(p, 1)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    # blocks wholly left of the diagonal, then those crossing it, masked
    n_full = gl.minimum(gl.maximum((first_row + 1) // BLOCK_N, 1), n_blocks) if CAUSAL else n_blocks
    for j in range(1, n_full):
        p, m_i, l_i, acc = _step(j, p, m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                 turns, zeros_s, first_row, QK_SCALE, ROWS, BLOCK_N, False, p_layout, rows_o, s_layout,
                                 EXP2, PINGPONG, WG)
    for j in range(n_full, n_blocks):
        p, m_i, l_i, acc = _step(j, p, m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                 turns, zeros_s, first_row, QK_SCALE, ROWS, BLOCK_N, True, p_layout, rows_o, s_layout,
                                 EXP2, PINGPONG, WG)
    last = (n_blocks - 1) % k_bufs.type.shape[0]
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // k_bufs.type.shape[0]) & 1)
    acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(last), count=1)

    rows = first_row + gl.arange(0, ROWS, rows_o)
    m_o = gl.convert_layout(m_i, rows_o)
    l_o = gl.convert_layout(l_i, rows_o)
    if HAS_SINK:  # one more key of value zero: its logit (natural units) joins the row's sum
        sink = gl.load(sink_ptr + bh.to(gl.int64) * sq + rows, mask=rows < sq, other=-float("inf"))
        m_new = gl.maximum(m_o, sink * 1.4426950408889634)
        alpha = gl.exp2(m_o - m_new)
        acc = acc * alpha[:, None]
        l_o = l_o * alpha + gl.exp2(sink * 1.4426950408889634 - m_new)
        m_o = m_new
    dims = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    offs = ((bh // HEADS * sq + rows).to(gl.int64) * (HEADS * D) + h * D)[:, None] + dims[None, :]
    gl.store(o_ptr + offs, (acc / l_o[:, None]).to(o_ptr.dtype.element_ty), mask=(rows < sq)[:, None])
    gl.store(lse_ptr + bh.to(gl.int64) * sq + rows, m_o + gl.log2(l_o), mask=rows < sq)


@gluon.jit
def fwd(q_ptr, k_ptr, v_ptr, sink_ptr, sq, sk, o_ptr, lse_ptr,
        QK_SCALE: gl.constexpr, HEADS: gl.constexpr, KV_HEADS: gl.constexpr, D: gl.constexpr,
        CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_D: gl.constexpr, STAGES: gl.constexpr, GLUON: gl.constexpr, EXP2: gl.constexpr,
        PINGPONG: gl.constexpr):
    """o [batch, sq, HEADS, D] (o_ptr's dtype) and lse [batch, HEADS, sq] (log2 domain) of q
    [batch, sq, HEADS, D] and k, v [batch, sk, KV_HEADS, D] (16-bit), as attention._fwd gives them
    for problems without masking: sk a multiple of BLOCK_N; causal only with sq == sk. Grid
    (cdiv(sq, BLOCK_M), batch * HEADS), 4 warps asked. (BLOCK_D == D and GLUON: the config's marks;
    EXP2: see FWD_EXP2; PINGPONG: see FWD_PINGPONG.)"""
    if CAUSAL:
        rank, bh = _longest_first(LPT_HEADS)
        pid_m = gl.num_programs(0) - 1 - rank  # (the last query blocks see the most keys)
    else:
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    batch = gl.num_programs(1) // HEADS
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    q_desc = tma.make_tensor_descriptor(q_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, D], q_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [batch * sk, KV_HEADS * D], [KV_HEADS * D, 1], [BLOCK_N, D],
                                        kv_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, [batch * sk, KV_HEADS * D], [KV_HEADS * D, 1], [BLOCK_N, D],
                                        kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)

    first_row = pid_m * BLOCK_M
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [b * sq + first_row, h * D], q_bar, q_smem)  # (rows past sq: never stored)
    n_blocks = gl.cdiv(gl.minimum(first_row + BLOCK_M, sk), BLOCK_N) if CAUSAL else sk // BLOCK_N
    HALF: gl.constexpr = BLOCK_M // 2
    gl.warp_specialize([
        (_consumer, (q_smem.slice(0, HALF), q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turns,
                     o_ptr, lse_ptr, sink_ptr, n_blocks, first_row, bh, sq, h, QK_SCALE, HEADS, D, CAUSAL, HAS_SINK,
                     HALF, BLOCK_N, EXP2, PINGPONG, 0)),
        (_consumer, (q_smem.slice(HALF, HALF), q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turns,
                     o_ptr, lse_ptr, sink_ptr, n_blocks, first_row + HALF, bh, sq, h, QK_SCALE, HEADS, D, CAUSAL,
                     HAS_SINK, HALF, BLOCK_N, EXP2, PINGPONG, 1)),
        (_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b * sk,
                   h // (HEADS // KV_HEADS) * D, n_blocks, BLOCK_N)),
    ], [4, 1], [240, 24])


fwd.xkern_maxnreg = MAXNREG  # read by launch.gluon_module and aot.compile_kernel


def config(head_dim: int = HEAD_DIM, causal: bool = False) -> L.Config:
    """The forward's config at `head_dim` (GLUON marks it for attention._launch_fwd)."""
    pingpong = FWD_PINGPONG if head_dim <= FWD_PINGPONG_MAX_HEAD_DIM and not causal else 0
    return L.Config.of(BLOCK_M=BLOCK_M, BLOCK_N=FWD_BLOCK_N[head_dim], BLOCK_D=head_dim, STAGES=STAGES, GLUON=1,
                       EXP2=FWD_EXP2, PINGPONG=pingpong, num_warps=4, num_stages=STAGES)


def applies(head_dim: int, itemsize: int, unmasked_keys: int, causal_square: int, capped: bool) -> bool:
    """Whether the problem is this kernel's: head dim 128 or 256, 16-bit, no soft cap, and either no
    masking at all with a key count the block (FWD_BLOCK_N) divides, or causal alone with as many
    queries as keys, a multiple of BLOCK_M."""
    return (head_dim in FWD_BLOCK_N and itemsize == 2 and not capped
            and ((unmasked_keys > 0 and unmasked_keys % FWD_BLOCK_N[head_dim] == 0)
                 or (causal_square > 0 and causal_square % BLOCK_M == 0)))


def launch_fwd(q, k, v, sinks, out_dtype, consts: dict, backend: str):
    """(o, lse) as attention._launch_fwd returns them; consts: attention.Static.constexprs'."""
    import jax
    import jax.numpy as jnp

    b, sq, heads, _ = q.shape
    outs = [jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((b, heads, sq), jnp.float32)]
    sink = sinks if sinks is not None else jnp.zeros((1,), jnp.float32)
    cfg = config(q.shape[-1], bool(consts["CAUSAL"]))
    return L.launch(fwd, q, k, v, sink, sq, k.shape[1], kernel="attention_fwd", out_shapes=outs,
                    grid=(L.cdiv(sq, cfg["BLOCK_M"]), b * heads), config=cfg, backend=backend,
                    constexprs={**{n: consts[n] for n in ("QK_SCALE", "HEADS", "KV_HEADS", "D", "CAUSAL")},
                                "HAS_SINK": sinks is not None})


# --------------------------------------------------------------------------------------------------
# Backward: dk, dv and dq in one kernel
# --------------------------------------------------------------------------------------------------

BWD_BLOCK_M = 64  # query rows per step (a q and a do block in the ring)
BWD_BLOCK_N = BLOCK_N  # keys per program (64 per consumer warpgroup)
# q/do/lse/delta ring, k, v, two dS^T and two dQ halves: 194 KB of the 227 KB at 2 stages at head dim
# 128, 113 KB at 64 (3 measured the same, in sessions 32 and 33 at 128, and at 64 in session 35)
BWD_STAGES = 2
# At 256 one warpgroup's dk and dv would need 256 registers. At 64 (session 35, b4 s4096 h32, same
# run, with the Triton forward): 417 TFLOP/s forward+backward against the Triton pair's 371 (cuDNN
# 420), causal 340 against 330 (cuDNN 368).
BWD_HEAD_DIMS = (64, 128)


@gluon.jit
def _bwd_loader(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, b, sq,
                hk, first, n_q_blocks, HEADS: gl.constexpr, KV_HEADS: gl.constexpr, D: gl.constexpr,
                BLOCK_M: gl.constexpr):
    """q and do blocks, query blocks 0 .. n_q_blocks-1 (rows b * sq + first + m * BLOCK_M of the
    [batch * sq, heads * D] views) of each query head of key head hk in turn, into the ring, with
    their rows of lse and delta (which the consumers would otherwise wait on global loads for)."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    group: gl.constexpr = HEADS // KV_HEADS
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
    for i in range(group * n_q_blocks):
        s = i % stages
        h = hk * group + i // n_q_blocks
        start = first + (i % n_q_blocks) * BLOCK_M
        mbarrier.wait(empty.index(s), ((i // stages) & 1) ^ 1)  # (a fresh barrier passes phase 1)
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(q_desc, [b * sq + start, h * D], ready.index(s), q_bufs.index(s))
        _tma_load(do_desc, [b * sq + start, h * D], ready.index(s), do_bufs.index(s))
        _tma_load(lse_desc, [(b * HEADS + h) * sq + start], ready.index(s), lse_bufs.index(s))
        _tma_load(delta_desc, [(b * HEADS + h) * sq + start], ready.index(s), delta_bufs.index(s))


@gluon.jit
def _bwd_step(i, start, h, dk, dv, k_half, v_half, k_cols, ds_bufs, ds_bar, q_bufs, do_bufs, ready, empty,
              lse_bufs, delta_bufs, dq_desc, dq_smem, b, sq, key0, half, zeros_s, zeros_q,
              QK_SCALE: gl.constexpr, D: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr,
              a_layout: gl.constexpr, EXP2: gl.constexpr):
    """Ring slot i (query rows start.., head h, with their lse and delta) against this warpgroup's
    64 keys from key0: dk and dv accumulate; dS^T goes to shared memory for the two warpgroups' dQ
    halves."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    keys_n: gl.constexpr = k_half.type.shape[0]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    s = i % stages
    q_smem = q_bufs.index(s)
    do_smem = do_bufs.index(s)
    mbarrier.wait(ready.index(s), (i // stages) & 1)
    lse = lse_bufs.index(s).load(gl.SliceLayout(0, s_layout))
    delta = delta_bufs.index(s).load(gl.SliceLayout(0, s_layout))
    s_t = warpgroup_mma(k_half, q_smem.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_half, do_smem.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s_t = warpgroup_mma_wait(1, deps=(s_t, ))  # P^T (and dV's product) while dP^T runs
    p_t = _exp2(s_t * QK_SCALE - lse[None, :], EXP2)
    if MASKED:  # key j sees query i only when j <= i
        queries = start + gl.arange(0, block_m, gl.SliceLayout(0, s_layout))
        keys = key0 + gl.arange(0, keys_n, gl.SliceLayout(1, s_layout))
        p_t = gl.where(keys[:, None] <= queries[None, :], p_t, 0.0)
    p_op = gl.convert_layout(p_t.to(q_smem.dtype), a_layout)
    dv = warpgroup_mma(p_op, do_smem, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
    ds_t = (p_t * (dp_t - delta[None, :])).to(q_smem.dtype)
    ds_smem = ds_bufs.index(i % 2)  # (two: the other warpgroup may still read the last step's)
    ds_smem.slice(half * keys_n, keys_n).store(ds_t)
    ds_op = gl.convert_layout(ds_t, a_layout)
    dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
    fence_async_shared()
    mbarrier.arrive(ds_bar, count=1)  # both halves of dS^T written: each warpgroup takes half of dQ
    mbarrier.wait(ds_bar, i & 1)
    dq = warpgroup_mma(ds_smem.permute((1, 0)), k_cols, zeros_q, use_acc=False, is_async=True)
    dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op, ds_op))
    mbarrier.arrive(empty.index(s), count=1)
    tma.store_wait(0)  # the last step's reduction has read dq_smem
    dq_smem.store(dq)
    fence_async_shared()
    _tma_add(dq_desc, [b * sq + start, h * D + half * (D // 2)], dq_smem)
    return dk, dv


@gluon.jit
def _bwd_consumer(k_half, v_half, k_cols, kv_bar, ds_bufs, ds_bar, q_bufs, do_bufs, ready, empty, lse_bufs,
                  delta_bufs, dk_ptr, dv_ptr, dq_desc, dq_smem, b, sq, sk, hk, key0, half, first, n_q_blocks,
                  QK_SCALE: gl.constexpr, SCALE: gl.constexpr, HEADS: gl.constexpr, KV_HEADS: gl.constexpr,
                  D: gl.constexpr, CAUSAL: gl.constexpr, EXP2: gl.constexpr):
    """One warpgroup's 64 keys (k_half, v_half from key0) against every query block the loader
    brings, then its rows of dk (scaled) and dv."""
    num_warps: gl.constexpr = gl.num_warps()
    keys_n: gl.constexpr = k_half.type.shape[0]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    group: gl.constexpr = HEADS // KV_HEADS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, block_m, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D // 2, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    mbarrier.wait(kv_bar, 0)
    zeros_s = gl.zeros([keys_n, block_m], gl.float32, s_layout)
    zeros_q = gl.zeros([block_m, D // 2], gl.float32, q_layout)
    dk = gl.zeros([keys_n, D], gl.float32, o_layout)
    dv = gl.zeros([keys_n, D], gl.float32, o_layout)
    n_masked: gl.constexpr = 2 * keys_n // block_m if CAUSAL else 0  # the query blocks the diagonal crosses
    for g in range(group):
        h = hk * group + g
        for m in range(0, n_masked):
            dk, dv = _bwd_step(g * n_q_blocks + m, first + m * block_m, h, dk, dv, k_half, v_half, k_cols, ds_bufs,
                               ds_bar, q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dq_desc, dq_smem, b, sq,
                               key0, half, zeros_s, zeros_q, QK_SCALE, D, True, s_layout, a_layout, EXP2)
        for m in range(n_masked, n_q_blocks):
            dk, dv = _bwd_step(g * n_q_blocks + m, first + m * block_m, h, dk, dv, k_half, v_half, k_cols, ds_bufs,
                               ds_bar, q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dq_desc, dq_smem, b, sq,
                               key0, half, zeros_s, zeros_q, QK_SCALE, D, False, s_layout, a_layout, EXP2)
    tma.store_wait(0)
    rows = key0 + gl.arange(0, keys_n, gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    offs = ((b * sk + rows).to(gl.int64) * (KV_HEADS * D) + hk * D)[:, None] + dims[None, :]
    gl.store(dk_ptr + offs, (dk * SCALE).to(dk_ptr.dtype.element_ty))
    gl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty))


@gluon.jit
def bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, sq, sk, dk_ptr, dv_ptr, dq_ptr,
        QK_SCALE: gl.constexpr, SCALE: gl.constexpr, HEADS: gl.constexpr, KV_HEADS: gl.constexpr,
        D: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_D: gl.constexpr, STAGES: gl.constexpr, GLUON: gl.constexpr, EXP2: gl.constexpr):
    """dk, dv [batch, sk, KV_HEADS, D] and dq's float32 accumulator ([batch, sq, HEADS, D], zeroed
    before, unscaled) of attention over q, do [batch, sq, HEADS, D] and k, v (16-bit), given the
    forward's lse (log2 domain) and delta = rowsum(do * o) [batch, HEADS, sq]; no masking but causal
    (then sq == sk); sq a multiple of BLOCK_M, sk of BLOCK_N. Grid (sk // BLOCK_N, batch * KV_HEADS),
    4 warps asked. (BLOCK_D == D and GLUON: the config's marks; EXP2: see FWD_EXP2.)"""
    # (causal: the first key blocks, which see the most queries, first within each head; by groups of
    # heads, as the forward, lost 2% at s16384, whose 4 heads' q, do and dq overflow L2)
    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    b = bhk // KV_HEADS
    hk = bhk % KV_HEADS
    batch = gl.num_programs(1) // KV_HEADS
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D // 2], gl.float32)
    q_desc = tma.make_tensor_descriptor(q_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, D], q_layout)
    do_desc = tma.make_tensor_descriptor(do_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, D], q_layout)
    dq_desc = tma.make_tensor_descriptor(dq_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, D // 2],
                                         dq_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [batch * sk, KV_HEADS * D], [KV_HEADS * D, 1], [BLOCK_N, D],
                                        kv_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, [batch * sk, KV_HEADS * D], [KV_HEADS * D, 1], [BLOCK_N, D],
                                        kv_layout)
    stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    lse_desc = tma.make_tensor_descriptor(lse_ptr, [batch * HEADS * sq], [1], [BLOCK_M], stats_layout)
    delta_desc = tma.make_tensor_descriptor(delta_ptr, [batch * HEADS * sq], [1], [BLOCK_M], stats_layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], kv_layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, D // 2], dq_layout)  # one per warpgroup
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ds_bar, count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    key0 = pid_n * BLOCK_N
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [b * sk + key0, hk * D], kv_bar, k_smem)
    _tma_load(v_desc, [b * sk + key0, hk * D], kv_bar, v_smem)
    first = key0 if CAUSAL else 0  # (causal: no query before the block's first key sees it)
    n_q_blocks = (sq - first) // BLOCK_M
    HALF: gl.constexpr = BLOCK_N // 2
    HALF_D: gl.constexpr = D // 2
    gl.warp_specialize([
        (_bwd_consumer, (k_smem.slice(0, HALF), v_smem.slice(0, HALF), k_smem.slice(0, HALF_D, dim=1), kv_bar,
                         ds_bufs, ds_bar, q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dk_ptr, dv_ptr, dq_desc,
                         dq_bufs.index(0), b, sq, sk, hk, key0, 0, first, n_q_blocks, QK_SCALE, SCALE, HEADS,
                         KV_HEADS, D, CAUSAL, EXP2)),
        (_bwd_consumer, (k_smem.slice(HALF, HALF), v_smem.slice(HALF, HALF), k_smem.slice(HALF_D, HALF_D, dim=1),
                         kv_bar, ds_bufs, ds_bar, q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dk_ptr, dv_ptr,
                         dq_desc, dq_bufs.index(1), b, sq, sk, hk, key0 + HALF, 1, first, n_q_blocks, QK_SCALE,
                         SCALE, HEADS, KV_HEADS, D, CAUSAL, EXP2)),
        (_bwd_loader, (q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, b,
                       sq, hk, first, n_q_blocks, HEADS, KV_HEADS, D, BLOCK_M)),
    ], [4, 1], [240, 24])


bwd.xkern_maxnreg = MAXNREG


# At head dim 256 a warpgroup's dk and dv for 64 keys would take 256 registers, so the wide kernel
# gives each program 64 keys and both warpgroups all of them: each warpgroup owns half of dk's and
# dv's columns (128 registers) and half of each query block's rows for S^T and dP^T ([64 keys, 32
# queries]: N = 32 products, against N = 64 at head dim 128). P^T and dS^T meet in shared memory,
# where each warpgroup's dV, dK and dQ products read both halves. Shared memory: k, v (64 KB), the
# q/do ring (128 KB at 2 stages), P^T and dS^T (16 KB) and dQ staged in 32-column chunks (16 KB):
# 225 KB of the 227 KB.
WIDE_BLOCK_N = 64
WIDE_DQ_COLS = 32
# How the two warpgroups share S^T's and dP^T's products: 0, each half of the queries (N = 32); 1,
# warpgroup 0 S^T and warpgroup 1 dP^T, then dS^T from P^T in shared memory (N = 64, but in series).
# 1 is the faster (below: 365 TFLOP/s against 316), and spills nothing
WIDE_SPLIT = 1
# Whether head dim 256 takes it (applies_bwd). H200, b2 s4096 h16 (h200-attention-wide-bwd-session48.json):
# its values match float32 (dq, dk, dv within 8e-3, causal GQA too), but forward+backward runs at
# 365 TFLOP/s with WIDE_SPLIT 1 and 316 with 0, against 383 for the Triton pair (cuDNN 403-424).
# Not profiled; the likely costs: each step's four dQ chunks a warpgroup wait on their TMA reductions
# in turn, and the warpgroups wait on each other's halves of P^T and dS^T. So 0: the Triton pair.
BWD_WIDE = 0


@gluon.jit
def _wide_scores_by_rows(i, start, k_smem, v_smem, p_smem, ds_smem, bars, q_smem, do_smem, lse_smem, delta_smem, key0,
                         zeros_s, QK_SCALE: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr,
                         EXP2: gl.constexpr, WG: gl.constexpr):
    """SPLIT 0: this warpgroup's half of the block's queries gives its columns of P^T and dS^T."""
    keys_n: gl.constexpr = k_smem.type.shape[0]
    rows: gl.constexpr = zeros_s.type.shape[1]
    lse = lse_smem.slice(WG * rows, rows).load(gl.SliceLayout(0, s_layout))
    delta = delta_smem.slice(WG * rows, rows).load(gl.SliceLayout(0, s_layout))
    s_t = warpgroup_mma(k_smem, q_smem.slice(WG * rows, rows).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_smem, do_smem.slice(WG * rows, rows).permute((1, 0)), zeros_s, use_acc=False,
                         is_async=True)
    s_t = warpgroup_mma_wait(1, deps=(s_t, ))
    p_t = _exp2(s_t * QK_SCALE - lse[None, :], EXP2)
    if MASKED:  # key j sees query i only when j <= i
        queries = start + WG * rows + gl.arange(0, rows, gl.SliceLayout(0, s_layout))
        keys = key0 + gl.arange(0, keys_n, gl.SliceLayout(1, s_layout))
        p_t = gl.where(keys[:, None] <= queries[None, :], p_t, 0.0)
    mbarrier.wait(bars.index(1), (i & 1) ^ 1)  # both warpgroups done with the last step's P^T and dS^T
    p_smem.slice(WG * rows, rows, dim=1).store(p_t.to(p_smem.dtype))
    dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
    ds_smem.slice(WG * rows, rows, dim=1).store((p_t * (dp_t - delta[None, :])).to(ds_smem.dtype))
    fence_async_shared()
    mbarrier.arrive(bars.index(0), count=1)


@gluon.jit
def _wide_scores_by_product(i, start, k_smem, v_smem, p_smem, ds_smem, bars, q_smem, do_smem, lse_smem, delta_smem,
                            key0, zeros_s, QK_SCALE: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr,
                            EXP2: gl.constexpr, WG: gl.constexpr):
    """SPLIT 1: warpgroup 0 gives P^T (S^T's product: N = 64), warpgroup 1 dP^T and then dS^T from
    P^T as warpgroup 0 stored it (bf16)."""
    keys_n: gl.constexpr = k_smem.type.shape[0]
    rows: gl.constexpr = zeros_s.type.shape[1]
    if WG == 0:
        s_t = warpgroup_mma(k_smem, q_smem.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        lse = lse_smem.load(gl.SliceLayout(0, s_layout))
        s_t = warpgroup_mma_wait(0, deps=(s_t, ))
        p_t = _exp2(s_t * QK_SCALE - lse[None, :], EXP2)
        if MASKED:  # key j sees query i only when j <= i
            queries = start + gl.arange(0, rows, gl.SliceLayout(0, s_layout))
            keys = key0 + gl.arange(0, keys_n, gl.SliceLayout(1, s_layout))
            p_t = gl.where(keys[:, None] <= queries[None, :], p_t, 0.0)
        mbarrier.wait(bars.index(1), (i & 1) ^ 1)  # both warpgroups done with the last step's P^T and dS^T
        p_smem.store(p_t.to(p_smem.dtype))
        fence_async_shared()
        mbarrier.arrive(bars.index(2), count=1)
    else:
        dp_t = warpgroup_mma(v_smem, do_smem.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        delta = delta_smem.load(gl.SliceLayout(0, s_layout))
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        mbarrier.wait(bars.index(2), i & 1)  # P^T stored (after the last step's readers were done)
        p_t = p_smem.load(s_layout).to(gl.float32)
        ds_smem.store((p_t * (dp_t - delta[None, :])).to(ds_smem.dtype))
        fence_async_shared()
        mbarrier.arrive(bars.index(0), count=1)


@gluon.jit
def _wide_step(i, start, h, dk, dv, k_smem, v_smem, k_cols, p_smem, ds_smem, bars, q_bufs, do_bufs, ready, empty,
               lse_bufs, delta_bufs, dq_desc, dq_smem, b, sq, key0, zeros_s, zeros_q, QK_SCALE: gl.constexpr,
               D: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr, EXP2: gl.constexpr, WG: gl.constexpr,
               SPLIT: gl.constexpr):
    """Ring slot i (query rows start.., head h) against the program's 64 keys: P^T and dS^T into
    shared memory (bars: dS^T written, P^T and dS^T free, P^T written), then this warpgroup's
    half of dk's, dv's and dq's columns."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    half_d: gl.constexpr = D // 2
    dq_cols: gl.constexpr = dq_smem.type.shape[1]
    s = i % stages
    q_smem = q_bufs.index(s)
    do_smem = do_bufs.index(s)
    mbarrier.wait(ready.index(s), (i // stages) & 1)
    if SPLIT:
        _wide_scores_by_product(i, start, k_smem, v_smem, p_smem, ds_smem, bars, q_smem, do_smem, lse_bufs.index(s),
                                delta_bufs.index(s), key0, zeros_s, QK_SCALE, MASKED, s_layout, EXP2, WG)
    else:
        _wide_scores_by_rows(i, start, k_smem, v_smem, p_smem, ds_smem, bars, q_smem, do_smem, lse_bufs.index(s),
                             delta_bufs.index(s), key0, zeros_s, QK_SCALE, MASKED, s_layout, EXP2, WG)
    mbarrier.wait(bars.index(0), i & 1)  # P^T and dS^T written
    dv = warpgroup_mma(p_smem, do_smem.slice(WG * half_d, half_d, dim=1), dv, is_async=True)
    dk = warpgroup_mma(ds_smem, q_smem.slice(WG * half_d, half_d, dim=1), dk, is_async=True)
    for c in gl.static_range(half_d // dq_cols):  # dQ's columns, a staged chunk at a time
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_cols.slice(c * dq_cols, dq_cols, dim=1), zeros_q,
                           use_acc=False, is_async=True)
        if c == 0:
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            mbarrier.arrive(empty.index(s), count=1)  # q and do read
        else:
            dq = warpgroup_mma_wait(0, deps=(dq, ))
        tma.store_wait(0)  # the last chunk's reduction has read dq_smem
        dq_smem.store(dq)
        fence_async_shared()
        _tma_add(dq_desc, [b * sq + start, h * D + WG * half_d + c * dq_cols], dq_smem)
    mbarrier.arrive(bars.index(1), count=1)
    return dk, dv


@gluon.jit
def _wide_consumer(k_smem, v_smem, k_cols, kv_bar, p_smem, ds_smem, bars, q_bufs, do_bufs, ready, empty,
                   lse_bufs, delta_bufs, dk_ptr, dv_ptr, dq_desc, dq_smem, b, sq, sk, hk, key0, first, n_q_blocks,
                   QK_SCALE: gl.constexpr, SCALE: gl.constexpr, HEADS: gl.constexpr, KV_HEADS: gl.constexpr,
                   D: gl.constexpr, CAUSAL: gl.constexpr, EXP2: gl.constexpr, WG: gl.constexpr,
                   SPLIT: gl.constexpr):
    """One warpgroup's half of dk's and dv's columns for the program's 64 keys, over every query
    block the loader brings, then stored (dk scaled)."""
    num_warps: gl.constexpr = gl.num_warps()
    keys_n: gl.constexpr = k_smem.type.shape[0]
    block_m: gl.constexpr = q_bufs.type.shape[1]
    half_d: gl.constexpr = D // 2
    dq_cols: gl.constexpr = dq_smem.type.shape[1]
    group: gl.constexpr = HEADS // KV_HEADS
    cols: gl.constexpr = block_m if SPLIT else block_m // 2  # the queries of a block in S^T's product
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, cols, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, half_d, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, dq_cols, 16])
    mbarrier.wait(kv_bar, 0)
    zeros_s = gl.zeros([keys_n, cols], gl.float32, s_layout)
    zeros_q = gl.zeros([block_m, dq_cols], gl.float32, q_layout)
    dk = gl.zeros([keys_n, half_d], gl.float32, o_layout)
    dv = gl.zeros([keys_n, half_d], gl.float32, o_layout)
    # Causal, every step masks (a compare and select of S^T's tile, true past the diagonal): a second
    # copy of the step for the diagonal's block alone made ptxas spill (126 stores in the loops).
    for g in range(group):
        h = hk * group + g
        for m in range(0, n_q_blocks):
            dk, dv = _wide_step(g * n_q_blocks + m, first + m * block_m, h, dk, dv, k_smem, v_smem, k_cols, p_smem,
                                ds_smem, bars, q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dq_desc,
                                dq_smem, b, sq, key0, zeros_s, zeros_q, QK_SCALE, D, CAUSAL, s_layout, EXP2, WG, SPLIT)
    tma.store_wait(0)
    rows = key0 + gl.arange(0, keys_n, gl.SliceLayout(1, o_layout))
    dims = WG * half_d + gl.arange(0, half_d, gl.SliceLayout(0, o_layout))
    offs = ((b * sk + rows).to(gl.int64) * (KV_HEADS * D) + hk * D)[:, None] + dims[None, :]
    gl.store(dk_ptr + offs, (dk * SCALE).to(dk_ptr.dtype.element_ty))
    gl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty))


@gluon.jit
def bwd_wide(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, sq, sk, dk_ptr, dv_ptr, dq_ptr,
             QK_SCALE: gl.constexpr, SCALE: gl.constexpr, HEADS: gl.constexpr, KV_HEADS: gl.constexpr,
             D: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_D: gl.constexpr, STAGES: gl.constexpr, GLUON: gl.constexpr, EXP2: gl.constexpr,
             DQ_COLS: gl.constexpr, SPLIT: gl.constexpr):
    """`bwd` at head dim 256 (see WIDE_BLOCK_N): the same arguments and results; BLOCK_N (64) keys
    a program, both warpgroups over all of them. Grid (sk // BLOCK_N, batch * KV_HEADS)."""
    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    b = bhk // KV_HEADS
    hk = bhk % KV_HEADS
    batch = gl.num_programs(1) // KV_HEADS
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
    # k in 64-byte swizzles: dQ's products read it in 32-column chunks (a 128-byte swizzle spans 64)
    k_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    # P^T and dS^T [keys, queries], each warpgroup writing 32 query columns: 64-byte swizzles too
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    q_desc = tma.make_tensor_descriptor(q_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, D], q_layout)
    do_desc = tma.make_tensor_descriptor(do_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, D], q_layout)
    dq_desc = tma.make_tensor_descriptor(dq_ptr, [batch * sq, HEADS * D], [HEADS * D, 1], [BLOCK_M, DQ_COLS],
                                         dq_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [batch * sk, KV_HEADS * D], [KV_HEADS * D, 1], [BLOCK_N, D],
                                        k_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, [batch * sk, KV_HEADS * D], [KV_HEADS * D, 1], [BLOCK_N, D],
                                        v_layout)
    stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    lse_desc = tma.make_tensor_descriptor(lse_ptr, [batch * HEADS * sq], [1], [BLOCK_M], stats_layout)
    delta_desc = tma.make_tensor_descriptor(delta_ptr, [batch * HEADS * sq], [1], [BLOCK_M], stats_layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], dq_layout)  # one per warpgroup
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # (see _wide_step)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(bars.index(0), count=1 if SPLIT else 2)  # dS^T written: by warpgroup 1, or each its half
    mbarrier.init(bars.index(1), count=2)  # both done reading P^T and dS^T
    mbarrier.init(bars.index(2), count=1)  # (SPLIT) P^T written by warpgroup 0
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    key0 = pid_n * BLOCK_N
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [b * sk + key0, hk * D], kv_bar, k_smem)
    _tma_load(v_desc, [b * sk + key0, hk * D], kv_bar, v_smem)
    first = key0 if CAUSAL else 0  # (causal: no query before the block's first key sees it)
    n_q_blocks = (sq - first) // BLOCK_M
    HALF_D: gl.constexpr = D // 2
    gl.warp_specialize([
        (_wide_consumer, (k_smem, v_smem, k_smem.slice(0, HALF_D, dim=1), kv_bar, p_smem, ds_smem, bars,
                          q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dk_ptr, dv_ptr, dq_desc, dq_bufs.index(0),
                          b, sq, sk, hk, key0, first, n_q_blocks, QK_SCALE, SCALE, HEADS, KV_HEADS, D, CAUSAL, EXP2, 0,
                          SPLIT)),
        (_wide_consumer, (k_smem, v_smem, k_smem.slice(HALF_D, HALF_D, dim=1), kv_bar, p_smem, ds_smem, bars,
                          q_bufs, do_bufs, ready, empty, lse_bufs, delta_bufs, dk_ptr, dv_ptr, dq_desc,
                          dq_bufs.index(1), b, sq, sk, hk, key0, first, n_q_blocks, QK_SCALE, SCALE, HEADS, KV_HEADS,
                          D, CAUSAL, EXP2, 1, SPLIT)),
        (_bwd_loader, (q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, b,
                       sq, hk, first, n_q_blocks, HEADS, KV_HEADS, D, BLOCK_M)),
    ], [4, 1], [240, 24])


bwd_wide.xkern_maxnreg = MAXNREG


def bwd_kernel(head_dim: int):
    """The backward kernel at `head_dim`: `bwd_wide` at 256, `bwd` below."""
    return bwd_wide if head_dim > 128 else bwd


def bwd_config(head_dim: int = HEAD_DIM) -> L.Config:
    """The backward's config: attention's dk/dv candidate (GLUON marks it for attention._launch_bwd,
    which then launches no dq kernel)."""
    wide = dict(BLOCK_N=WIDE_BLOCK_N, DQ_COLS=WIDE_DQ_COLS, SPLIT=WIDE_SPLIT) if head_dim > 128 else dict(BLOCK_N=BWD_BLOCK_N)
    return L.Config.of(BLOCK_M=BWD_BLOCK_M, **wide, BLOCK_D=head_dim, STAGES=BWD_STAGES, GLUON=1, EXP2=BWD_EXP2,
                       num_warps=4, num_stages=BWD_STAGES)


def applies_bwd(head_dim: int, itemsize: int, unmasked_keys: int, unmasked_queries: int, causal_square: int,
                capped: bool) -> bool:
    """Whether the backward takes the problem: a head dim of BWD_HEAD_DIMS, 16-bit, no soft cap, and
    either no masking at all with a key count its key block (BWD_BLOCK_N; WIDE_BLOCK_N at 256)
    divides and a query count BWD_BLOCK_M divides, or causal alone with as many queries as keys, a
    multiple of the key block."""
    keys = bwd_config(head_dim)["BLOCK_N"]
    return ((head_dim in BWD_HEAD_DIMS or (head_dim == 256 and BWD_WIDE)) and itemsize == 2 and not capped
            and ((unmasked_keys > 0 and unmasked_keys % keys == 0 and unmasked_queries > 0
                  and unmasked_queries % BWD_BLOCK_M == 0)
                 or (causal_square > 0 and causal_square % keys == 0)))


def launch_bwd(q, k, v, do, lse, delta, scale: float, consts: dict, backend: str):
    """(dq, dk, dv) as attention._launch_bwd returns them; consts: attention.Static.constexprs'."""
    import jax
    import jax.numpy as jnp

    b, sq, _, _ = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    outs = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(q.shape, jnp.float32)]
    cfg = bwd_config(q.shape[-1])
    dk, dv, dq = L.launch(bwd_kernel(q.shape[-1]), q, k, v, do, lse, delta, sq, sk, kernel="attention_bwd_dkdv", out_shapes=outs,
                          grid=(sk // cfg["BLOCK_N"], b * kv_heads), config=cfg, backend=backend, zeroed=(2,),
                          constexprs={**{n: consts[n] for n in ("QK_SCALE", "HEADS", "KV_HEADS", "D", "CAUSAL")},
                                      "SCALE": scale})
    return (dq * scale).astype(q.dtype), dk, dv


def aot_exp2_cases():
    """The forward and backward with half their exps by the polynomial (EXP2 = 2), causal GQA at head
    dim 128, for sm_90 (attention.aot_cases yields them): its PTX must assemble."""
    el = "*bf16"
    consts = dict(QK_SCALE=128 ** -0.5 * 1.4426950408889634, HEADS=32, KV_HEADS=8, D=128, CAUSAL=True, EXP2=2)
    yield ("attention/sm_90/d128/bf16/exp2-split/fwd", fwd, {"q_ptr": el, "k_ptr": el, "v_ptr": el, "sink_ptr": "*fp32",
           "sq": "i32", "sk": "i32", "o_ptr": el, "lse_ptr": "*fp32"}, config(128).replace(**consts, HAS_SINK=False),
           ("sm_90",))
    yield ("attention/sm_90/d128/bf16/exp2-split/bwd", bwd, {"q_ptr": el, "k_ptr": el, "v_ptr": el, "do_ptr": el,
           "lse_ptr": "*fp32", "delta_ptr": "*fp32", "sq": "i32", "sk": "i32", "dk_ptr": el, "dv_ptr": el,
           "dq_ptr": "*fp32"}, bwd_config(128).replace(**consts, SCALE=128 ** -0.5), ("sm_90",))


def aot_wide_cases():
    """The wide backward (head dim 256), plain and causal GQA, for sm_90, while the heuristic does
    not pick it (BWD_WIDE 0): attention.aot_cases yields it where it does."""
    if BWD_WIDE:
        return
    el = "*bf16"
    for kind, consts in (("plain", dict(HEADS=32, KV_HEADS=32, CAUSAL=False)),
                         ("causal-gqa", dict(HEADS=32, KV_HEADS=8, CAUSAL=True))):
        consts = dict(consts, QK_SCALE=256 ** -0.5 * 1.4426950408889634, D=256, SCALE=256 ** -0.5)
        yield (f"attention/sm_90/d256/bf16/{kind}/bwd", bwd_wide, {"q_ptr": el, "k_ptr": el, "v_ptr": el,
               "do_ptr": el, "lse_ptr": "*fp32", "delta_ptr": "*fp32", "sq": "i32", "sk": "i32", "dk_ptr": el,
               "dv_ptr": el, "dq_ptr": "*fp32"}, bwd_config(256).replace(**consts), ("sm_90",))
