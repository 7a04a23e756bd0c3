"""The cost model that decides whether a rewrite wins over XLA; a rewrite that loses is declined.

Coefficients come from measurements on an H200 (benchmarks/results/README.md, shared/GPU.md):
a Triton custom call costs ~6.7 us on the GPU timeline where an XLA fusion costs ~0.8 us, so a
kernel must save more memory time than that. Only the `triton` backend is costed: the interpreter
exists to test kernels, so there every match is rewritten.
The size threshold was checked inside whole programs (h200-session14-probes.json): Flax GPT and Llama
decoder blocks (b4 s2048 d2048) ran 1-8% slower with every norm and RoPE match taken (64 MiB and less
a call) than with those declined.
"""
from __future__ import annotations

import types

import numpy as np

CUSTOM_CALL_US = 6.7
XLA_FUSION_US = 0.8
# Streaming bandwidth (TB/s, effective) of one pass, xkern kernel vs XLA, large shapes.
STREAM_TBPS = {"xkern": 4.0, "xla": 3.3}
ATTENTION_TFLOPS = {"xkern": 430, "xla": 150}  # forward, the slower (causal / non-causal) of each
SOFTMAX_MAX_ROW = 32768  # longer rows take the two-pass kernels, which lose fwd+bwd (0.84x)


def _too_small(nbytes: int) -> str | None:
    """Whether a kernel moving `nbytes` loses to XLA on the custom call's fixed cost alone."""
    ours = CUSTOM_CALL_US + nbytes / STREAM_TBPS["xkern"] / 1e6
    xla = XLA_FUSION_US + nbytes / STREAM_TBPS["xla"] / 1e6
    if ours < xla:
        return None
    return (f"too small: {nbytes / 2**20:.1f} MiB moved; estimated {ours:.1f} us as a kernel vs "
            f"{xla:.1f} us in XLA (a custom call costs ~{CUSTOM_CALL_US} us)")


def _softmax(avals, params) -> str | None:
    aval = avals[0]
    n_cols = int(np.prod([aval.shape[a] for a in params["axis"]]))
    if n_cols > SOFTMAX_MAX_ROW:
        return (f"rows of {n_cols} > {SOFTMAX_MAX_ROW}: the two-pass kernels lose to XLA's fused "
                "forward+backward (0.84x measured at 512x131072)")
    return _too_small(2 * int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize)


def _log_softmax(avals, params) -> str | None:
    """As softmax. Its backward recomputes softmax(x) from the saved x, as XLA's does, so when only
    the gradient is used XLA drops the forward kernel: on an H200 (16384x8192 bf16,
    h200-softmax-session13.json) forward 1.07x, forward+backward 1.17x (0.74x when the backward
    read the saved y)."""
    return _softmax(avals, params)


def _fused(avals, params) -> str | None:
    """A generated kernel for a group of elementwise / row-reduction equations.

    Measured on an H200 (16384x8192 bf16, benchmarks/results/h200-generated.json and
    h200-generated-session13.json): x*a+b*c 1.20x, gelu(x*a+b)*c 1.60x (3.86-3.94 TB/s), layer norm
    1.17x, rms norm 1.13x against XLA's own fusions, each group a whole program. So a large group is taken when its borders are ones XLA would not fuse across
    either (matmuls, custom calls, the program's inputs and outputs); next to an operation XLA would
    fuse it with, a separate kernel re-reads what XLA keeps in registers, so it is left alone.
    """
    if params.get("fusable_neighbour"):
        return (f"{params['fusable_neighbour']}, which XLA would fuse with the group (not measured "
                "to win there)")
    return _too_small(params["bytes"])


def _matmul_epilogue(avals, params) -> str | None:
    return ("matmul with a generated epilogue: measured on an H200 (h200-matmul-session13.json, tiles "
            "autotuned), 8192^3 bf16 + bias + gelu 1.10x forward but 1.01x forward+backward; "
            "16384x4096x16384 1.16x / 1.00x (0.96x in an earlier run): training at best ties, so cuBLAS "
            "(through XLA, with its own epilogue) keeps it")


def _cross_entropy(avals, params) -> str | None:
    """Measured on an H200 (8192x128256 bf16, h200-cross-entropy-session34.json): forward 2.05x, value
    and gradient of the mean 3.25x jax.jit (the per-row loss's 2.57x); the kernels stream the logits
    at up to 4.1 TB/s where XLA manages 1-2."""
    return _too_small(int(np.prod(avals[0].shape)) * np.dtype(avals[0].dtype).itemsize)


def _norm(avals, params) -> str | None:
    """Measured on an H200 (16384x8192 bf16, h200-norms-session12.json): layer norm 1.33x forward and
    1.75x forward+backward, rms norm 1.09x / 1.55x jax.jit; XLA needs two passes over a row for the
    statistics and three for the backward where the kernel keeps the row in registers. A norm of a
    residual sum (params residual_sum) also reads r and writes x + r: four tensors, not two."""
    tensors = 4 if params.get("residual_sum") else 2
    return _too_small(tensors * int(np.prod(avals[0].shape)) * np.dtype(avals[0].dtype).itemsize)


