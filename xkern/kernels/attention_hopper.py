"""Attention forward for Hopper GPUs in Gluon, FlashAttention-3's way.

Gluon (`triton.experimental.gluon`) is Triton at the level of its layouts: warp partitions,
mbarriers and asynchronous warpgroup products are written out rather than left to Triton's passes.
Triton 3.6's automatic warp specialization (attention.py's _fwd_warp_specialized) runs each
consumer warpgroup's products synchronously and cannot mask inside its loop, so a causal forward
there needs a second kernel for the diagonal blocks. This kernel has three partitions per program
of 128 query rows:

    loader      1 warp: streams k and v blocks by TMA into a 2-stage ring (ready / empty mbarriers)
    consumers   2 warpgroups, 64 query rows each, each releasing a buffer when it is done with it:
                S_j = q k_j^T and O += P_{j-1} v_{j-1} are issued together, and S_j's softmax runs
                while the second product is still on the tensor cores; the key blocks that cross
                the causal diagonal are masked in a loop of their own (one loop with a branch
                spilled registers).

H200, bf16, b4 s4096 h32 d128 (tools_tmp probe, same runs): causal forward 517 TFLOP/s against 458
for the warp-specialized kernel and its diagonal pass, b1 s16384 causal 615 against 560, GQA 32/8
619 against 597, and a tie without masking (584 against 573; 581 against 599 in another run).
Hopper only (wgmma): the interpreter cannot run Gluon, so on a CPU the same problems take the
Triton kernels, and tests check this one by compiling it for sm_90 (and on a GPU, by value).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from xkern.kernels import launch as L

# Triton 3.9 renamed the TMA load (3.6: async_copy_global_to_shared, now a deprecated alias)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_M = BLOCK_N = 128  # query rows per program (64 per consumer warpgroup), keys per block
HEAD_DIM = 128  # the one head dim it takes (at 64 and 256 the Triton kernels stay)
STAGES = 2  # k/v buffers: q and two stages of k and v take 160 KB of the 227 KB
# Registers per thread at launch: 12 warps (4 asked: one consumer warpgroup; the other and the
# loader's warp round up to two more) x 32 threads x 168 fit the SM's 65536; the partitions then
# rebalance to 240 for each consumer and 24 for the loader.
MAXNREG = 168


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
def _causal_mask(s, first_row, first_col, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = first_col + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
    return gl.where(cols[None, :] <= rows[:, None], s, -float("inf"))


@gluon.jit
def _step(j, p, m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, zeros_s, first_row,
          QK_SCALE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr,
          p_layout: gl.constexpr, rows_o: gl.constexpr, s_layout: gl.constexpr):
    """Key block j >= 1: S_j = q k_j^T and O += P_{j-1} v_{j-1} issued together, S_j's online
    softmax while the second runs, then O rescaled to the new row maxima. Returns P_j's state."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    ks = j % stages
    vs = (j - 1) % stages
    mbarrier.wait(k_ready.index(ks), (j // stages) & 1)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(vs), ((j - 1) // stages) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s, ))  # S_j done; P_{j-1} v_{j-1} may still run
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _causal_mask(s, first_row, j * BLOCK_N, ROWS, BLOCK_N, s_layout)
    m_new = gl.maximum(m_i, gl.max(s, 1) * QK_SCALE)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * QK_SCALE - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(vs), count=1)
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    return p, m_new, l_i, acc


@gluon.jit
def _consumer(q_smem, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, o_ptr, lse_ptr, sink_ptr,
              n_blocks, first_row, bh, sq, h, QK_SCALE: gl.constexpr, HEADS: gl.constexpr, D: gl.constexpr,
              CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
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
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if CAUSAL:
        if BLOCK_N > first_row + 1:
            s = _causal_mask(s, first_row, 0, ROWS, BLOCK_N, s_layout)
    m_i = gl.max(s, 1) * QK_SCALE
    p = gl.exp2(s * QK_SCALE - m_i[:, None])
    l_i = gl.sum(p, 1)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    # blocks wholly left of the diagonal, then those crossing it, masked
    n_full = gl.minimum(gl.maximum((first_row + 1) // BLOCK_N, 1), n_blocks) if CAUSAL else n_blocks
    for j in range(1, n_full):
        p, m_i, l_i, acc = _step(j, p, m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                 zeros_s, first_row, QK_SCALE, ROWS, BLOCK_N, False, p_layout, rows_o, s_layout)
    for j in range(n_full, n_blocks):
        p, m_i, l_i, acc = _step(j, p, m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                 zeros_s, first_row, QK_SCALE, ROWS, BLOCK_N, True, p_layout, rows_o, s_layout)
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
        BLOCK_D: gl.constexpr, STAGES: gl.constexpr, GLUON: gl.constexpr):
    """o [batch, sq, HEADS, D] (o_ptr's dtype) and lse [batch, HEADS, sq] (log2 domain) of q
    [batch, sq, HEADS, D] and k, v [batch, sk, KV_HEADS, D] (16-bit), as attention._fwd gives them
    for problems without masking: sk a multiple of BLOCK_N; causal only with sq == sk. Grid
    (cdiv(sq, BLOCK_M), batch * HEADS), 4 warps asked. (BLOCK_D == D and GLUON: the config's marks.)"""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)  # longest first
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
    mbarrier.init(q_bar, count=1)
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
        (_consumer, (q_smem.slice(0, HALF), q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, o_ptr,
                     lse_ptr, sink_ptr, n_blocks, first_row, bh, sq, h, QK_SCALE, HEADS, D, CAUSAL, HAS_SINK, HALF,
                     BLOCK_N)),
        (_consumer, (q_smem.slice(HALF, HALF), q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, o_ptr,
                     lse_ptr, sink_ptr, n_blocks, first_row + HALF, bh, sq, h, QK_SCALE, HEADS, D, CAUSAL, HAS_SINK,
                     HALF, BLOCK_N)),
        (_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b * sk,
                   h // (HEADS // KV_HEADS) * D, n_blocks, BLOCK_N)),
    ], [4, 1], [240, 24])


fwd.xkern_maxnreg = MAXNREG  # read by launch.gluon_module and aot.compile_kernel


def config() -> L.Config:
    """The forward's config (GLUON marks it for attention._launch_fwd)."""
    return L.Config.of(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=HEAD_DIM, STAGES=STAGES, GLUON=1, num_warps=4,
                       num_stages=STAGES)


def applies(head_dim: int, itemsize: int, unmasked_keys: int, causal_square: int, capped: bool) -> bool:
    """Whether the problem is this kernel's: head dim 128, 16-bit, no soft cap, and either no
    masking at all with a key count BLOCK_N divides, or causal alone with as many queries as keys, a
    multiple of BLOCK_M."""
    return (head_dim == HEAD_DIM and itemsize == 2 and not capped
            and ((unmasked_keys > 0 and unmasked_keys % BLOCK_N == 0)
                 or (causal_square > 0 and causal_square % BLOCK_M == 0)))


def launch_fwd(q, k, v, sinks, out_dtype, consts: dict, backend: str):
    """(o, lse) as attention._launch_fwd returns them; consts: attention.Static.constexprs'."""
    import jax
    import jax.numpy as jnp

    b, sq, heads, _ = q.shape
    outs = [jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((b, heads, sq), jnp.float32)]
    sink = sinks if sinks is not None else jnp.zeros((1,), jnp.float32)
    cfg = config()
    return L.launch(fwd, q, k, v, sink, sq, k.shape[1], kernel="attention_fwd", out_shapes=outs,
                    grid=(L.cdiv(sq, cfg["BLOCK_M"]), b * heads), config=cfg, backend=backend,
                    constexprs={**{n: consts[n] for n in ("QK_SCALE", "HEADS", "KV_HEADS", "D", "CAUSAL")},
                                "HAS_SINK": sinks is not None})