def _linear_cross_entropy(avals, params) -> str | None:
    """The logits never exist whole (chunks of at most 1 GiB); the matmuls are XLA's. Taken unless the
    logits are small enough for the custom calls' fixed cost to matter."""
    h, w = avals[0], avals[1]
    vocab = w.shape[1] if w.shape[0] == h.shape[-1] else w.shape[0]  # w [D, V], or [V, D] transposed
    logits = int(np.prod(h.shape[:-1])) * vocab * np.dtype(h.dtype).itemsize
    return _too_small(logits)


def _attention(avals, params) -> str | None:
    """Flash attention against XLA's attention, by their measured rates (H200, h200-attention.json):
    the kernels run at 430-500 TFLOP/s forward, XLA at 47-150 (it writes and re-reads the scores).
    So only a problem small enough for the custom call's fixed cost to dominate is left to XLA. The
    key length is the larger of k's axes 1 and 2 (sequence and heads, in either layout the patterns
    accept): sequences are longer than head counts wherever the estimate matters. Decoding (few
    queries against a cache) is bound by reading the cache instead: see _decoding."""
    avals = _one_batch(avals, params)
    q, k = avals[0], avals[1]
    if q.ndim == 3:  # heads folded into the batch, [b * h, s, d]: one head each
        q, k = (_one_head(a) for a in (q, k))
    d = q.shape[-1]
    if (reason := _decoding(q, k, avals[3:])) != "not decoding":
        return reason
    flops = 4 * (int(np.prod(q.shape)) // d) * max(k.shape[1], k.shape[2]) * d
    ours, xla = CUSTOM_CALL_US + flops / ATTENTION_TFLOPS["xkern"] / 1e6, \
        XLA_FUSION_US + flops / ATTENTION_TFLOPS["xla"] / 1e6
    if ours < xla:
        return None
    return (f"too small: {flops / 1e9:.2f} GFLOP; estimated {ours:.1f} us as a kernel vs {xla:.1f} us "
            f"in XLA (a custom call costs ~{CUSTOM_CALL_US} us)")


def _one_batch(avals, params):
    """The avals as the kernels take them where a spelling of any batch rank matched (params'
    batch_dims: q, k, v [*batch, 3 dims], and masks and biases of the scores' rank): their batch
    dims made one ([1] where there are none)."""
    n = params.get("batch_dims")
    if n is None:
        return avals
    one = lambda a: types.SimpleNamespace(shape=(int(np.prod(a.shape[:n])), *a.shape[n:]), dtype=a.dtype, ndim=4)
    return [one(a) if a.ndim == n + 3 else a for a in avals]


def _one_head(aval):
    """A [b, s, d] aval as [b, s, 1, d]."""
    return types.SimpleNamespace(shape=(aval.shape[0], aval.shape[1], 1, aval.shape[2]), dtype=aval.dtype,
                                 ndim=4)


# Attention with dropout, H200 bf16, flax's dropout_rate 0.1 with a padding mask: XLA's program, which
# writes and re-reads the scores, costs about a score's traffic whatever the head dim: 3.3 ps a score
# forward at b4 s4096 h32 d128 (7.05 ms), 7.1 at b32 s512 h16 d64 (h200-attention-dropout-session24.json).
# The kernels read the multiplier beside each score tile: 223 TFLOP/s forward at d64, 304 at d128,
# 316 in the backward (h200-attention-sk16-session25.json; ~90 before its rows loaded as vectors). So
# they win up to head dims of ~180.
DROPOUT_TFLOPS = 220
XLA_DROPOUT_PS_PER_SCORE = 3.3


def _attention_dropout(avals, params) -> str | None:
    avals = _one_batch(avals, params)
    q, k = avals[0], avals[1]
    d = q.shape[-1]
    scores = (int(np.prod(q.shape)) // d) * max(k.shape[1], k.shape[2])
    ours = CUSTOM_CALL_US + 4 * scores * d / DROPOUT_TFLOPS / 1e6
    xla = XLA_FUSION_US + scores * XLA_DROPOUT_PS_PER_SCORE / 1e6
    if ours < xla:
        return None
    if ours - CUSTOM_CALL_US < xla - XLA_FUSION_US:
        return (f"too small: estimated {ours:.1f} us as a kernel vs {xla:.1f} us in XLA (a custom call costs "
                f"~{CUSTOM_CALL_US} us)")
    return (f"attention with dropout at head dim {d}: the kernels read the dropout multiplier per tile and "
            f"run at ~{DROPOUT_TFLOPS} TFLOP/s (H200), estimated {ours / 1e3:.2f} ms against {xla / 1e3:.2f} in "
            f"XLA (~{XLA_DROPOUT_PS_PER_SCORE} ps a score): they win only at head dims up to "
            f"~{int(XLA_DROPOUT_PS_PER_SCORE * DROPOUT_TFLOPS / 4)}")


# Reading a key/value cache (TB/s, effective), H200 bf16 (h200-decode-session16.json): the split-key
# kernel 3.1-4.2; XLA 0.9-1.3 where k/v heads are grouped and the batch > 1 (b8 GQA 32/8), 3.4-3.5
# with one k/v head per q head or a batch of 1.
DECODE_TBPS = {"xkern": 3.8, "xla grouped": 1.2, "xla": 3.4}
# A decode step through the split-key kernel (its launch, the merge, the lengths' fusion) took
# 0.056-0.068 ms however small the cache (b8 s2048: 0.068 against XLA's 0.062): where XLA's own step
# is estimated below this, it stays with XLA.
DECODE_FLOOR_US = 70.0


def _decoding(q, k, extras) -> str | None:
    """The split-key forward (xkern.kernels.attention: few query rows per key head, many more keys
    than queries) against XLA's einsums, both bound by the bytes of q, k, v and o; "not decoding"
    where the kernel does not apply. The merge of its chunks costs two XLA fusions. `extras`: the
    match's other inputs (a boolean mask among them: the masked kernel)."""
    from xkern.kernels.attention import SPLIT_KV_KEYS_PER_QUERY, SPLIT_KV_ROWS
    sq, heads = sorted(q.shape[1:3])  # either layout: queries x heads is what counts
    kv_heads, sk = sorted(k.shape[1:3])
    if sq * heads // max(kv_heads, 1) > SPLIT_KV_ROWS or SPLIT_KV_KEYS_PER_QUERY * sq > sk:
        return "not decoding"
    grouped = heads > kv_heads and q.shape[0] > 1
    if not grouped and any(a.ndim == 4 and a.dtype == np.bool_ for a in extras):
        return ("decoding with a mask and one k/v head per q head (or a batch of 1): measured at a tie with "
                "XLA, 0.307 against 0.311 ms (b8 s8192 h32, H200), and a Flax decode=True step at 0.88x")
    nbytes = q.dtype.itemsize * 2 * (int(np.prod(q.shape)) + int(np.prod(k.shape)))
    xla_rate = DECODE_TBPS["xla grouped" if grouped else "xla"]
    ours = CUSTOM_CALL_US + 2 * XLA_FUSION_US + nbytes / DECODE_TBPS["xkern"] / 1e6
    xla = 3 * XLA_FUSION_US + nbytes / xla_rate / 1e6
    if ours < xla and xla > DECODE_FLOOR_US:
        return None
    return (f"decoding, too small: {nbytes / 2**20:.1f} MiB of cache read; estimated {max(ours, DECODE_FLOOR_US):.1f}"
            f" us as a kernel (a step costs ~{DECODE_FLOOR_US:.0f} us at least) vs {xla:.1f} us in XLA")


def _glu(avals, params) -> str | None:
    return ("swiglu/geglu: XLA fuses act(a) * b and its gradient at ~4.2 TB/s; the kernels tie it "
            "(H200, 16384x8192 bf16, h200-glu.json: swiglu 0.97x fwd / 0.99x fwd+bwd, geglu 1.10x / 0.95x, "
            "split form 1.01x / 0.99x) and, as custom calls, would keep XLA from fusing neighbouring elementwise "
            "ops; xkern.ops.swiglu / geglu stay available for explicit use")


def _rope(avals, params) -> str | None:
    """Measured on an H200 (4x4096x32x128 bf16, h200-rope.json): half rotation 0.98x forward (XLA
    fuses the concatenate form at 3.7 TB/s) but 1.38x forward+backward; interleaved 2.29x / 1.75x
    (XLA's stride-2 slices and stack run at 1.6-2.2 TB/s). A near tie at worst, a win when trained."""
    x = avals[0]
    return _too_small(2 * int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize)


RULES = {"softmax": _softmax, "log_softmax": _log_softmax, "fused": _fused,
         "matmul_epilogue": _matmul_epilogue, "cross_entropy": _cross_entropy,
         "layer_norm": _norm, "rms_norm": _norm, "linear_cross_entropy": _linear_cross_entropy,
         "attention": _attention, "attention_dropout": _attention_dropout, "swiglu": _glu, "geglu": _glu,
         "rope": _rope}
# Ops whose result is as large as their input: XLA may never write it (see FUSED_CONSUMERS).
FULL_SIZE_RESULTS = frozenset({"softmax", "log_softmax"})
# Consumers that XLA fuses a row-wise result into without ever writing it (cross-entropy's gather,
# a sum): a kernel would have to write the whole result first. Measured: an LM loss through
# log_softmax + take_along_axis ran at 0.68x forward when rewritten.
FUSED_CONSUMERS = frozenset({"gather", "reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"})


def decline_reason(op: str, avals, params: dict, backend: str, consumers=()) -> str | None:
    """Why replacing `op` at these inputs would lose to XLA on `backend`, or None if it wins.

    consumers: primitive names of the equations that read the result ("output" for a program output).
    """
    if backend != "triton" or op not in RULES:
        return None
    if op in FULL_SIZE_RESULTS and consumers and set(consumers) <= FUSED_CONSUMERS:
        return (f"its result is only read by {', '.join(sorted(set(consumers)))}, which XLA fuses "
                "without writing the result (cross-entropy belongs to a cross_entropy kernel)")
    return RULES[op](avals, params)
