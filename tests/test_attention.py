"""xkern.ops.attention against a float32 jax.numpy reference (scores materialized): outputs and the
q / k / v (and bias) gradients, causal and not, masks, bias, GQA / MQA, padding by kv_lengths, odd
lengths, head dims 64 and 128, edge values, vmap, and errors; through the interpreter."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xkern
from xkern.kernels.attention import attention, reference
from xkern.kernels import attention as A
from xkern.kernels import launch as L
from xkern.kernels.launch import kernel_names

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}


def make(b, sq, sk, h, hk, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, do = (jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype) for _ in range(2))
    return q, k, v, do


def close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * max(np.abs(want).max(), 1.0))


def matches_float32_jax_jit(f, q, k, v, extra, do):
    """f(q, k, v, extra) of bfloat16 q, k, v under xkern.jit, and its gradients at do, against
    jax.jit's of float32 copies, within bfloat16's tolerance."""
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v, extra), jax.jit(f)(*f32, extra), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(f(q, k, v, extra).astype(jnp.float32) * do.astype(jnp.float32))
    for got, want in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v),
                         jax.jit(jax.grad(loss, (0, 1, 2)))(*f32)):
        close(got, want, jnp.bfloat16)


def value_and_grads(f, args, do, **kw):
    """f(*args, **kw) and its vjp at do, in one jit. Run eagerly, every op around the kernels (and
    every op of the reference) is compiled on its own, for each new shape: most of a test's time
    through the interpreter. Arrays in kw are arguments of the jit, not constants, so the kernels
    see them as they see a traced mask or length."""
    arrays = {n: v for n, v in kw.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = {n: v for n, v in kw.items() if n not in arrays}

    @jax.jit
    def run(args, arrays, do):
        out, vjp = jax.vjp(lambda *a: f(*a, **arrays, **static), *args)
        return out, vjp(do)

    return run(tuple(args), arrays, do)


CASES = {  # name: ((b, sq, sk, h, hk, d), options)
    "plain": ((2, 19, 19, 2, 2, 16), {}),
    "causal, longer keys": ((1, 17, 33, 2, 2, 16), {"causal": True}),
    "causal, longer queries": ((1, 33, 17, 2, 2, 16), {"causal": True}),
    "gqa": ((1, 20, 20, 4, 2, 16), {"causal": True}),
    "gqa, several interior blocks": ((1, 50, 50, 4, 2, 16), {"causal": True}),
    "mqa, kv_lengths": ((2, 18, 23, 4, 1, 16), {"kv_lengths": np.array([5, 23])}),
    "mask over heads": ((2, 18, 18, 2, 2, 16), {"mask": (2, 2, 18, 18)}),
    "mask shared": ((2, 18, 21, 2, 2, 16), {"mask": (18, 21)}),
    "bias per head, scale": ((1, 18, 21, 2, 2, 16), {"bias": (1, 2, 18, 21), "scale": 0.3}),
    "head dim 64": ((1, 20, 20, 2, 1, 64), {"causal": True}),
    "head dim 128": ((1, 17, 17, 1, 1, 128), {}),
    "head dim 40 (padded)": ((1, 17, 17, 2, 2, 40), {"causal": True}),
    "sliding window, causal, gqa": ((1, 50, 50, 4, 2, 16), {"causal": True, "local_window_size": (20, 5)}),
    "window both sides, longer keys": ((1, 33, 50, 2, 1, 16), {"local_window_size": (7, 18)}),
    "window, kv_lengths, bias": ((2, 40, 40, 2, 2, 16), {"local_window_size": 9, "kv_lengths": np.array([13, 40]),
                                                         "bias": (1, 2, 40, 40)}),
    "window and mask": ((2, 24, 30, 2, 2, 16), {"local_window_size": (3, None), "mask": (2, 1, 24, 30)}),
    "soft cap, causal, gqa": ((1, 50, 50, 4, 2, 16), {"causal": True, "logits_soft_cap": 0.8}),
    "soft cap, sliding window": ((1, 40, 40, 2, 1, 16), {"causal": True, "local_window_size": (12, 0),
                                                         "logits_soft_cap": 1.0}),  # Gemma 2's local layers
    "soft cap, mask, bias, lengths": ((2, 18, 21, 2, 2, 16), {"mask": (2, 1, 18, 21), "bias": (1, 2, 18, 21),
                                                             "kv_lengths": np.array([21, 11]), "logits_soft_cap": 1.5}),
    # a bias the same for every query ([.., 1, k]) is read per key; with a second bias, both are read
    "key bias per entry, gqa": ((2, 19, 50, 4, 2, 16), {"bias": (2, 1, 1, 50)}),
    "key bias, causal, sliding window": ((2, 40, 40, 2, 1, 16), {"bias": (2, 1, 1, 40), "causal": True,
                                                                "local_window_size": (9, 0)}),
    "key bias per head, mask, lengths": ((2, 18, 21, 2, 2, 16), {"bias": (1, 2, 1, 21), "mask": (2, 1, 18, 21),
                                                                "kv_lengths": np.array([21, 11])}),
    "pair and key biases, causal": ((2, 18, 21, 2, 2, 16), {"bias": ((1, 2, 18, 21), (2, 1, 1, 21)), "causal": True}),
}


def _options(opts, seed=1):
    rng = np.random.default_rng(seed)
    out = dict(opts)
    if "mask" in out:
        out["mask"] = jnp.asarray(rng.random(out["mask"]) > 0.3)
    if "bias" in out:  # (a shape, or a tuple of shapes: biases added)
        shapes = out["bias"] if isinstance(out["bias"][0], tuple) else (out["bias"],)
        out["bias"] = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)
    if "kv_lengths" in out:
        out["kv_lengths"] = jnp.asarray(out["kv_lengths"], jnp.int32)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_values_and_gradients(case, dtype):
    shape, opts = CASES[case]
    q, k, v, do = make(*shape, dtype)
    kw = _options(opts)
    args = (q, k, v, *kw.pop("bias", ()))
    ours = lambda q, k, v, *b, **kw: attention(q, k, v, bias=None if not b else b[0] if len(b) == 1 else b, **kw)
    ref = lambda q, k, v, *b, **kw: reference(q, k, v, bias=sum(b) if b else None, **kw)
    f32 = [a.astype(jnp.float32) for a in args]
    out, grads = value_and_grads(ours, args, do, **kw)
    want, grads_ref = value_and_grads(ref, f32, do.astype(jnp.float32), **kw)
    assert out.dtype == dtype
    close(out, want, dtype)
    for g, w, a in zip(grads, grads_ref, args):
        assert g.dtype == a.dtype
        close(g, w, dtype)


def test_the_soft_cap_is_applied_before_the_bias():
    """The reference the soft-capped cases compare with: c tanh(s / c), then the bias; it moves the
    result by far more than the tolerance, so a kernel that ignored it would fail them."""
    q, k, v, _ = make(1, 18, 21, 2, 2, 16, jnp.float32, seed=3)
    bias = jnp.asarray(np.random.default_rng(4).standard_normal((1, 2, 18, 21)), jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(0.8 * jnp.tanh(s / 0.8) + bias, -1), v)
    close(reference(q, k, v, bias=bias, logits_soft_cap=0.8), want, jnp.float32)
    assert np.abs(np.asarray(reference(q, k, v, bias=bias) - want)).max() > 0.05


@pytest.mark.parametrize("causal, with_bias", [(False, False), (True, False), (False, True)],
                         ids=["mask", "mask, causal", "mask, bias"])
def test_structured_masks_skip_hidden_tiles_and_equal_the_reference(causal, with_bias):
    # Documents [0, 32), [32, 40), [40, 50) and padded queries from 46 on: on the interpreter's
    # 16 x 16 tiles some are wholly hidden (never listed), some wholly visible (the unmasked path),
    # some cut by the causal diagonal alone (edge tiles: the mask is not read) and some cut by the
    # mask (it is read), in every kernel. Each row of tiles lists the runs of visible tiles, the edge
    # tiles and the masked tiles.
    from xkern.kernels.attention import _mask_tiles
    from xkern.kernels.launch import Config
    doc = np.searchsorted([32, 40], np.arange(50), side="right")
    mask = jnp.asarray((doc[:, None] == doc[None, :]) & (np.arange(50) < 46)[:, None])
    tiles, by_keys = (np.asarray(_mask_tiles(mask[None, None].astype(jnp.int8), Config.of(BLOCK_M=16, BLOCK_N=16),
                                             causal, by_keys=by_keys)) for by_keys in (False, True))
    assert tiles.shape == by_keys.shape == (1, 1, 4, 3 + 4 * 4)

    def decoded(row):  # ([first, end) runs of visible tiles], [edge tiles], [masked tiles])
        runs, edges, masked = row[:3]
        return ([tuple(row[3 + 2 * r:5 + 2 * r]) for r in range(runs)], row[3 + 8:3 + 8 + edges],
                row[3 + 12:3 + 12 + masked])
    want = {False: [([(0, 2)], [], []), ([(0, 2)], [], []), ([], [], [2, 3]), ([], [], [])],
            True: [([], [0], []), ([(0, 1)], [1], []), ([], [], [2]), ([], [], [])]}[causal]
    assert [decoded(row.tolist()) for row in tiles[0, 0]] == want
    # by key block: key block 0 is wholly visible to query blocks 0 and 1 (causal: to 1; 0 is an
    # edge); the last keys are mixed in query block 2 (causal: only the padded queries 48-49 could
    # see them)
    assert decoded(by_keys[0, 0, 0].tolist()) == (([(1, 2)], [0], []) if causal else ([(0, 2)], [], []))
    assert decoded(by_keys[0, 0, 3].tolist()) == (([], [], []) if causal else ([], [], [2]))
    q, k, v, do = make(1, 50, 50, 2, 1, 16, jnp.bfloat16, seed=5)
    bias = jnp.asarray(np.random.default_rng(6).standard_normal((1, 2, 50, 50)), jnp.float32) if with_bias else None
    args = (q, k, v) + (() if bias is None else (bias,))
    ours = lambda q, k, v, *b, **kw: attention(q, k, v, bias=b[0] if b else None, **kw)
    ref = lambda q, k, v, *b, **kw: reference(q, k, v, bias=b[0] if b else None, **kw)
    out, grads = value_and_grads(ours, args, do, mask=mask, causal=causal)
    want, grads_ref = value_and_grads(ref, [a.astype(jnp.float32) for a in args], do.astype(jnp.float32),
                                      mask=mask, causal=causal)
    close(out, want, jnp.bfloat16)
    assert np.all(np.asarray(out[:, 46:]) == 0)  # padded queries see no key
    for g, w in zip(grads, grads_ref):
        close(g, w, jnp.bfloat16)

@settings(max_examples=5, deadline=None)  # ~8 s each through the interpreter
@given(sq=st.integers(17, 64), sk=st.integers(17, 64), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
       causal=st.booleans(), kind=st.sampled_from(["random", "documents", "padding"]), lengths=st.booleans(),
       per_head=st.booleans(), seed=st.integers(0, 2**16))
def test_random_masks_equal_the_reference(sq, sk, kv_heads, group, causal, kind, lengths, per_head, seed):
    # Whatever tiles a mask leaves visible, partly visible or hidden (runs of visible tiles, lists
    # of partial ones, per query block and per key block), values and gradients equal the reference.
    # At least two 16-wide tiles each way (the interpreter's), so runs end before other tiles.
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    shape = (2, heads if per_head else 1, sq, sk)
    if kind == "random":
        mask = rng.random(shape) < rng.uniform(0.2, 1.0)
    elif kind == "documents":  # block-diagonal: query i and key j in the same document
        ends = np.sort(rng.integers(0, max(sq, sk) + 1, size=2))
        mask = np.searchsorted(ends, np.arange(sq), side="right")[:, None] == np.searchsorted(
            ends, np.arange(sk), side="right")[None, :]
    else:
        mask = (np.arange(sq) < rng.integers(16, sq + 1))[:, None] & (np.arange(sk) < rng.integers(16, sk + 1))[None, :]
    mask = jnp.asarray(np.broadcast_to(mask, shape))
    q, k, v, do = make(2, sq, sk, heads, kv_heads, 16, jnp.float32, seed=seed)
    lengths = jnp.asarray(rng.integers(0, sk + 1, 2), jnp.int32) if lengths else None
    kw = dict(causal=causal, mask=mask, kv_lengths=lengths)
    out, grads = value_and_grads(attention, (q, k, v), do, **kw)
    want, grads_ref = value_and_grads(reference, (q, k, v), do, **kw)
    close(out, want, jnp.float32)
    for g, w in zip(grads, grads_ref):
        close(g, w, jnp.float32)


def test_configs_fit_in_the_devices_shared_memory():
    """float32 inputs, masks and biases need more shared memory per tile: the configs offered must
    fit (on the H200, float32 head dim 128 and a mask with a float32 bias failed to launch with the
    bfloat16 tiles). xkern.kernels.aot compiles the heuristic's picks and checks what Triton allocates."""
    from xkern.kernels import attention as A
    for gpu, limit in (("cuda", 232448), ("cuda", 166912), ("rocm", 65536)):
        for kernel in ("fwd", "dkdv", "dq"):
            for d in (64, 128, 256):
                plain = A.candidates(kernel, d, "triton", gpu, limit=limit)
                assert plain, (gpu, kernel, d)
                if limit == 232448:  # the H200's measured winners stay first for plain bf16
                    own = A.TILES.get((gpu, kernel, "d64"), []) if d <= 64 else []  # d64's heuristic, then the rest
                    first = (own + A.TILES[(gpu, kernel, "wide" if d > 128 else "narrow")])[0]
                    c = plain[0]
                    assert (c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) == first
                for fit in ({"itemsize": 4, "mask": True, "bias": True}, {"itemsize": 2, "mask": True, "bias": False}):
                    configs = A.candidates(kernel, d, "triton", gpu, limit=limit, **fit)
                    assert configs and all(A.shared_bytes(kernel, c, gpu=gpu, **fit) <= limit for c in configs)
                    assert len(configs) <= len(plain)
    big = A.candidates("dq", 128, "triton", "cuda", itemsize=4, mask=True, bias=True)[0]
    assert A.shared_bytes("dq", big, 4, True, True) < A.shared_bytes("dq", A.candidates("dq", 128, "triton", "cuda")[0], 4,
                                                                       True, True)


def test_the_tuners_measure_checks_each_candidate_against_the_first(monkeypatch):
    """tuned_configs' measure (run here through the interpreter, every candidate measured as the GPU's
    tuner would, the timer faked) runs each kernel's launch on the problem's random inputs and hands
    its results to autotune.agrees: a candidate whose results differ from the first's is skipped."""
    from xkern.tuning import autotune
    q, k, _, _ = make(1, 32, 32, 2, 1, 16, jnp.bfloat16)
    st = A.Static(True, 0.25, None, None, False, "interpret", ())
    seen = []

    def tuned(family, key, candidates, measure, backend, version=""):
        wrong = candidates[0].replace(BLOCK_N=candidates[0]["BLOCK_N"])  # (the same tile: the same results)
        best, seconds = autotune.best([candidates[0], wrong], measure)
        seen.append((family, seconds))
        return best
    monkeypatch.setattr(autotune, "tuned", tuned)
    monkeypatch.setattr(A, "time_pipelined", lambda step, *args, **kw: 1.0)
    checked = []
    real_agrees = autotune.agrees
    monkeypatch.setattr(autotune, "agrees", lambda first, out: (checked.append(len(first)), real_agrees(first, out)))
    configs = A.tuned_configs(q, k, st)
    assert [f for f, _ in seen] == ["attention_fwd", "attention_dkdv", "attention_dq"]
    assert all(seconds == 1.0 for _, seconds in seen) and len(configs) == 3
    # each kernel: the first candidate's results recorded (o and lse; dq, dk and dv), then compared
    assert checked.count(0) == 3 and sorted(set(checked)) == [0, 2, 3] and len(checked) > 6


def test_candidates_leave_out_miscompiled_tiles():
    """Tiles whose kernels came out wrong on the H200 (Triton 3.6 on sm_90) are offered for no problem:
    dk/dv stepping 32 queries with 8 warps (dk off at head dims 64, 128 and 256), and at head dims up
    to 128 any dk/dv tile of 32 queries (4 warps, 3 stages: dk off at 2048 queries), but where nothing
    larger fits in shared memory. Head dim 64 has a dq heuristic of its own, first, and then the
    narrow list."""
    fits = ({}, {"itemsize": 4, "mask": True, "bias": True}, {"unmasked_keys": 4096, "unmasked_queries": 4096},
            {"causal_square": 4096}, {"mask": True}, {"itemsize": 4})
    for d in (32, 64, 128, 256):
        for fit in fits:
            offered = A.candidates("dkdv", d, "triton", "cuda", tma=True, **fit)
            for c in offered:
                assert not (c["BLOCK_M"] == 32 and c.num_warps == 8), (d, fit, c)
            small = [c for c in offered if c["BLOCK_M"] == 32]
            if d <= 128 and small:
                assert small == offered, (d, fit, offered)  # (float32: nothing larger fits)
    fallback = A.candidates("dkdv", 128, "triton", "cuda", tma=True, itemsize=4, mask=True, bias=True)
    assert [(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) for c in fallback] == [(32, 32, 4, 2)]
    first = A.candidates("dq", 64, "triton", "cuda", tma=True)
    assert (first[0]["BLOCK_M"], first[0]["BLOCK_N"], first[0].num_warps, first[0].num_stages) == (128, 64, 4, 3)
    assert [c for c in A.candidates("dq", 128, "triton", "cuda", tma=True)
            if (c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) == (128, 64, 4, 3)] == []
    assert len(first) == len(A.candidates("dq", 128, "triton", "cuda", tma=True)) + 1


def test_float16_and_the_kernels_launched():
    q, k, v, do = make(1, 24, 24, 2, 2, 32, jnp.float16, seed=2)
    close(attention(q, k, v, causal=True), reference(q, k, v, causal=True), jnp.float16)
    grad = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * do), (0, 1, 2))
    assert kernel_names(jax.make_jaxpr(grad)(q, k, v)) == ["attention_fwd", "attention_bwd_dkdv",
                                                           "attention_bwd_dq"]
    want = jax.jit(jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v) * do), (0, 1, 2)))(
        *(a.astype(jnp.float32) for a in (q, k, v)))
    for g, w in zip(jax.jit(grad)(q, k, v), want):
        close(g, w, jnp.float16)


def test_queries_that_see_no_key_get_zeros_and_zero_gradients():
    q, k, v, do = make(1, 18, 18, 2, 2, 16, jnp.float32, seed=3)
    mask = jnp.ones((18, 18), bool).at[4].set(False)
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, mask=mask), q, k, v)
    assert np.all(np.asarray(out[0, 4]) == 0)
    dq, dk, dv = vjp(do)
    assert np.all(np.asarray(dq[0, 4]) == 0) and np.isfinite(np.asarray(dk)).all()
    padded = attention(q, k, v, kv_lengths=jnp.array([0]))
    assert np.all(np.asarray(padded) == 0)


def test_nan_propagates_like_xla_and_empty_inputs():
    q, k, v, _ = make(1, 18, 18, 1, 1, 16, jnp.float32, seed=4)
    q = q.at[0, 3, 0, 0].set(jnp.nan)
    for kw in ({}, {"masked_rows": "average"}):  # a NaN row is not a row without keys
        got, want = np.asarray(attention(q, k, v, **kw)), np.asarray(reference(q, k, v))
        assert np.array_equal(np.isnan(got), np.isnan(want))
        close(np.nan_to_num(got), np.nan_to_num(want), jnp.float32)
    dk = jax.grad(lambda k: jnp.sum(attention(q, k, v)))(k)  # every key met the NaN query
    assert np.isnan(np.asarray(dk)).all()
    empty = attention(q[:, :0], k, v)
    assert empty.shape == (1, 0, 1, 16)
    no_keys = attention(q, k[:, :0], v[:, :0])  # an empty cache or encoder output: zeros, as jax.nn's
    assert no_keys.shape == q.shape and not np.any(np.asarray(no_keys))
    by_hand = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    np.testing.assert_array_equal(xkern.jit(by_hand)(q, k[:, :0], v[:, :0]), jax.jit(by_hand)(q, k[:, :0], v[:, :0]))
    # empty problems of any batch rank (batch dims made one: reshaped by their count, not -1, as a
    # zero-length axis leaves -1 undefined), and an empty batch with a bias per entry
    any_rank = lambda q, k, v: jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(
        jnp.einsum("...qhd,...khd->...hqk", q, k) / 4.0, -1), v)
    biased = lambda q, k, v, bias: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(
        jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0 + bias, -1), v)
    for f, args in ((any_rank, (jnp.ones((2, 2, 8, 2, 16)), jnp.ones((2, 2, 0, 2, 16)), jnp.ones((2, 2, 0, 2, 16)))),
                    (any_rank, (jnp.ones((2, 2, 0, 2, 16)), jnp.ones((2, 2, 8, 2, 16)), jnp.ones((2, 2, 8, 2, 16)))),
                    (jax.vmap(any_rank), (jnp.ones((2, 1, 8, 2, 16)),) + (jnp.ones((2, 1, 0, 2, 16)),) * 2),
                    (biased, (jnp.ones((0, 8, 2, 16)),) * 3 + (jnp.ones((0, 2, 8, 8)),))):
        want = jax.jit(f)(*args)
        got = xkern.jit(f)(*args)
        [match] = xkern.explain(f)(*args).matches  # (taken; the op runs an empty problem as XLA would)
        assert got.shape == want.shape and match.pattern.startswith("attention/")
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("cap", [None, 1.0], ids=["uncapped", "soft cap"])
def test_vmap_folds_into_the_batch(cap):
    q, k, v, do = make(2, 17, 17, 2, 1, 16, jnp.bfloat16, seed=5)
    qs = jnp.stack([q, q * 0.5, -q * 3])
    mask = jnp.asarray(np.random.default_rng(6).random((3, 17, 17)) > 0.2)
    f = lambda q, m: attention(q, k, v, mask=m, causal=True, logits_soft_cap=cap)
    r = lambda q, m: reference(q, k, v, mask=m, causal=True, logits_soft_cap=cap)
    close(jax.jit(jax.vmap(f))(qs, mask), jax.jit(jax.vmap(r))(qs, mask), jnp.bfloat16)
    g = jax.jit(jax.vmap(jax.grad(lambda q, m: jnp.sum(f(q, m).astype(jnp.float32) * do))))(qs, mask)
    w = jax.jit(jax.vmap(jax.grad(lambda q, m: jnp.sum(r(q, m).astype(jnp.float32) * do))))(qs, mask)
    close(g, w, jnp.bfloat16)


def test_bad_input_names_the_argument():
    q, k, v, _ = make(1, 8, 8, 4, 2, 16, jnp.float32)
    cases = [((q[0], k, v), {}, ValueError, "q must be \\[batch, seq, heads, head_dim\\]"),
             ((q.astype(jnp.int32), k, v), {}, TypeError, "q must have dtype"),
             ((q, k.astype(jnp.bfloat16), v), {}, TypeError, "k and v must have q's dtype"),
             ((q, k[..., :8], v), {}, ValueError, "k and v must both be"),
             ((q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), {}, ValueError, "must divide q's heads"),
             ((q, k, v), {"mask": jnp.ones((8, 8))}, TypeError, "mask must be boolean"),
             ((q, k, v), {"mask": jnp.ones((3, 8, 8), bool)}, ValueError, "mask must broadcast"),
             ((q, k, v), {"bias": jnp.ones((8, 9))}, ValueError, "bias must broadcast"),
             ((q, k, v), {"bias": (jnp.ones((8, 8)), jnp.ones((1, 9)))}, ValueError,
              "bias\\[1\\] must broadcast .* got shape \\(1, 9\\)"),
             ((q, k, v), {"bias": (jnp.ones((8, 8)), None)}, TypeError, "bias\\[1\\] must be an array; got None"),
             ((q, k, v), {"scale": float("nan")}, ValueError, "scale must be"),
             ((q, k, v), {"kv_lengths": jnp.ones((2,), jnp.int32)}, ValueError, "kv_lengths must be"),
             *(((q, k, v), {"logits_soft_cap": c}, ValueError, "logits_soft_cap must be a positive finite number")
               for c in (0.0, -2.0, float("inf"), jnp.ones(2))),
             *(((q, k, v), {"local_window_size": w}, ValueError, "local_window_size must be an int >= 0")
               for w in (-1, (1, 2, 3), (4, -2), "8", True, 2.5))]
    for args, kw, error, message in cases:
        with pytest.raises(error, match=message):
            attention(*args, **kw)
    close(attention(q, k, v, scale=np.float32(0.3)), attention(q, k, v, scale=0.3), jnp.float32)
    assert xkern.ops.attention is attention


# --------------------------------------------------------------------------------------------------
# Patterns: the ways people write attention, found by xkern.jit / xkern.optimize
# --------------------------------------------------------------------------------------------------

def _spellings():
    import flax.linen as nn

    from xkern.jaxpr_passes import attention_rules as R

    bias = jnp.asarray(np.random.default_rng(7).standard_normal((1, 4, 20, 20)), jnp.float32)
    return {  # pattern name: (program, GQA k/v?)
        "jax.nn.dot_product_attention": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v), True),
        "jax.nn.dot_product_attention(causal)":
            (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"), True),
        "jax.nn.dot_product_attention+bias": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=bias), False),
        "flax.linen.dot_product_attention": (lambda q, k, v: nn.dot_product_attention(q, k, v), False),
        "einsum[bshd]+causal+float32 softmax":
            (lambda q, k, v: R.by_hand("bshd", True, True)(q, k, v, scale=0.2), False),
        "einsum[bhsd]": (lambda q, k, v: R.by_hand("bhsd", False, False)(q, k, v, scale=0.3), False),
        "einsum[bshd]/divisor+causal": (lambda q, k, v: R.by_hand("bshd", True, False, "/divisor")(q, k, v, scale=3.0),
                                        False),
        "einsum[bhsd]/sqrt(d)+float32 softmax": (lambda q, k, v: R.by_hand("bhsd", False, True, "/sqrt(d)")(q, k, v),
                                                 False),
        # where the scale and the float32 cast come elsewhere
        "einsum[bshd]+scaled q+causal": (lambda q, k, v: R.by_hand("bshd", True, False, scores="scaled q")(
            q, k, v, scale=0.3), False),
        "einsum[bhsd]/sqrt(d)+scaled q+float32 softmax": (lambda q, k, v: R.by_hand(
            "bhsd", False, True, "/sqrt(d)", scores="scaled q")(q, k, v), False),
        "einsum[bshd]/divisor+float32 product": (lambda q, k, v: R.by_hand(
            "bshd", False, True, "/divisor", scores="float32 product")(q, k, v, scale=4.0), False),
        "einsum[bhsd]+upcast product+causal": (lambda q, k, v: R.by_hand(
            "bhsd", True, True, scores="upcast product")(q, k, v, scale=0.25), False),
        "jax.nn.dot_product_attention(causal), vmapped per example": (lambda q, k, v: jax.vmap(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v), True),
        "einsum[bshd]*array+causal": (lambda q, k, v: R.by_hand("bshd", True, False, "*array")(
            q, k, v, 1 / jnp.sqrt(q.shape[-1] * 1.0)), False),  # computed in the program: a constant
    }


@pytest.mark.parametrize("spelling", list(_spellings()))
def test_attention_patterns_match_and_equal_jax_jit(spelling):
    """Rewritten programs against the same program in float32 (the kernels' math: a program that
    computes its softmax in bf16 is itself further from it than the kernel)."""
    f, gqa = _spellings()[spelling]
    q, k, v, do = make(1, 20, 20, 4, 2 if gqa else 4, 16, jnp.bfloat16, seed=8)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    report = xkern.explain(f)(q, k, v)
    assert [m.pattern for m in report.matches] == [f"attention/{spelling}"]
    close(xkern.jit(f)(q, k, v), jax.jit(f)(*f32), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(f), (0, 1, 2)))(*f32)
    for g, w in zip(got, want):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("spelling", ["jax.nn.dot_product_attention(causal)+mask[b,1,q,k]",
                                      "jax.nn.dot_product_attention+mask[b,1,q,k], one k/v head per q head",
                                      "jax.nn.dot_product_attention+bias+mask[b,h,q,k]",
                                      "flax.linen.dot_product_attention+mask[1,1,q,k]",
                                      "by hand + finfo.min bias[b,1,q,k]",
                                      "jax.nn.dot_product_attention+finfo.min bias[b,h,q,k]"])
def test_masked_spellings_average_rows_that_see_no_key(spelling):
    """jax.nn and flax fill hidden scores with a large negative number, and HF ports add a bias of
    finfo.min: a query whose keys are all masked gets the mean of the values, and so does its
    replacement (masked_rows="average")."""
    import flax.linen as nn

    rng = np.random.default_rng(11)
    gqa = spelling.startswith("jax.nn") and "one k/v head" not in spelling
    q, k, v, do = make(2, 20, 20, 4, 2 if gqa else 4, 16, jnp.bfloat16, seed=12)
    shape = {"[b,1,q,k]": (2, 1, 20, 20), "[b,h,q,k]": (2, 4, 20, 20), "[1,1,q,k]": (1, 1, 20, 20)}[
        spelling[spelling.index("["):spelling.index("]") + 1]]
    mask = jnp.asarray(rng.random(shape) > 0.3).at[0, 0, 5].set(False)  # query 5 sees no key
    bias = jnp.asarray(rng.standard_normal((1, 4, 20, 20)), jnp.float32)
    hidden_min = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)
    f = {"jax.nn.dot_product_attention(causal)+mask[b,1,q,k]":
         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True),
         "jax.nn.dot_product_attention+mask[b,1,q,k], one k/v head per q head":
         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask),
         "jax.nn.dot_product_attention+bias+mask[b,h,q,k]":
         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask),
         "flax.linen.dot_product_attention+mask[1,1,q,k]":
         lambda q, k, v: nn.dot_product_attention(q, k, v, mask=mask),
         "by hand + finfo.min bias[b,1,q,k]": lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(
             jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25 + hidden_min, -1).astype(q.dtype), v),
         "jax.nn.dot_product_attention+finfo.min bias[b,h,q,k]":
         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=hidden_min)}[spelling]
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    # (a mask broadcast from [1, 1] and from [b, 1] trace alike: either template may take it)
    [match] = [m for m in xkern.explain(f)(q, k, v).matches if m.op == "attention"]
    assert match.pattern.startswith("attention/" + ("" if "finfo" in spelling else spelling.split("[")[0]))
    got = xkern.jit(f)(q, k, v)
    assert np.abs(np.asarray(got[0, 5], np.float32)).max() > 0  # averaged, not zeros
    close(got, jax.jit(f)(*f32), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v), jax.grad(loss, (0, 1, 2))(*f32)):
        close(g, w, jnp.bfloat16)



@pytest.mark.parametrize("dtype, fill", [(jnp.float32, -np.inf), (jnp.float16, -1e9)], ids=["-inf", "float16 -1e9"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (the program's own -1e9 in float16)
def test_rows_a_minus_inf_fill_hides_are_nan_as_under_jax_jit(dtype, fill):
    """where(mask, s, -inf) by hand (or -1e9 in float16 scores, which rounds to -inf): XLA's softmax
    of a row whose keys are all hidden is NaN, and its NaN weights reach dv at every key of that
    batch entry and k/v head, while dq and dk stay finite (the where passes them nothing). The
    replacement gives the same NaNs (masked_rows="nan"), not the zeros of a flash kernel; GQA by
    jnp.repeat, and the NaN rows' cotangents zeroed by the loss, as a masked loss would."""
    q, k, v, do = make(2, 6, 7, 4, 2, 16, dtype, seed=21)
    mask = jnp.asarray(np.random.default_rng(22).random((2, 1, 6, 7)) > 0.3).at[0, 0, 2].set(False)

    def f(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25, fill)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    assert [m.pattern for m in xkern.explain(f)(q, k, v).matches if m.op == "attention"]
    got, want = np.asarray(xkern.jit(f)(q, k, v), np.float32), np.asarray(jax.jit(f)(q, k, v), np.float32)
    assert np.isnan(want[0, 2]).all() and np.isnan(want).sum() == want[0, 2].size  # (the case is what it says)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    close(np.nan_to_num(got), np.nan_to_num(want), dtype)
    loss = lambda q, k, v: jnp.sum(jnp.nan_to_num(f(q, k, v).astype(jnp.float32)) * do.astype(jnp.float32))
    grads = zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
    for name, (g, w) in zip("qkv", grads):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isnan(w).any() == (name == "v"), name
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        close(np.nan_to_num(g), np.nan_to_num(w), dtype)
    ops = attention(q, k, v, mask=mask, masked_rows="nan", scale=0.25)
    np.testing.assert_array_equal(np.isnan(np.asarray(ops, np.float32)), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(np.asarray(reference(q, k, v, mask=mask, masked_rows="nan", scale=0.25),
                                                      np.float32)), np.isnan(want))


def _alphafold3_attention(q, k, v, mask, pair_logits, mask_q=None):
    """AlphaFold 3's attention (diffusion_transformer.self_attention and cross_attention, their
    projections and gate left out): q and k cast to float32, q scaled, a padding bias 1e9 * (mask - 1)
    from its mask (data) over the keys [..., 1, 1, k] (with mask_q, cross_attention's 1e9 * (mask_q -
    1) * (mask - 1) [..., 1, q, k]: +1e9 where a padded query meets a padded key), then the pair
    logits [..., h, q, k], a float32 softmax cast back to v's dtype; einsums over '...': one example
    [tokens, h, c] or a batch."""
    bias = (1e9 * (mask - 1.0))[..., None, None, :].astype(jnp.float32)
    if mask_q is not None:
        bias = 1e9 * (mask_q - 1.0)[..., None, :, None] * (mask - 1.0)[..., None, None, :]
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    logits = jnp.einsum("...qhc,...khc->...hqk", q * q.shape[-1] ** -0.5, k) + bias
    if pair_logits is not None:
        logits += pair_logits
    weights = jnp.asarray(jax.nn.softmax(logits, axis=-1), dtype=v.dtype)
    return jnp.einsum("...hqk,...khc->...qhc", weights, v)


@pytest.mark.parametrize("case", ["one example, bf16 pair logits", "samples mapped by vmap, pair logits shared",
                                  "no pair logits, a batch of batches", "atom cross-attention over subsets"])
def test_alphafold3_attention_is_found(case):
    """AlphaFold 3's attention of one example ([tokens, h, c], no batch dim), as its pairformer and
    diffusion transformer call it; mapped over samples by jax.vmap with the pair logits (float32)
    shared by them; with no pair logits over a batch of batches; its atom cross-attention (8 queries
    against 24 keys in each subset, +1e9 where a padded query meets a padded key, rows XLA weights
    uniformly over the padded keys). The kernels take the padding bias per key (HAS_BIAS 2) and the
    pair logits as the tile bias (1), the batch dims made one. Values and the gradients of q, k and v
    against jax.jit's in float32, keys padded (all but 3 in one example)."""
    s, h, c = 21, 2, 16
    rng = np.random.default_rng(61)
    batch = {"one": (), "samples": (2,), "no": (2, 3), "atom": (3,)}[case.split()[0]]
    q, k, v, do = (jnp.asarray(rng.standard_normal((*batch, s, h, c)), jnp.bfloat16) for _ in range(4))
    if case.startswith("atom"):  # (subsets of 8 queries, 24 keys; the split-key forward)
        q, do, mask_q = q[:, :8], do[:, :8], jnp.asarray(rng.random((3, 8)) > 0.3, jnp.float32)
    mask = np.ones((*batch, s), np.float32)
    mask[..., 17:] = 0
    if batch:
        mask.reshape(-1, s)[-1, 3:] = 0
    pair = jnp.asarray(rng.standard_normal((h, s, s)), jnp.bfloat16 if case.startswith("one") else jnp.float32)
    f = lambda q, k, v, mask: _alphafold3_attention(q, k, v, mask, None if case.startswith("no") else pair)
    if case.startswith("samples"):  # (each sample's own mask; the pair logits unmapped)
        f = lambda q, k, v, mask: jax.vmap(lambda *a: _alphafold3_attention(*a, pair))(q, k, v, mask)
    if case.startswith("atom"):  # (the pair logits per subset)
        pair = jnp.asarray(rng.standard_normal((3, h, 8, s)), jnp.float32)
        f = lambda q, k, v, mask: _alphafold3_attention(q, k, v, mask, pair, mask_q)
    mask = jnp.asarray(mask)  # (data, as AlphaFold's: a bias of any value, read per key)
    [match] = xkern.explain(f)(q, k, v, mask).matches[:1]
    assert match.pattern.startswith("attention/") and "float32 q, k, scaled q" in match.pattern
    if not case.startswith("atom"):
        assert [c["HAS_BIAS"] for c in _constexprs(f, q, k, v, mask)] == [2 if case.startswith("no") else 3]
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v, mask), jax.jit(f)(*f32, mask), jnp.bfloat16)
    loss = lambda q, k, v, mask: jnp.sum(f(q, k, v, mask).astype(jnp.float32) * do.astype(jnp.float32))
    for got, want in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v, mask),
                         jax.jit(jax.grad(loss, (0, 1, 2)))(*f32, mask)):
        close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("form", ["one example, by hand", "[b, h, s, d] in a batch of batches, causal",
                                  "flax, a batch of batches, a mask per outer entry",
                                  "flax, dropout, a bias per outer entry and head",
                                  "k, v repeated, a padding bias per entry"])
def test_attention_of_any_batch_rank_is_found(form):
    """Attention over one example (q, k, v [s, h, d]) or a batch of batches ([b1, b2, s, h, d]: a
    model mapped by jax.vmap twice, flax's and AlphaFold's '...' einsums) as by hand at 4-D, causal,
    with a mask or bias broadcast over some of the batch dims, and k/v heads repeated by jnp.repeat
    (read once, as GQA): the kernels take the batch dims made one. Values and gradients as jax.jit's
    in float32."""
    import flax.linen as nn

    s, h, d = 19, 4, 16
    rng = np.random.default_rng(62)
    batch = () if form.startswith("one") else (2, 3)
    q, do = (jnp.asarray(rng.standard_normal((*batch, s, h, d)), jnp.bfloat16) for _ in range(2))
    kv_heads = 2 if form.startswith("k, v repeated") else h
    k, v = (jnp.asarray(rng.standard_normal((*batch, s, kv_heads, d)), jnp.bfloat16) for _ in range(2))
    padded = jnp.asarray(np.arange(s) < np.array([s, 7])[:, None])  # [2, s]: an outer entry's keys
    if form.startswith("one"):
        f = lambda q, k, v: jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(
            jnp.einsum("...qhd,...khd->...hqk", q, k) * 0.25), v)
    elif form.startswith("[b, h, s, d]"):
        def f(q, k, v):
            q, k, v = (jnp.swapaxes(a, -3, -2) for a in (q, k, v))
            scores = jnp.einsum("...hqd,...hkd->...hqk", q, k) / 4.0
            p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf), axis=-1)
            return jnp.swapaxes(jnp.einsum("...hqk,...hkd->...hqd", p, v), -3, -2)
    elif form.startswith("flax, dropout"):  # (the bias and the dropout multiplier made one batch dim too)
        bias = jnp.asarray(rng.standard_normal((2, 1, h, s, s)), jnp.bfloat16)
        f = lambda q, k, v: nn.dot_product_attention(q, k, v, bias=bias, dropout_rng=jax.random.key(1),
                                                     dropout_rate=0.2, deterministic=False)
    elif form.startswith("flax"):
        f = lambda q, k, v: nn.dot_product_attention(q, k, v, mask=padded[:, None, None, None, :])
    else:
        def f(q, k, v):
            k, v = jnp.repeat(k, 2, axis=-2), jnp.repeat(v, 2, axis=-2)
            bias = jnp.where(padded, 0.0, -1e9)[:, None, None, None, :]
            return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(
                jnp.einsum("...qhd,...khd->...hqk", q * 0.25, k) + bias), v)
    match = xkern.explain(f)(q, k, v).matches[0]
    assert match.pattern.startswith("attention/")
    [consts] = _constexprs(f, q, k, v)
    assert consts["KV_HEADS"] == kv_heads and consts["CAUSAL"] == form.endswith("causal")
    _equals_jax_jit_in_float32(f, q, k, v, do)


def test_flax_attention_over_a_batch_of_frames_is_found():
    """flax.linen.MultiHeadDotProductAttention over [batch, frames, tokens, features] (a video
    transformer's attention within each frame, two batch dims): taken, as jax.jit's in values and
    in the gradients of its parameters."""
    import flax.linen as nn

    modules = {dtype: nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, dtype=dtype)
               for dtype in (jnp.bfloat16, jnp.float32)}
    x = jnp.asarray(np.random.default_rng(63).standard_normal((2, 3, 10, 16)), jnp.bfloat16)
    params = modules[jnp.bfloat16].init(jax.random.key(0), x)
    f = lambda dtype: (lambda p, x: modules[dtype].apply(p, x.astype(dtype)))
    report = xkern.explain(f(jnp.bfloat16))(params, x)
    assert [r.pattern for r in report.matches] == ["attention/flax.linen.dot_product_attention"]
    close(xkern.jit(f(jnp.bfloat16))(params, x), jax.jit(f(jnp.float32))(params, x), jnp.bfloat16)
    # (the key projection's bias has no gradient, softmax being blind to a shift of a row: its bf16
    # gradient is rounding noise, in jax.jit's as in ours, so each is held to XLA's error or bf16's)
    loss = lambda dtype: (lambda p: jnp.sum(jnp.sin(f(dtype)(p, x).astype(jnp.float32))))
    grads = [jax.tree.leaves(jax.jit(jax.grad(fn))(params))
             for fn in (xkern.optimize(loss(jnp.bfloat16)), loss(jnp.bfloat16), loss(jnp.float32))]
    for got, xla, want in zip(*grads):
        error = lambda g: float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(want, np.float64))))
        assert error(got) <= max(error(xla), TOL[jnp.bfloat16] * max(float(np.abs(want).max()), 1.0))


def _constexprs(f, *args) -> list[dict]:
    """The constexprs of each attention forward launch in xkern.optimize(f)'s program."""
    from jax.extend.core import jaxprs_in_params

    from xkern.kernels.launch import xkern_kernel_p

    def launches(jaxpr):
        for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            if e.primitive is xkern_kernel_p and e.params["kernel"] == "attention_fwd":
                yield dict(e.params["constexprs"])
            for sub in jaxprs_in_params(e.params):
                yield from launches(sub)
    return list(launches(jax.make_jaxpr(xkern.optimize(f))(*args)))


def _launch_flags(f, *args) -> list[dict]:
    """CAUSAL / HAS_MASK of each attention forward launch in xkern.optimize(f)'s program."""
    return [{n: c[n] for n in ("CAUSAL", "HAS_MASK")} for c in _constexprs(f, *args)]


def test_constant_causal_masks_take_the_causal_kernels():
    """A mask the program computes from constants is read when planning: Flax's make_causal_mask
    (and a tril mask closed over) runs as causal=True, an all-true one as no mask, other constant
    masks as masks; values and gradients equal jax.jit's."""
    import flax.linen as nn

    q, k, v, do = make(2, 24, 24, 4, 4, 16, jnp.bfloat16, seed=16)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    doc = np.arange(24) // 8
    causal, plain, masked = ({"CAUSAL": c, "HAS_MASK": m} for c, m in ((True, False), (False, False), (False, True)))
    programs = {  # name: (program, expected mask_kind, expected launch flags)
        "flax causal": (lambda q, k, v: nn.dot_product_attention(
            q, k, v, mask=nn.make_causal_mask(jnp.ones(q.shape[:2]))), "causal", causal),
        "tril constant": (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=jnp.tril(jnp.ones((24, 24), bool))[None, None]), "causal", causal),
        "all true": (lambda q, k, v: nn.dot_product_attention(q, k, v, mask=jnp.ones((2, 1, 24, 24), bool)),
                     "none", plain),
        "documents": (lambda q, k, v: nn.dot_product_attention(
            q, k, v, mask=jnp.asarray(doc[:, None] == doc[None, :])[None, None]), None, masked),
        # a key padding mask shared by the batch, broadcast over the queries: no band (its one row
        # of queries stands for all 24; read as a window, query i would see keys i ... i + 19)
        "key padding [1,1,1,k]": (lambda q, k, v: nn.dot_product_attention(
            q, k, v, mask=(jnp.arange(24) < 20)[None, None, None, :]), None, masked),
    }
    attention_match = lambda report: [m for m in report.matches if m.op == "attention"]
    for name, (f, kind, flags) in programs.items():
        report = xkern.explain(f)(q, k, v)
        [match] = attention_match(report)
        assert match.params.get("mask_kind") == kind, name
        if kind:  # the mask's own equations are dead: no generated kernel computes it
            assert report.matches == [match], name
        assert _launch_flags(f, q, k, v) == [flags], name
        close(xkern.jit(f)(q, k, v), jax.jit(f)(*f32), jnp.bfloat16)
        if kind != "causal":  # (the other kinds' kernels have their own gradient tests)
            continue
        loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
        for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(*f32)):
            close(g, w, jnp.bfloat16)
    # A mask from the program's inputs is never evaluated when planning; nor, in a step that
    # differentiates, one the differentiated function closes over (a tracer of the outer program)
    [match] = attention_match(xkern.explain(lambda q, k, v, m: nn.dot_product_attention(q, k, v, mask=m))(
        q, k, v, jnp.ones((2, 1, 24, 24), bool)))
    assert "mask_kind" not in match.params
    loss = lambda q, k, v, m: jnp.sum(nn.dot_product_attention(q, k, v, mask=m).astype(jnp.float32) * do)
    documents = jnp.asarray(doc[:, None] == doc[None, :])[None, None]
    for g, w in zip(xkern.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, documents),
                    jax.jit(jax.grad(loss, (0, 1, 2)))(*f32, documents)):
        close(g, w, jnp.bfloat16)


def test_llama_ports_scaled_by_a_division_and_masked_by_a_finite_fill():
    """As Llama ports write it: scores divided by sqrt(head dim) (math's, or jnp's in q's dtype),
    a tril mask applied with finfo.min: found, read as causal, values as jax.jit's."""
    import math
    q, k, v, _ = make(2, 16, 16, 4, 4, 16, jnp.float32, seed=21)
    causal = jnp.tril(jnp.ones((16, 16), bool))
    for divide in (lambda s: s / math.sqrt(16), lambda s: s / jnp.sqrt(16).astype(jnp.float32)):
        f = lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(
            causal, divide(jnp.einsum("bqhd,bkhd->bhqk", q, k)), jnp.finfo(jnp.float32).min), -1), v)
        [match] = [m for m in xkern.explain(f)(q, k, v).matches if m.op == "attention"]
        assert match.params.get("mask_kind") == "causal"
        close(xkern.jit(f)(q, k, v), jax.jit(f)(q, k, v), jnp.float32)


def test_a_mask_and_scale_shared_by_every_layer_are_found_in_each():
    """Flax layers each make the same causal mask and scale (sqrt of the head dim): canonicalization
    computes them once, so every layer's attention pattern reads the same mask conversion and sqrt.
    Those are shared, not escapes: each layer's attention is found (it was declined from the second
    layer on), and the model equals jax.jit's, gradients included."""
    import flax.linen as nn

    class Layers(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x, x, mask=nn.make_causal_mask(x[..., 0]))
            return x
    x = jnp.asarray(np.random.default_rng(21).standard_normal((2, 20, 32)), jnp.float32)
    params = Layers().init(jax.random.key(0), x)
    f = lambda p, x: Layers().apply(p, x)
    report = xkern.explain(f)(params, x)
    attention_matches = [m for m in report.matches if m.op == "attention"]
    assert len(attention_matches) == 3 and not [d for d in report.declined if d.pattern.startswith("attention")]
    assert kernel_names(jax.make_jaxpr(xkern.optimize(f))(params, x)).count("attention_fwd") == 3
    close(xkern.jit(f)(params, x), jax.jit(f)(params, x), jnp.float32)
    loss = lambda f: (lambda p, x: jnp.sum(f(p, x) ** 2))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1)))(params, x)
    want = jax.tree.leaves(jax.jit(jax.grad(loss(f), (0, 1)))(params, x))
    scale = max(float(np.abs(w).max()) for w in want)  # the key bias's gradient is 0 up to rounding
    for g, w in zip(jax.tree.leaves(got), want):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * scale)


def test_jax_nn_key_padding_mask_without_grouped_heads():
    # [b,1,1,k], the usual padding mask, with as many k/v heads as q heads (jax.nn then traces one
    # broadcast fewer than with grouped heads): found, and equal to jax.jit's, gradients included.
    q, k, v, do = make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=15)
    mask = jnp.asarray(np.arange(20)[None, None, None, :] < np.array([13, 20])[:, None, None, None])
    f = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)
    [match] = xkern.explain(f)(q, k, v, mask).matches
    assert match.pattern.startswith("attention/jax.nn.dot_product_attention+mask")
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v, mask), jax.jit(f)(*f32, mask), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v, m: jnp.sum(f(q, k, v, m).astype(jnp.float32) * do.astype(jnp.float32)))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v, mask)
    for g, w in zip(got, jax.jit(jax.grad(loss(f), (0, 1, 2)))(*f32, mask)):
        close(g, w, jnp.bfloat16)


def test_jax_nn_with_a_padding_bias_made_in_the_program_is_found():
    # jnp.where(mask, 0., -1e9) is weakly typed (Python numbers): jax.nn casts it to float32 before
    # adding it, a cast the canonical form drops, so the bias templates meet it.
    q, k, v, do = make(2, 12, 12, 4, 2, 16, jnp.bfloat16, seed=17)

    def f(q, k, v, lengths):
        bias = jnp.where(jnp.arange(12)[None, :] < lengths[:, None], 0.0, -1e9)[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, bias=bias)
    lengths = jnp.array([7, 12])
    [match] = [m for m in xkern.explain(f)(q, k, v, lengths).matches if m.pattern.startswith("attention")]
    assert match.pattern.startswith("attention/jax.nn.dot_product_attention+bias")
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v, lengths), jax.jit(f)(*f32, lengths), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v, lengths).astype(jnp.float32) * do.astype(jnp.float32)))
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v),
                    jax.jit(jax.grad(loss(f), (0, 1, 2)))(*f32)):
        close(g, w, jnp.bfloat16)


def _by_hand_masked(layout, fill, mask=None, bias=None, upcast=True):
    """A hand-written attention with a boolean mask applied by `where` (fill) or an additive bias."""
    qk, pv = {"bshd": ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"), "bhsd": ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd")}[layout]

    def f(q, k, v):
        scores = jnp.einsum(qk, q, k) * 0.25
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = jnp.where(mask, scores, fill)
        probs = jax.nn.softmax(scores.astype(jnp.float32) if upcast else scores, axis=-1).astype(q.dtype)
        return jnp.einsum(pv, probs, v)
    return f


@pytest.mark.parametrize("layout, form", [("bshd", "key padding, -1e9"), ("bhsd", "per head, finfo.min"),
                                          ("bshd", "key padding, -inf"), ("bhsd", "additive padding bias"),
                                          ("bshd", "bias per head")])
def test_hand_written_masks_and_biases_are_found(layout, form):
    rng = np.random.default_rng(15)
    lengths = np.array([20, 13])
    padding = jnp.asarray(np.arange(20)[None, :] < lengths[:, None])[:, None, None, :]  # [b, 1, 1, k]
    per_head = jnp.asarray(rng.random((2, 4, 20, 20)) > 0.3).at[1, 2, 7].set(False)  # a query sees no key
    kind, fill, mask, bias = {
        "key padding, -1e9": ("mask", -1e9, padding, None),
        "per head, finfo.min": ("mask", float(jnp.finfo(jnp.bfloat16).min), per_head, None),
        "key padding, -inf": ("mask", -jnp.inf, padding, None),
        "additive padding bias": ("bias", None, None, jnp.where(padding, 0.0, -1e9).astype(jnp.bfloat16)),
        "bias per head": ("float32 bias", None, None, jnp.asarray(rng.standard_normal((2, 4, 20, 20)), jnp.float32)),
    }[form]
    f = _by_hand_masked(layout, fill, mask, bias)
    shape = (2, 20, 20, 4, 4, 16)
    q, k, v, do = make(*shape, jnp.bfloat16, seed=16)
    if layout == "bhsd":
        q, k, v, do = (a.transpose(0, 2, 1, 3) for a in (q, k, v, do))
    [match] = xkern.explain(f)(q, k, v).matches
    # (a same-shape bias or mask may also be taken by the broadcast form's template: the exact
    # re-trace at the program's shapes makes either correct)
    assert match.pattern.startswith(f"attention/einsum[{layout}]+{kind}")
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    got, want = xkern.jit(f)(q, k, v), jax.jit(f)(*f32)
    if form == "per head, finfo.min":  # the query that sees no key averages every value, as XLA's
        assert np.abs(np.asarray(got[1, 2, 7] if layout == "bhsd" else got[1, 7, 2], np.float32)).max() > 0
    close(got, want, jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)))
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v), jax.grad(loss(f), (0, 1, 2))(*f32)):
        close(g, w, jnp.bfloat16)


def _t5_attention(scores_in: str):
    """T5's (t5x's layers.dot_product_attention): unscaled scores (T5 folds 1/sqrt(d) into q's
    initialization) plus a learned relative-position bias per head [1, h, q, k] (its gradient
    wanted) and a padding bias, softmax in float32, cast back. scores_in: "q's dtype", "float32"
    (the product cast) or "float32 q, k" (t5x's float32_logits: q and k cast before the product)."""
    def f(q, k, v, table, padding):
        sq, sk, heads = q.shape[1], k.shape[1], q.shape[2]
        buckets = jnp.clip(jnp.arange(sk)[None, :] - jnp.arange(sq)[:, None], -4, 4) + 4
        bias = table[buckets].transpose(2, 0, 1)[None] + jnp.where(padding, 0.0, -1e10)[:, None, None, :]
        if scores_in == "float32 q, k":
            q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q32, k32)
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        scores = scores.astype(jnp.float32) if scores_in == "float32" else scores
        probs = jax.nn.softmax(scores + bias.astype(scores.dtype)).astype(q.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return f


@pytest.mark.parametrize("scores_in", ["q's dtype", "float32", "float32 q, k"])
def test_t5_attention_unscaled_with_a_learned_bias_is_found(scores_in):
    """Unscaled scores, with or without a bias, were left to XLA (explain: "written in no spelling
    the attention patterns take"); now the kernels run with scale 1, and the bias's gradient (the
    relative-position table's) is jax.jit's."""
    q, k, v, do = make(2, 12, 12, 4, 4, 16, jnp.bfloat16, seed=41)
    table = jnp.asarray(np.random.default_rng(42).standard_normal((9, 4)), jnp.float32)
    padding = jnp.asarray(np.arange(12)[None, :] < np.array([12, 7])[:, None])
    f = _t5_attention(scores_in)
    [match] = [m for m in xkern.explain(f)(q, k, v, table, padding).matches if m.op == "attention"]
    assert match.pattern.startswith("attention/einsum[bshd](unscaled)+") and "bias" in match.pattern
    assert ("+float32 q, k" in match.pattern) == (scores_in == "float32 q, k")  # (the kernels read q, k in bf16)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v, table, padding), jax.jit(f)(*f32, table, padding), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v, t: jnp.sum(f(q, k, v, t, padding).astype(jnp.float32) * do.astype(jnp.float32)))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2, 3)))(q, k, v, table)
    for g, w in zip(got, jax.jit(jax.grad(loss(f), (0, 1, 2, 3)))(*f32, table)):
        close(g, w, jnp.bfloat16)
    # without a bias, unscaled: scale 1
    unscaled = lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k)), v)
    [match] = xkern.explain(unscaled)(q, k, v).matches
    assert match.pattern == "attention/einsum[bshd](unscaled)"
    close(xkern.jit(unscaled)(q, k, v), jax.jit(unscaled)(*f32), jnp.bfloat16)


def _equals_jax_jit_in_float32(f, q, k, v, do):
    """xkern.jit(f) and the gradients of q, k, v through xkern.optimize (bf16) against jax.jit's in
    float32."""
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v), jax.jit(f)(*f32), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)))
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v), jax.grad(loss(f), (0, 1, 2))(*f32)):
        assert g.shape == w.shape
        close(g, w, jnp.bfloat16)


def test_attention_written_with_matmuls_is_found():
    """nanoGPT's spelling: q @ k.swapaxes(-2, -1) times 1 / sqrt(d), a causal tril applied with a
    -inf where, softmax, @ v ([b, h, s, d] arrays). The swap is folded into the product
    (canonicalize), so the einsum templates take it: causal kernels, jax.jit's values and gradients."""
    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=43))

    def f(q, k, v):
        att = (q @ k.swapaxes(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = jnp.where(jnp.tril(jnp.ones((20, 20)))[None, None] == 1, att, -jnp.inf)
        return jax.nn.softmax(att, axis=-1) @ v
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum[bhsd]") and match.params.get("mask_kind") == "causal"
    _equals_jax_jit_in_float32(f, q, k, v, do)


@pytest.mark.parametrize("upcast", [False, True])
def test_attention_with_a_softmax_written_by_hand_is_found(upcast):
    """exp(s - max(s)) / sum(...) written out (in float32 or not) rather than jax.nn.softmax:
    canonicalize spells it as jax.nn.softmax does, so the attention templates take it; jax.jit's
    values and gradients (the maximum's gradient, stopped there, is zero in exact arithmetic)."""
    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=46))

    def f(q, k, v):
        att = (q @ k.swapaxes(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = jnp.where(jnp.tril(jnp.ones((20, 20), bool)), att, -jnp.inf)
        att = att.astype(jnp.float32) if upcast else att
        e = jnp.exp(att - jnp.max(att, axis=-1, keepdims=True))
        return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(q.dtype) @ v
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum[bhsd]+causal")
    _equals_jax_jit_in_float32(f, q, k, v, do)


@pytest.mark.parametrize("form", ["nanoGPT's causal tril == 0", "padding hidden, -1e9"])
def test_masks_of_the_hidden_keys_are_found(form):
    """where(hidden, fill, scores), the mask marking the keys hidden (nanoGPT's
    `jnp.where(mask[:, :, :T, :T] == 0, float('-inf'), att)` of a float tril; a padding mask
    negated): the kernels get the keys seen (a constant one read as causal)."""
    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=44))
    padding = jnp.asarray(np.arange(20)[None, :] < np.array([20, 11])[:, None])[:, None, None, :]

    def f(q, k, v):
        att = (q @ k.swapaxes(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        if form.startswith("nanoGPT"):
            tril = jnp.tril(jnp.ones((32, 32))).reshape(1, 1, 32, 32)
            att = jnp.where(tril[:, :, :20, :20] == 0, float("-inf"), att)
        else:
            att = jnp.where(~padding, -1e9, att)
        return jax.nn.softmax(att, axis=-1) @ v
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum[bhsd]+hidden mask")
    assert (match.params.get("mask_kind") == "causal") == form.startswith("nanoGPT")
    _equals_jax_jit_in_float32(f, q, k, v, do)


def test_alibi_a_constant_bias_with_a_causal_mask_is_found():
    """ALiBi: a bias of each head's slope times the key's distance (a constant [1, h, q, k]) after
    the scale, then a causal -inf where: the bias and causal kernels, jax.jit's values and gradients."""
    q, k, v, do = make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=45)
    slopes = jnp.asarray([2 ** (-8 * (i + 1) / 4) for i in range(4)], jnp.float32)

    def f(q, k, v):
        bias = slopes[:, None, None] * (jnp.arange(20)[None, :] - jnp.arange(20)[:, None])[None].astype(jnp.float32)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(16) + bias[None]
        scores = jnp.where(jnp.tril(jnp.ones((20, 20), bool)), scores, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v)
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum[bshd]/divisor+causal+float32 bias")
    _equals_jax_jit_in_float32(f, q, k, v, do)


@pytest.mark.parametrize("form", ["a course's mask: - 1e6 * triu(ones, 1)", "ALiBi: - slope * distance, causal",
                                  "a learned bias, subtracted"])
def test_a_subtracted_bias_is_found(form):
    """scores - bias, the bias subtracted rather than added: a mask as some courses write it (bf16,
    unscaled), ALiBi's negative distances, a learned bias (its gradient too, by XLA): the bias kernels
    with the bias negated, jax.jit's values and gradients."""
    q, k, v, do = make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=47)
    learned = jnp.asarray(np.random.default_rng(47).normal(size=(1, 4, 20, 20)), jnp.float32)

    def f(q, k, v, learned):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if form.startswith("a course"):
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores - 1e6 * jnp.triu(jnp.ones((20, 20), q.dtype), 1)), v)
        slopes = jnp.asarray([2 ** (-8 * (i + 1) / 4) for i in range(4)], jnp.float32)
        distance = jnp.abs(jnp.arange(20)[None, :] - jnp.arange(20)[:, None]).astype(jnp.float32)
        bias = (slopes[:, None, None] * distance)[None] if form.startswith("ALiBi") else learned
        scores = scores / math.sqrt(16) - bias
        if form.startswith("ALiBi"):
            scores = jnp.where(jnp.tril(jnp.ones((20, 20), bool)), scores, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v)
    [match] = xkern.explain(f)(q, k, v, learned).matches
    assert match.pattern.startswith("attention/einsum[bshd]") and ("-bias" in match.pattern or "-float32 bias" in match.pattern)
    assert ("+causal" in match.pattern) == form.startswith("ALiBi")
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    close(xkern.jit(f)(q, k, v, learned), jax.jit(f)(*f32, learned), jnp.bfloat16)
    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * do.astype(jnp.float32)))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2, 3)))(q, k, v, learned)
    for g, w in zip(got, jax.grad(loss(f), (0, 1, 2, 3))(*f32, learned)):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("form", ["causal by tril, finite fill", "causal by triu, hidden", "unmasked, /sqrt(d)"])
def test_multi_query_attention_with_kv_of_no_heads_dim_is_found(form):
    """PaLM's multi-query attention: q [b, h, s, d] scaled, k and v [b, s, d] ("bhid,bjd->bhij"), a
    causal mask of the keys seen (filled with -finfo.max) or hidden (triu), softmax, "bhij,bjd->bhid":
    the kernels with one k/v head; jax.jit's values and gradients (dk, dv summed over the heads)."""
    q, k, v, do = make(2, 20, 20, 4, 1, 16, jnp.bfloat16, seed=48)
    q, do = q.transpose(0, 2, 1, 3), do.transpose(0, 2, 1, 3)
    k, v = k[:, :, 0], v[:, :, 0]

    def f(q, k, v):
        if form.startswith("unmasked"):
            sim = jnp.einsum("bhid,bjd->bhij", q, k) / jnp.sqrt(16).astype(q.dtype)
        else:
            sim = jnp.einsum("bhid,bjd->bhij", q * 16 ** -0.5, k)
        if "tril" in form:
            sim = jnp.where(jnp.tril(jnp.ones((20, 20), bool)), sim, -jnp.finfo(sim.dtype).max)
        elif "triu" in form:
            sim = jnp.where(jnp.triu(jnp.ones((20, 20), bool), 1), -jnp.finfo(sim.dtype).max, sim)
        return jnp.einsum("bhij,bjd->bhid", jax.nn.softmax(sim, axis=-1), v)
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum[bhsd,mqa]")
    assert (match.params.get("mask_kind") == "causal") != form.startswith("unmasked")
    _equals_jax_jit_in_float32(f, q, k, v, do)


@pytest.mark.parametrize("form", ["diffusers' einsums, cross-attention", "matmuls, float32 softmax, causal"])
def test_heads_folded_into_the_batch_are_found(form):
    """q, k, v [batch * heads, seq, d], as diffusers' Flax attention (Stable Diffusion's UNet) and
    code that folds the heads into the batch write it: each entry is a batch of one head for the
    kernels. Cross-attention (fewer keys than queries, not a tile's multiple) and a causal tril."""
    cross = form.startswith("diffusers")
    q, k, v, do = make(6, 13, 7 if cross else 13, 1, 1, 16, jnp.bfloat16, seed=52)
    q, k, v, do = (a[:, :, 0] for a in (q, k, v, do))

    def f(q, k, v):
        if cross:
            scores = jnp.einsum("b i d, b j d->b i j", q, k) * 16 ** -0.5
            return jnp.einsum("b i j, b j d -> b i d", jax.nn.softmax(scores, axis=-1), v)
        scores = q @ k.transpose(0, 2, 1) / jnp.sqrt(16).astype(q.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((13, 13), bool)), scores, -jnp.inf)
        return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype) @ v
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum[bsd]")
    assert ("+causal" in match.pattern) != cross
    _equals_jax_jit_in_float32(f, q, k, v, do)


@pytest.mark.parametrize("form", ["jnp.repeat, then [b, h, s, d] matmuls", "repeat_kv (broadcast, reshape)",
                                  "jnp.tile (not GQA's grouping)"])
def test_kv_heads_repeated_by_the_program_are_read_once(form):
    """GQA as ports write it: k and v repeated over the heads to q's count (jnp.repeat, as HF's Flax
    Llama/Mistral; repeat_kv's broadcast and reshape), then attention. The kernels read k and v
    unrepeated, as GQA, and the repeats are gone from the program; jnp.tile's order (head j is
    k's j % g) is not GQA's, and stays. jax.jit's values and gradients either way."""
    q, k, v, do = make(2, 16, 16, 4, 2, 16, jnp.bfloat16, seed=51)

    def repeat(x):
        if form.startswith("jnp.repeat"):
            return jnp.repeat(x, 2, axis=2)
        if form.startswith("jnp.tile"):
            return jnp.tile(x, (1, 1, 2, 1))
        b, s, g, d = x.shape
        return jnp.broadcast_to(x[:, :, :, None, :], (b, s, g, 2, d)).reshape(b, s, 2 * g, d)

    def f(q, k, v):
        k, v = repeat(k), repeat(v)
        if not form.startswith("jnp.repeat"):
            p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(16), axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        s = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), q @ k.swapaxes(-2, -1) / jnp.sqrt(16).astype(q.dtype),
                      jnp.finfo(q.dtype).min)
        return (jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype) @ v).transpose(0, 2, 1, 3)
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/")
    primitives = {e.primitive.name for e in jax.make_jaxpr(xkern.optimize(f))(q, k, v).jaxpr.eqns}
    assert bool(primitives & {"reshape", "broadcast_in_dim", "tile"}) == form.startswith("jnp.tile"), primitives
    _equals_jax_jit_in_float32(f, q, k, v, do)


def test_a_learned_bias_trained_runs_as_written():
    """Where a call differentiates the bias (T5's relative-position table), the kernels would add
    their work to XLA's recomputed scores (0.83x jax.jit on an H200): that call runs the program as
    written, and explain says why; decided where jax.grad is applied, inside the jitted function or
    around it. The forward alone, and gradients of q, k, v alone, keep the kernels; values and
    gradients are jax.jit's either way."""
    q, k, v, do = make(2, 12, 12, 4, 4, 16, jnp.bfloat16, seed=49)
    table = jnp.asarray(np.random.default_rng(49).standard_normal((9, 4)), jnp.float32)
    padding = jnp.asarray(np.arange(12)[None, :] < np.array([12, 7])[:, None])
    f = _t5_attention("float32")
    loss = lambda f: (lambda q, k, v, t: jnp.sum(f(q, k, v, t, padding).astype(jnp.float32) * do.astype(jnp.float32)))
    launched = lambda g, *a: {n for n in kernel_names(jax.make_jaxpr(g)(*a)) if n.startswith("attention")}
    assert launched(xkern.optimize(f), q, k, v, table, padding) == {"attention_fwd"}
    qkv, everything = (0, 1, 2), (0, 1, 2, 3)
    assert launched(jax.grad(xkern.optimize(loss(f)), qkv), q, k, v, table) >= {"attention_fwd", "attention_bwd_dkdv"}
    assert launched(jax.grad(xkern.optimize(loss(f)), everything), q, k, v, table) == set()
    assert launched(jax.vmap(jax.grad(xkern.optimize(loss(f)), everything), (0, None, None, None)),
                    q[None], k, v, table) == set()
    # ... decided where the gradient is taken, also around the jitted function
    assert launched(jax.grad(xkern.jit(loss(f)), everything), q, k, v, table) == set()
    assert launched(jax.grad(xkern.jit(loss(f)), qkv), q, k, v, table) >= {"attention_fwd", "attention_bwd_dkdv"}
    step = lambda argnums: (lambda q, k, v, t: jax.grad(loss(f), argnums)(q, k, v, t))  # (jax.grad inside)
    said = lambda argnums: [(d.pattern, d.reason) for d in xkern.explain(step(argnums))(q, k, v, table).declined
                            if d.pattern.startswith("attention/")]
    [(pattern, reason)] = said(everything)  # explain says so, where it is the call's
    assert "differentiates the bias" in reason and pattern.startswith("attention/einsum")
    assert said(qkv) == [] and any(m.pattern.startswith("attention/") for m in xkern.explain(step(qkv))(q, k, v, table).matches)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    for argnums in (qkv, everything):
        want = jax.jit(jax.grad(loss(f), argnums))(*f32, table)
        for got in (jax.jit(jax.grad(xkern.optimize(loss(f)), argnums))(q, k, v, table),
                    jax.grad(xkern.jit(loss(f)), argnums)(q, k, v, table)):
            for g, w in zip(got, want):
                close(g, w, jnp.bfloat16)


def _alphafold_attention(q, k, v, msa_mask, pair_bias):
    """AlphaFold 2's attention (modules.Attention, its projections left out): q scaled first, a
    padding bias 1e9 * (mask - 1) [b, 1, 1, k], then the pair representation's bias [h, q, k] per head."""
    q = q * q.shape[-1] ** -0.5
    bias = (1e9 * (msa_mask - 1.))[:, None, None, :]
    logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) + bias
    logits += jnp.expand_dims(pair_bias, axis=0)
    return jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(logits), v)


def _position_then_padding(q, k, v, table, padding):
    """By hand in [b, h, s, d]: unscaled scores, a relative-position bias [1, h, q, k] in q's dtype,
    then a padding bias [b, 1, 1, k], a float32 softmax."""
    s = q @ k.swapaxes(-2, -1) + table.astype(q.dtype)[None]
    s = (s + jnp.where(padding, 0.0, -1e9).astype(q.dtype)[:, None, None, :]).astype(jnp.float32)
    return jax.nn.softmax(s).astype(q.dtype) @ v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("extra", ["none", "soft cap", "dropout", "key lengths"])
def test_rows_a_far_bias_hides_get_the_gradients_of_uniform_weights(dtype, extra):
    """A bias of -1e9 on every key of a row (a padded batch entry, some query rows): XLA's scores
    there all round to -1e9, so its weights are uniform; the kernels' forward agrees, but the
    gradients they recomputed from a log-sum-exp of -1.44e9 were off by the count of keys (6x). They
    are now XLA's, for q, k, v and the bias, against the float32 reference, in every masked_rows mode
    (the row is not hidden by a mask: none of them applies), with GQA; rows that see a key are as
    before."""
    b, sq, sk, h, hk, d = 3, 9, 13, 4, 2, 16
    q, k, v, do = make(b, sq, sk, h, hk, d, dtype, seed=55)
    rng = np.random.default_rng(56)
    bias = rng.standard_normal((b, h, sq, sk)).astype(np.float32)
    bias[1] = -1e9  # a padded entry
    bias[2, :, 3:5] = -1e9 + bias[2, :, 3:5]  # two query rows of another (their own scores lost)
    kw = {"bias": jnp.asarray(bias)}
    if extra == "soft cap":
        kw["logits_soft_cap"] = 5.0
    elif extra == "dropout":
        kw["dropout_multiplier"] = jnp.asarray((rng.random((1, 1, sq, sk)) > 0.2) / 0.8, dtype)
    elif extra == "key lengths":
        kw["kv_lengths"] = jnp.asarray([13, 7, 10])
    for rows in ("zeros", "average"):
        _biased_as_the_reference(q, k, v, do, kw, rows, dtype)


def _biased_as_the_reference(q, k, v, do, kw, rows, dtype):
    """attention(q, k, v, **kw) (kw["bias"] given as an argument) and its q, k, v and bias gradients at
    do against the float32 reference's, in masked_rows mode `rows`."""
    run = lambda fn, args, **more: value_and_grads(lambda q, k, v, bias, **o: fn(q, k, v, bias=bias, **o),
                                                  (*args, kw["bias"]), more.pop("do"), **more)
    rest = {n: a for n, a in kw.items() if n != "bias"}
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    (out, grads), (want, wants) = (run(attention, (q, k, v), do=do, masked_rows=rows, **rest),
                                   run(reference, f32, do=do.astype(jnp.float32), masked_rows=rows, **rest))
    close(out, want, dtype)
    for g, w in zip(grads, wants):
        close(g, w, dtype)


@pytest.mark.parametrize("extra, dtype", [("none", jnp.float32), ("none", jnp.bfloat16), ("soft cap", jnp.bfloat16),
                                          ("dropout", jnp.bfloat16), ("key lengths", jnp.float32),
                                          ("a key bias", jnp.bfloat16)])
def test_rows_a_huge_positive_bias_lifts_get_xla_weights(extra, dtype):
    """A bias of +1e9 on some keys of a row (AlphaFold 3's cross-attention adds 1e9 * (mask_q - 1) *
    (mask_k - 1): +1e9 where a padded query meets a padded key): XLA's scores there keep no digit of
    the row's own, so its weights are uniform over those keys. The kernels' log-sum-exp kept no digit
    of their count: the split-key forward's merge and every gradient were off by it (errors of 1-40).
    Now values and the gradients of q, k, v and the bias are the float32 reference's, with GQA, for
    few queries (the split-key forward) and more (one pass), in both masked_rows modes."""
    b, sk, h, hk, d = 3, 40, 4, 2, 16
    rng = np.random.default_rng(57)
    for sq in (4, 24):
        q, k, v, do = make(b, sq, sk, h, hk, d, dtype, seed=58 + sq)
        padded_q, padded_k = rng.random((b, sq)) < 0.3, rng.random((b, sk)) < 0.3
        padded_q[0, 1] = padded_k[0, :7] = True
        lifted = 1e9 * (padded_q[:, :, None] & padded_k[:, None, :])
        bias = jnp.asarray(lifted[:, None] + rng.standard_normal((b, h, sq, sk)), jnp.float32)
        kw = {"bias": bias}
        if extra == "soft cap":
            kw["logits_soft_cap"] = 5.0
        elif extra == "dropout":
            kw["dropout_multiplier"] = jnp.asarray((rng.random((1, 1, sq, sk)) > 0.2) / 0.8, dtype)
        elif extra == "key lengths":
            kw["kv_lengths"] = jnp.asarray([sk, 23, 31])
        elif extra == "a key bias":  # +1e9 on some keys of entry 0 for every query: a [b, 1, 1, k] bias
            kw["bias"] = jnp.asarray(1e9 * padded_k[:, None, None, :] * (np.arange(b) == 0)[:, None, None, None],
                                     jnp.float32)
        for rows in ("zeros", "average") if extra == "none" else ("average",):
            _biased_as_the_reference(q, k, v, do, kw, rows, dtype)


def test_a_float32_bias_on_half_scores_gives_a_float32_result():
    """bf16 scores plus a float32 bias (AlphaFold's padding bias, its softmax left as it is) are
    float32, and so are the probabilities that weight v: the result is float32. The kernels returned
    it in bf16 (and a gradient through it failed to trace); now they store their float32 accumulator.
    Values and gradients against jax.jit's in float32."""
    def f(q, k, v, keys):
        bias = (1e4 * (keys - 1.0))[:, None, None, :]
        return jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(jnp.einsum("bqhc,bkhc->bhqk", q * 0.25, k) + bias), v)

    q, k, v, do = make(2, 11, 11, 2, 2, 16, jnp.bfloat16, seed=54)
    keys = jnp.asarray(np.arange(11)[None, :] < np.array([11, 5])[:, None], jnp.float32)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    out = xkern.jit(f)(q, k, v, keys)
    assert out.dtype == jax.jit(f)(q, k, v, keys).dtype == jnp.float32
    assert [m.op for m in xkern.explain(f)(q, k, v, keys).matches].count("attention") == 1
    close(out, jax.jit(f)(*f32, keys), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(f(q, k, v, keys) * do.astype(jnp.float32))
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v), jax.grad(loss, (0, 1, 2))(*f32)):
        assert g.dtype == jnp.bfloat16
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_biases_are_summed_for_the_kernels(dtype):
    """Two biases added one after the other (AlphaFold's padding and pair biases; a position bias,
    then padding) were left to XLA, the softmax alone fused: the kernels now take both (AlphaFold's
    padding bias, from a float mask given as data, is read per key: the same for every query), or
    the one bias and a mask where the other is a padding bias (a select of 0 and -1e9); the sum
    [b, h, q, k] is made in neither. Values
    and the gradients of q, k, v against jax.jit's in float32, a batch entry with every key padded
    (each of its queries averages every value, as XLA's -1e9 gives); a call that differentiates
    either bias runs as written (as one bias does); a third bias is no spelling the kernels take."""
    b, s, h, d = 3, 13, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, dtype, seed=52)
    rng = np.random.default_rng(53)
    keys = np.arange(s)[None, :] < np.array([s, 6, 0])[:, None]
    msa_mask, pair_bias = jnp.asarray(keys, jnp.float32), jnp.asarray(rng.standard_normal((h, s, s)), jnp.float32)
    launched = lambda g, *a: {n for n in kernel_names(jax.make_jaxpr(g)(*a)) if n.startswith("attention")}
    to_bhsd = lambda arrays: [a.transpose(0, 2, 1, 3) for a in arrays]
    for f, layout, extras in ((_alphafold_attention, "bshd", (msa_mask, pair_bias)),
                              (_position_then_padding, "bhsd", (pair_bias, jnp.asarray(keys)))):
        qkv, g = ((q, k, v), do) if layout == "bshd" else (to_bhsd((q, k, v)), do.transpose(0, 2, 1, 3))
        f32 = [a.astype(jnp.float32) for a in qkv]
        [match] = [m for m in xkern.explain(f)(*qkv, *extras).matches if m.op == "attention"]
        assert match.pattern.startswith(f"attention/einsum[{layout}](unscaled)+") and match.pattern.count("bias") == 2
        # a padding bias (a select of 0 and -1e9) is the kernels' mask, one of a float mask a key bias
        assert f"[{b},{h},{s},{s}]" not in str(jax.make_jaxpr(xkern.optimize(f))(*qkv, *extras))
        assert [c["HAS_BIAS"] for c in _constexprs(f, *qkv, *extras)] == [3 if f is _alphafold_attention else 1]
        close(xkern.jit(f)(*qkv, *extras), jax.jit(f)(*f32, *extras), dtype)
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * g.astype(jnp.float32))
        assert launched(jax.grad(xkern.optimize(loss), (0, 1, 2)), *qkv, *extras) >= {"attention_fwd", "attention_bwd_dkdv"}
        got = jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(*qkv, *extras)
        for g_, w in zip(got, jax.jit(jax.grad(loss, (0, 1, 2)))(*f32, *extras)):
            close(g_, w, dtype)
    # the pair bias differentiated (AlphaFold trains it): as written, jax.jit's gradients
    loss = lambda q, k, v, pair: jnp.sum(_alphafold_attention(q, k, v, msa_mask, pair).astype(jnp.float32))
    assert launched(jax.grad(xkern.optimize(loss), (0, 3)), q, k, v, pair_bias) == set()
    for g_, w in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 3)))(q, k, v, pair_bias),
                     jax.jit(jax.grad(loss, (0, 3)))(q, k, v, pair_bias)):
        close(g_, w, dtype)
    three = lambda q, k, v, pair: jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(
        jnp.einsum("bqhc,bkhc->bhqk", q, k) + pair + pair[:, ::-1] + pair.swapaxes(1, 2)), v)
    assert not [m for m in xkern.explain(three)(q, k, v, pair_bias).matches if m.op == "attention"]


def _t5x_attention(q, k, v, table, padding, fill=-1e10, position_first=False):
    """t5x's attention (T5.1.1, unscaled): the padding bias, a select between 0 and -1e10, added to the
    relative-position bias per head [1, h, q, k] (HF's Flax T5 adds them in the other order, with
    finfo.min), then the sum to the float32 scores."""
    padding_bias = jax.lax.select(padding, jnp.zeros(padding.shape), jnp.full(padding.shape, fill))[:, None, None, :]
    bias = table[None] + padding_bias if position_first else padding_bias + table[None]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_padding_bias_added_to_the_position_bias_runs_as_a_mask(dtype):
    """t5x adds its padding bias to the position bias, then the sum [b, h, q, k] to the scores: the
    kernels read that sum from memory (T5's training lost to jax.jit, 0.96x on an H100). They now
    read the two for it (Pattern.substitutes), the position bias as the bias and the padding as a
    mask; the sum is never made. Values and the gradients of q, k, v against jax.jit's in float32, a batch entry
    with every key padded (uniform weights, as XLA's); the table trained runs as written; a fill of
    -1e4 (BERT's) is a bias, the sum kept; a sum read elsewhere too is not split."""
    b, s, h, d = 3, 13, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, dtype, seed=61)
    table = jnp.asarray(np.random.default_rng(62).standard_normal((h, s, s)), jnp.float32)
    padding = jnp.asarray(np.arange(s)[None, :] < np.array([s, 6, 0])[:, None])
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    summed = f"f32[{b},{h},{s},{s}]"  # (a [b, h, q, k] bias in the compiled forward)
    compiled = lambda f: jax.jit(xkern.optimize(f)).lower(q, k, v, table).compile().as_text()
    for fill, position_first in ((-1e10, False), (float(jnp.finfo(jnp.float32).min), True)):
        f = lambda q, k, v, table: _t5x_attention(q, k, v, table, padding, fill, position_first)
        [match] = [m for m in xkern.explain(f)(q, k, v, table).matches if m.op == "attention"]
        assert match.params.get("bias_split"), match
        assert summed not in compiled(f)
        close(xkern.jit(f)(q, k, v, table), jax.jit(f)(*f32, table), dtype)
        loss = lambda q, k, v, table: jnp.sum(f(q, k, v, table).astype(jnp.float32) * do.astype(jnp.float32))
        for got, want in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v, table),
                             jax.jit(jax.grad(loss, (0, 1, 2)))(*f32, table)):
            close(got, want, dtype)
        for got, want in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 3)))(q, k, v, table),
                             jax.jit(jax.grad(loss, (0, 3)))(q, k, v, table)):  # (as written: jax.jit's own)
            close(got, want, dtype)
    some_keys = jnp.asarray(np.arange(s)[None, :] < np.array([s, 6, 1])[:, None])  # (-1e4 keeps a hidden row's
    bert = lambda q, k, v, table: _t5x_attention(q, k, v, table, some_keys, -1e4)  # scores, to float32's grid)
    assert summed in compiled(bert)
    close(xkern.jit(bert)(q, k, v, table), jax.jit(bert)(*f32, table), dtype)

    def also_returned(q, k, v, table):
        bias = jnp.where(padding, 0.0, -1e10)[:, None, None, :] + table[None]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v), bias
    got, want = xkern.jit(also_returned)(q, k, v, table), jax.jit(also_returned)(*f32, table)
    close(got[0], want[0], dtype)
    assert np.array_equal(got[1], want[1])


def _spelled(layout, scaling, mask, softmax, upcast, bias):
    """Attention as a model might write it: einsum or matmuls, a scaling, a bias added or subtracted,
    an upcast, a causal / padding / hidden-keys mask, jax.nn's softmax or one written out; k and v
    of fewer heads than q repeated to q's (jnp.repeat, as GQA ports write it)."""
    def f(q, k, v, b, m):
        if k.shape[2] != q.shape[2]:
            k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
        if layout == "bhsd":
            q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
            s = q @ k.swapaxes(-2, -1)
        else:
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        d = q.shape[-1]
        s = {"*": lambda s: s * d ** -0.5, "/": lambda s: s / math.sqrt(d), "none": lambda s: s,
             "/sqrt": lambda s: s / jnp.sqrt(d).astype(s.dtype)}[scaling](s)
        s = s + b if bias == "+" else s - b if bias == "-" else s
        s = s.astype(jnp.float32) if upcast else s
        if mask == "causal":
            s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        elif mask == "padding":
            s = jnp.where(m, s, -1e9)
        elif mask == "hidden":
            s = jnp.where(~m, jnp.finfo(s.dtype).min, s)
        if softmax == "jax.nn":
            p = jax.nn.softmax(s, axis=-1)
        elif softmax == "by hand, [..., None]":  # (in bf16 the sum is cast back before it is broadcast)
            e = jnp.exp(s - s.max(-1)[..., None])
            p = e / e.sum(-1)[..., None]
        else:
            e = jnp.exp(s - s.max(-1, keepdims=True))
            p = e / e.sum(-1, keepdims=True)
        p = p.astype(v.dtype)
        return p @ v if layout == "bhsd" else jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return f


@pytest.mark.parametrize("spelling, pattern", [
    (("bshd", "*", "padding", "jax.nn", False, "+"), "attention/einsum[bshd]+bias(broadcast)+mask(broadcast)"),
    (("bhsd", "/", "hidden", "by hand", False, "+"), "attention/einsum[bhsd]/divisor+bias(broadcast)+hidden mask"),
    (("bshd", "/sqrt", "padding", "jax.nn", True, "none"), "attention/einsum[bshd]/sqrt(d)+mask"),
    (("bhsd", "*", "causal", "by hand", True, "none"), "attention/einsum[bhsd]+causal+float32 softmax cast before"),
    (("bshd", "none", "padding", "jax.nn", False, "none"), "attention/einsum[bshd](unscaled)+mask"),
    (("bhsd", "none", "hidden", "jax.nn", True, "+"), "attention/einsum[bhsd](unscaled)+bias(broadcast)+hidden mask"),
    (("bshd", "*", "padding", "jax.nn", False, "-"), "attention/einsum[bshd]-bias(broadcast)+mask(broadcast)"),
    (("bhsd", "/", "hidden", "by hand", False, "-"), "attention/einsum[bhsd]/divisor-bias(broadcast)+hidden mask")])
def test_masks_with_a_bias_after_a_cast_or_unscaled_are_found(spelling, pattern):
    """Spellings the random test below found left to XLA: a bias and a mask together (the bias
    subtracted too), the scores cast to float32 before the mask (or the causal where), a mask on
    unscaled scores. Each is one template now; the kernels give jax.jit's values and gradients (a
    bias in q's dtype, [1, h, q, k])."""
    q, k, v, do = make(2, 12, 12, 3, 3, 16, jnp.bfloat16, seed=50)
    rng = np.random.default_rng(50)
    bias = jnp.asarray(rng.standard_normal((1, 3, 12, 12)), jnp.bfloat16)
    seen = jnp.asarray(np.arange(12)[None, None, None, :] < np.array([12, 5])[:, None, None, None])
    spelled = _spelled(*spelling)
    layout = spelling[0]
    if layout == "bhsd":  # (_spelled transposes q, k, v to [b, h, s, d] itself and returns that layout)
        do = do.transpose(0, 2, 1, 3)
    f = lambda q, k, v: spelled(q, k, v, bias, seen)
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith(pattern), match.pattern
    _equals_jax_jit_in_float32(f, q, k, v, do)


@pytest.mark.parametrize("form", ["np.sqrt(d), bias in q's dtype, padding mask", "float32 product, float32 bias, causal",
                                  "np.sqrt(d) by matmuls, bias per key", "q scaled, bias per key, padding mask, cast"])
def test_float32_scores_with_a_bias_are_found(form):
    """Scores promoted to float32 before a bias is added: divided by np.sqrt(d) (a float32 number,
    not a Python one, so bf16 scores become float32) or computed in float32 (preferred_element_type)
    and scaled; the bias in q's dtype (promoted) or float32, [1, h, q, k] or one value per key;
    causal or with a padding mask; the probabilities cast back. Or q scaled first, a bias and a mask
    in q's dtype, then the cast to float32 for the softmax. One kernel call; jax.jit's values and
    gradients."""
    q, k, v, do = make(2, 12, 12, 3, 3, 16, jnp.bfloat16, seed=51)
    rng = np.random.default_rng(51)
    f32_bias = form.startswith("float32")
    bias = jnp.asarray(rng.standard_normal((2, 1, 1, 12) if "per key" in form else (1, 3, 12, 12)),
                       jnp.float32 if f32_bias else jnp.bfloat16)
    seen = jnp.asarray(np.arange(12)[None, None, None, :] < np.array([12, 5])[:, None, None, None])

    def f(q, k, v):
        if form.startswith("q scaled"):
            s = jnp.einsum("bqhd,bkhd->bhqk", q * 16 ** -0.5, k)
        elif "matmuls" in form:
            q_, k_ = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
            s = q_ @ k_.swapaxes(-2, -1) / np.sqrt(16)
        elif f32_bias:
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * 0.25
        else:
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(16)
        s = s + bias
        if "padding" in form:
            s = jnp.where(seen, s, -1e9)
        elif "causal" in form:
            s = jnp.where(jnp.tril(jnp.ones((12, 12), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype)
        if "matmuls" in form:
            return (p @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    assert f(q, k, v).dtype == jnp.bfloat16
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern.startswith("attention/einsum"), match.pattern
    assert ("float32 softmax" if form.startswith("q scaled") else "product") in match.pattern, match.pattern
    assert ("float32 bias" if f32_bias else "+bias") in match.pattern, match.pattern
    _equals_jax_jit_in_float32(f, q, k, v, do)


@settings(max_examples=6, deadline=None)
@given(layout=st.sampled_from(["bshd", "bhsd"]), scaling=st.sampled_from(["*", "/", "none", "/sqrt"]),
       mask=st.sampled_from(["none", "causal", "padding", "hidden"]), softmax=st.sampled_from(["jax.nn", "by hand", "by hand, [..., None]"]),
       upcast=st.booleans(), bias=st.sampled_from(["none", "+", "-"]), bf16=st.booleans(),
       shape=st.sampled_from([(1, 5, 1, 8), (2, 16, 3, 16), (1, 33, 2, 8), (1, 12, 4, 8)]),
       grouped=st.booleans(), float32_bias=st.booleans(), per_key=st.booleans(), seed=st.integers(0, 1 << 16))
def test_random_attention_spellings_equal_jax_jit(layout, scaling, mask, softmax, upcast, bias, bf16, shape, grouped,
                                                  float32_bias, per_key, seed):
    """Whatever a spelling matches (or not), xkern.jit gives jax.jit's values (in its dtype) and
    gradients: a template that took a near-miss would show here. grouped: k and v of half q's heads,
    repeated (where q's heads are even). The bias is float32 where the softmax is (upcast) or
    float32_bias (then bf16 scores are promoted: a float32 result); a bias per head [1, h, q, k], or
    per_key one per batch entry and key [b, 1, 1, k] (the kernels' key bias)."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    b, s, h, d = shape
    q, k, v, do = make(b, s, s, h, h // 2 if grouped and h % 2 == 0 else h, d, dtype, seed=seed)
    rng = np.random.default_rng(seed)
    bias_array = jnp.asarray(rng.standard_normal((b, 1, 1, s) if per_key else (1, h, s, s)),
                             jnp.float32 if upcast or float32_bias else dtype)
    seen = jnp.asarray(np.arange(s)[None, None, None, :] < rng.integers(1, s + 1, (b, 1, 1, 1)))
    f = _spelled(layout, scaling, mask, softmax, upcast, bias)
    if layout == "bhsd":  # (its output is [b, h, s, d])
        do = do.transpose(0, 2, 1, 3)
    args, f32 = (q, k, v, bias_array, seen), [a.astype(jnp.float32) for a in (q, k, v, bias_array)] + [seen]
    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * do.astype(jnp.float32)))
    grads = lambda f: jax.grad(loss(f), (0, 1, 2, 3))
    got = (xkern.jit(f)(*args), *jax.jit(grads(xkern.optimize(f)))(*args))
    xla = (jax.jit(f)(*args), *jax.jit(grads(f))(*args))  # jax.jit in the inputs' dtype ...
    assert [a.dtype for a in got] == [a.dtype for a in xla]
    for g, x, w in zip(got, xla, (jax.jit(f)(*f32), *jax.jit(grads(f))(*f32))):  # ... and in float32
        # within the dtype's tolerance, or within twice jax.jit's own error (unscaled scores sharpen
        # the softmax: bf16 gradients there are off by more than 2% in jax.jit too)
        g, x, w = (np.asarray(a, np.float64) for a in (g, x, w))
        bound = max(TOL[dtype] * max(np.abs(w).max(), 1.0), 2 * np.abs(x - w).max())
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=0, atol=bound)


def _scores_bqhk(form):
    """Attention with its scores ordered [b, q, h, k] ("bqhd,bkhd->bqhk"), as Levanter's haliax and
    many hand-written models lay them out: q or the product scaled, a causal mask from iota or tril,
    or a boolean mask per key, per query and key, or per head, filled with -1e9."""
    s = 20
    causal_iota = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None, :, None, :]  # [1, q, 1, k]
    rng = np.random.default_rng(31)
    masks = {"key padding": jnp.asarray(np.arange(s)[None, :] < np.array([20, 9])[:, None])[:, None, None, :],
             "per head and query": jnp.asarray(rng.random((2, s, 4, s)) > 0.3).at[1, 5, 2].set(False),
             "causal from iota": causal_iota}

    def f(q, k, v):
        if form.startswith("q scaled"):
            scores = jnp.einsum("bqhd,bkhd->bqhk", q / jnp.sqrt(q.shape[-1]), k)
        else:
            scores = jnp.einsum("bqhd,bkhd->bqhk", q, k) / jnp.sqrt(q.shape[-1])
        if form.endswith("tril"):
            scores = jnp.where(jnp.tril(jnp.ones((s, s), bool))[None, :, None, :], scores, -jnp.inf)
        for name, mask in masks.items():
            if form.endswith(name):
                scores = jnp.where(mask, scores, -1e9)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        return jnp.einsum("bqhk,bkhd->bqhd", probs, v)
    return f


@pytest.mark.parametrize("form, pattern, kernel_causal", [
    ("product scaled", "attention/einsum[bqhk]/sqrt(d)+float32 softmax", False),
    ("q scaled, causal from iota", "attention/einsum[bqhk]/sqrt(d)+scaled q+mask", True),
    ("product scaled, causal by tril", "attention/einsum[bqhk]/sqrt(d)+causal", True),
    ("product scaled, key padding", "attention/einsum[bqhk]/sqrt(d)+mask", False),
    ("q scaled, per head and query", "attention/einsum[bqhk]/sqrt(d)+scaled q+mask", False)])
def test_scores_ordered_b_q_h_k_are_found(form, pattern, kernel_causal):
    """Scores in [b, q, h, k] order were left to XLA (explain: "written in no spelling the attention
    patterns take"); their masks reach the kernels transposed to [b, h, q, k], and a constant causal
    one runs as causal. Values and gradients equal jax.jit's."""
    f = _scores_bqhk(form)
    q, k, v, do = make(2, 20, 20, 4, 4, 16, jnp.bfloat16, seed=32)
    report = xkern.explain(f)(q, k, v)
    [match] = report.matches
    assert match.pattern.startswith(pattern), match.pattern
    masked = form.endswith(("padding", "per head and query"))
    assert _launch_flags(f, q, k, v) == [{"CAUSAL": kernel_causal, "HAS_MASK": masked}]
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    got, want = xkern.jit(f)(q, k, v), jax.jit(f)(*f32)
    close(got, want, jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)))
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v), jax.grad(loss(f), (0, 1, 2))(*f32)):
        close(g, w, jnp.bfloat16)
    if form.endswith("per head and query"):  # the query that sees no key averages every value, as XLA's
        assert np.abs(np.asarray(got[1, 5, 2], np.float32)).max() > 0


@pytest.mark.parametrize("form", ["padding", "causal and padding", "padding, dropout",
                                  "EasyLM: float32 weights, causal and padding"])
def test_flax_attention_with_a_bias_as_hf_ports_write_it(form, monkeypatch):
    """HF's Flax ports turn their masks into a bias (0 or finfo.min, in the model's dtype) and call
    flax's dot_product_attention_weights with it (and dropout when training), then the einsum with v.
    EasyLM's LLaMA asks for float32 weights (q and k promoted): a float32 result.
    An entry whose every key is padding averages every value, and its gradient reaches q and k through
    the bias's add, as under XLA (with dropout, formed 3 queries at a time here)."""
    import flax.linen as nn
    from xkern.kernels import attention as kernels

    monkeypatch.setattr(kernels, "EMPTY_ROWS_CHUNK", 3 * 4 * 3 * 20)  # 3 queries of [b3, h4, k20]

    b, s, h, d = 3, 20, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, jnp.bfloat16, seed=21)
    valid = jnp.arange(s)[None, :] < jnp.array([s, 11, 0])[:, None]
    mask = valid[:, None, None, :]
    if form.endswith("causal and padding"):
        mask = nn.combine_masks(mask, nn.make_causal_mask(jnp.ones((b, s)), dtype=bool))
    dropout, easylm = form.endswith("dropout"), form.startswith("EasyLM")

    def f(q, k, v, mask=mask):
        bias = jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0).astype(q.dtype),
                              jnp.full(mask.shape, jnp.finfo(q.dtype).min).astype(q.dtype))
        weights = nn.dot_product_attention_weights(q, k, bias=bias, dropout_rng=jax.random.key(2),
                                                   dropout_rate=0.1 if dropout else 0.0, broadcast_dropout=True,
                                                   deterministic=not dropout,
                                                   dtype=jnp.promote_types(q.dtype, jnp.float32) if easylm else q.dtype)
        return jnp.einsum("...hqk,...khd->...qhd", weights, v)

    [match] = [m for m in xkern.explain(f)(q, k, v).matches if m.pattern.startswith("attention/")]
    assert match.pattern == ("attention/flax.linen.dot_product_attention_weights(float32)+bias(broadcast)" if easylm
                             else f"attention/flax.linen.dot_product_attention+bias(broadcast){'+dropout' * dropout}")
    assert match.params.get("bias_kind") == "mask"  # run as a mask: its tile lists skip what it hides
    got, want = xkern.jit(f)(q, k, v), jax.jit(f)(q, k, v)
    assert got.dtype == want.dtype == (jnp.float32 if easylm else jnp.bfloat16)
    assert np.abs(np.asarray(got[2], np.float32)).max() > 0  # the all-padding entry: the mean of v
    close(got, want, jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    for g, w in zip(xkern.jit(jax.grad(loss, (0, 1, 2)))(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("form", ["(1 - m) * -1e9", "-1e9 * (1 - m)", "1e9 * (m - 1)"])
def test_a_padding_bias_of_a_boolean_mask_cast_runs_as_a_mask(form):
    """A padding bias written as arithmetic on a boolean mask cast to float ((1 - mask) * -1e9, as
    BERT ports and tutorials write it; AlphaFold's 1e9 * (mask - 1)) holds only 0 and -1e9, as a select
    does: it runs as a mask (its tile lists skip the padding). Values and gradients against jax.jit's in
    float32, an entry with every key padded. A float mask given as data may hold anything between (a
    bias), and so may a fill of -1e4 (BERT's, which float32 still orders): both stay biases."""
    b, s, h, d = 3, 20, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, jnp.bfloat16, seed=26)
    valid = jnp.arange(s)[None, :] < jnp.array([s, 11, 0])[:, None]
    fill = -1e9
    as_bias = {"(1 - m) * -1e9": lambda m: (1.0 - m) * fill, "-1e9 * (1 - m)": lambda m: fill * (1.0 - m),
               "1e9 * (m - 1)": lambda m: -fill * (m - 1.0)}[form]

    def attend(q, k, v, bias):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / 4.0 + bias[:, None, None, :]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v)
    f = lambda q, k, v, valid: attend(q, k, v, as_bias(valid.astype(jnp.float32)))
    [match] = [m for m in xkern.explain(f)(q, k, v, valid).matches if m.op == "attention"]
    assert match.params.get("bias_kind") == "mask", match
    matches_float32_jax_jit(f, q, k, v, valid, do)
    float_data = lambda q, k, v, m: attend(q, k, v, as_bias(m))  # (a float mask given: any value)
    bert = lambda q, k, v, valid: attend(q, k, v, (1.0 - valid.astype(jnp.float32)) * -1e4)
    for g, m in ((float_data, valid.astype(jnp.float32)), (bert, valid)):
        [match] = [x for x in xkern.explain(g)(q, k, v, m).matches if x.op == "attention"]
        assert "bias_kind" not in match.params, match


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_padding_bias_of_a_mask_given_as_data_is_read_per_key(dtype):
    """A padding bias from a mask given as data ((1 - mask) * -10000 of an integer mask, as ports of
    PyTorch models write it; AlphaFold's 1e9 * (mask - 1) of its float msa_mask) may hold any number,
    so it is a bias; it is the same for every query ([b, 1, 1, k]), and the kernels read it per key
    (HAS_BIAS 2), not a [b, 1, q, k] tile (0.25-1 GiB at b4 s4096; 1.33x / 1.05x jax.jit on an H100
    where a mask gives 3x / 1.9x). Values and gradients against jax.jit's in float32, an entry with
    every key padded under AlphaFold's -1e9 (uniform weights, as XLA's; -1e4 leaves such a row's
    scores on float32's grid of 1e-3, which XLA and the kernels round apart); the compiled program
    holds no [b, 1, q, k] bias; under vmap too."""
    b, s, h, d = 3, 21, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, dtype, seed=27)
    keys = lambda *n: jnp.asarray(np.arange(s)[None, :] < np.array(n)[:, None], jnp.int32)

    def ported(q, k, v, mask):
        bias = (1.0 - mask[:, None, None, :].astype(q.dtype)) * -10000.0
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores.astype(jnp.float32)).astype(q.dtype), v)
    alphafold = lambda q, k, v, mask: _alphafold_attention(q, k, v, mask.astype(jnp.float32), jnp.zeros((h, s, s)))
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    for f, mask in ((ported, keys(s, 9, 1)), (alphafold, keys(s, 9, 0))):
        assert [c["HAS_BIAS"] for c in _constexprs(f, q, k, v, mask)] == [2 if f is ported else 3]
        compiled = jax.jit(xkern.optimize(f)).lower(q, k, v, mask).compile().as_text()
        assert f"[{b},1,{s},{s}]" not in compiled and f"[{b},{h},{s},{s}]" not in compiled
        close(xkern.jit(f)(q, k, v, mask), jax.jit(f)(*f32, mask), dtype)
        loss = lambda q, k, v: jnp.sum(f(q, k, v, mask).astype(jnp.float32) * do.astype(jnp.float32))
        for got, want in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v),
                             jax.jit(jax.grad(loss, (0, 1, 2)))(*f32)):
            close(got, want, dtype)
    masks = jnp.stack([keys(s, 9, 1), keys(2, s, 5)])  # (vmapped: a key bias per outer entry)
    close(jax.jit(jax.vmap(xkern.optimize(ported), (None, None, None, 0)))(q, k, v, masks),
          jax.vmap(ported, (None, None, None, 0))(*f32, masks), dtype)


def test_a_bias_runs_as_a_mask_only_where_it_wipes_out_the_scores():
    """A padding bias (0 or a fill), given to jax.nn as flax.nnx passes it ([b,1,1,k], q's dtype):
    run as a mask when the fill leaves nothing of a score (finfo.min, and -1e9 in float32, whose grid
    of 64 there leaves the scores of a row it hides equal: their rows that see no key are then uniform
    under XLA too), kept as a bias at -1e7 in float32 (whose grid of 1 still orders them) and at -inf
    (XLA's NaN rows)."""
    b, s, h, d = 2, 20, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, jnp.bfloat16, seed=25)
    padding = (jnp.arange(s)[None, :] < jnp.array([s, 0])[:, None])[:, None, None, :]
    for fill, dtype, as_mask in ((jnp.finfo(jnp.bfloat16).min, jnp.bfloat16, True), (-1e9, jnp.float32, True),
                                 (-1e7, jnp.float32, False), (-jnp.inf, jnp.bfloat16, False)):
        f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=jnp.where(padding, 0.0, fill).astype(dtype))
        [match] = [m for m in xkern.explain(f)(q, k, v).matches if m.pattern.startswith("attention/")]
        assert match.pattern.startswith("attention/jax.nn.dot_product_attention+bias[b,1,q,k]")
        assert (match.params.get("bias_kind") == "mask") == as_mask, fill
    padded = lambda fill, dtype: (lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, bias=jnp.where(padding, 0.0, fill).astype(dtype)))
    got = value_and_grads(xkern.optimize(padded(jnp.finfo(jnp.bfloat16).min, jnp.bfloat16)), (q, k, v), do)
    want = value_and_grads(padded(jnp.finfo(jnp.float32).min, jnp.float32), [a.astype(jnp.float32) for a in (q, k, v)],
                           do.astype(jnp.float32))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # entry 1 sees no key: uniform, dq and dk too
        close(g, w, jnp.bfloat16)
    got = value_and_grads(xkern.optimize(padded(-1e9, jnp.float32)), (q, k, v), do)  # (as a mask: the same)
    want = value_and_grads(padded(-1e9, jnp.float32), [a.astype(jnp.float32) for a in (q, k, v)], do.astype(jnp.float32))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("kv_heads, cap", [(4, None), (2, None), (2, 1.5)],
                         ids=["mha", "gqa", "gemma 2 soft cap"])
def test_gemma_attention_is_found(kv_heads, cap):
    """The gemma library's attention: q scaled by a number, scores [b, q, heads, k] (GQA through a
    5-D einsum), Gemma 2's soft cap on them, its [b, q, k] mask (here causal and padding, made in the
    program) applied with K_MASK, softmax cast to the values' dtype."""
    def gemma(q, k, v, lengths):
        b, t, n, d = q.shape
        logits_of = lambda q: (jnp.einsum("BTNH,BSNH->BTNS", q, k) if kv_heads == n else jnp.einsum(
            "BTKGH,BSKH->BTKGS", q.reshape(b, t, kv_heads, n // kv_heads, d), k).reshape(b, t, n, -1))
        logits = logits_of(q * 16 ** -0.5)
        if cap is not None:
            logits = jnp.tanh(logits / cap)
            logits = logits * cap
        mask = (jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :]) & (
            jnp.arange(t)[None, None, :] < lengths[:, None, None])
        probs = jax.nn.softmax(jnp.where(jnp.expand_dims(mask, -2), logits, -2.3819763e38), axis=-1).astype(k.dtype)
        if kv_heads == n:
            return jnp.einsum("BTNS,BSNH->BTNH", probs, v)
        out = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, kv_heads, n // kv_heads, -1), v)
        return out.reshape(b, t, n, d)

    q, k, v, do = make(2, 20, 20, 4, kv_heads, 16, jnp.bfloat16, seed=27)
    q = q * 3  # scores of a few units: the cap bends them
    lengths = jnp.array([20, 9])
    [match] = [m for m in xkern.explain(gemma)(q, k, v, lengths).matches if m.pattern.startswith("attention/")]
    assert match.pattern == (f"attention/einsum[bqhk{',gqa' * (kv_heads == 2)}]+scaled q"
                             f"{'+soft cap' * (cap is not None)}+mask[b,q,k]")
    assert match.params.get("cap") == cap
    loss = lambda q, k, v: jnp.sum(gemma(q, k, v, lengths).astype(jnp.float32) * do.astype(jnp.float32))
    got = xkern.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*(a.astype(jnp.float32) for a in (q, k, v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)


MAXTEXT_FILL = -0.7 * float(jnp.finfo(jnp.float32).max)  # MaxText's DEFAULT_MASK_VALUE


def maxtext_attention(q, k, v, mask=None, cap=None, float32_logits=False, divide_by=None, float32_product=False,
                      flat=False):
    """MaxText's dot-product attention as its attention op writes it (apply_attention_dot, qk_product,
    compute_local_attention, wv_product, then the output divided by the sums): q grouped by k/v head,
    unscaled 5-D scores, an optional soft cap, float32 logits or not, the additive mask [b, 1, 1, q, k]
    (0 or the fill) applied with where(mask >= fill / 2, ...), exps and sums kept apart (the max's
    reshape is dead code there too). divide_by: a near miss, another divisor. float32_product:
    MaxText's float32_qk_product, q and k cast first. flat: compute_local_attention as MaxText writes
    it since its attention sinks: the softmax's pieces over the scores reshaped to [b, heads, q, k],
    the exps sliced to the keys and reshaped back, the max and sums transposed (the max dead)."""
    if float32_product:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    b, t, n, d = q.shape
    kv = k.shape[-2]
    weights = jnp.einsum("btkgd,bskd->bkgts", jnp.reshape(q, (b, t, kv, n // kv, d)), k)
    if cap is not None:
        weights = jnp.tanh(weights / cap)
        weights = weights * cap
    if float32_logits:
        weights = weights.astype(jnp.float32)
    if mask is not None:
        weights = jnp.where(mask >= MAXTEXT_FILL * 0.5, weights, MAXTEXT_FILL)
    if flat:
        _, kv, g, t, s = weights.shape
        logits = jnp.reshape(weights, (b, kv * g, t, s))
        local_max = jnp.max(logits, axis=-1, keepdims=True)
        local_exps = jnp.exp(logits - local_max)
        local_sum = jnp.sum(local_exps, axis=-1, keepdims=True)
        local_exps = jnp.reshape(local_exps[..., :s], (b, kv, g, t, s))
        local_max, local_sum = jnp.transpose(local_max, (0, 2, 1, 3)), jnp.transpose(local_sum, (0, 2, 1, 3))
        out = jnp.reshape(jnp.einsum("bkgts,bskd->btkgd", local_exps, v), (b, t, n, d))
        return out / (local_sum if divide_by is None else divide_by(local_sum))
    local_max = jnp.max(weights, axis=-1, keepdims=True)
    local_exps = jnp.exp(weights - local_max)
    local_sum = jnp.moveaxis(jnp.sum(local_exps, axis=-1, keepdims=True), -2, 1)
    local_max = jnp.moveaxis(local_max, -2, 1)
    local_max = jnp.reshape(local_max, (*local_max.shape[:2], local_max.shape[2] * local_max.shape[3], 1))
    local_sum = jnp.reshape(local_sum, (*local_sum.shape[:2], local_sum.shape[2] * local_sum.shape[3], 1))
    out = jnp.einsum("bkgts,bskd->btkgd", local_exps, v)
    out = jnp.reshape(out, (b, t, n, d))
    return out / (local_sum if divide_by is None else divide_by(local_sum))


def _maxtext_mask(segments, causal=True, window=None):
    """MaxText's mask from segment ids (documents packed in a row; 0: padding) and causality, as
    generate_attention_mask makes it: 0 where visible, the fill elsewhere, [b, 1, 1, q, k]."""
    t = segments.shape[1]
    row, col = (jax.lax.broadcasted_iota(jnp.int32, (t, t), axis) for axis in (0, 1))
    visible = (segments[:, :, None] == segments[:, None, :])[:, None, None]
    visible = visible & (row >= col)[None, None, None] if causal else visible
    visible = visible & (row - col < window)[None, None, None] if window else visible
    return jnp.where(visible, 0.0, MAXTEXT_FILL)


@pytest.mark.parametrize("case", ["gqa causal, soft cap", "mha causal, float32 logits", "gqa sliding window 5",
                                  "packed documents, gqa",
                                  "packed documents, float32 logits, soft cap", "float32 product and logits",
                                  "gqa causal, soft cap, flat", "packed documents, float32 logits, flat"])
def test_maxtext_dot_product_attention_is_found(case):
    """MaxText's attention="dot_product" path (also its decode path): one kernel call, with its
    constant causal mask read as causal (a sliding window's as a window) and a packed-documents mask
    (segment ids, padding last) passed as a mask; values and
    gradients as jax.jit's in float32 (float32 logits: a float32 result, as MaxText's). Dividing by
    anything but the row sums is a near miss."""
    b, t, n, d = 2, 24, 4, 16
    kv = 4 if case.startswith("mha") else 2
    q, k, v, do = make(b, t, t, n, kv, d, jnp.bfloat16, seed=41)
    q = q * (3 * d ** -0.5)  # MaxText folds the scale into q's projection; scores of a few units
    cap = 20.0 if "soft cap" in case else None
    f32, product = "float32 logits" in case or "float32 product" in case, "float32 product" in case
    segments = jnp.array([[1] * 10 + [2] * 10 + [0] * 4, [1] * 24])
    packed = case.startswith("packed")
    window = 5 if "window" in case else None
    flat = case.endswith("flat")  # MaxText's current spelling: the softmax over [b, heads, q, k]

    def f(q, k, v, segments):
        mask = _maxtext_mask(segments) if packed else _maxtext_mask(jnp.ones((b, t), jnp.int32), window=window)
        return maxtext_attention(q, k, v, mask, cap, f32, float32_product=product, flat=flat)
    [match] = [m for m in xkern.explain(f)(q, k, v, segments).matches if m.pattern.startswith("attention/")]
    assert match.pattern.startswith("attention/maxtext dot_product")
    assert match.pattern.endswith("+mask+[b,h,q,k] softmax" if flat else "+mask")
    assert match.params.get("mask_kind") == (None if packed else "window" if window else "causal")
    assert match.params.get("cap") == cap and (not window or (match.params["left"], match.params["right"]) == (4, 0))
    vjp = lambda *a: (lambda out, back: (out, back(do.astype(out.dtype))))(*jax.vjp(lambda *x: f(*x, segments), *a))
    got = xkern.jit(vjp)(q, k, v)
    want = jax.jit(vjp)(*(a.astype(jnp.float32) for a in (q, k, v)))
    assert got[0].dtype == (jnp.float32 if f32 else jnp.bfloat16)
    assert kernel_names(jax.make_jaxpr(xkern.optimize(vjp))(q, k, v)).count("attention_fwd") == 1
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)
    near = lambda q, k, v: maxtext_attention(q, k, v, _maxtext_mask(segments), cap, f32, divide_by=lambda s: s + 1,
                                             flat=flat)
    assert not [m for m in xkern.explain(near)(q, k, v).matches if m.pattern.startswith("attention/")]


def test_maxtext_decode_step_is_found():
    """A MaxText decode step: one query against a cache padded past each entry's length (its mask
    [b, 1, 1, 1, keys] from the lengths): the split-key kernel, jax.jit's values in float32."""
    q, _, _, _ = make(2, 1, 1, 8, 2, 32, jnp.bfloat16, seed=3)
    _, k, v, _ = make(2, 200, 200, 8, 2, 32, jnp.bfloat16, seed=4)
    lengths = jnp.array([200, 57])

    def step(q, k, v, lengths):
        visible = (jnp.arange(200)[None, :] < lengths[:, None])[:, None, None, None, :]
        return maxtext_attention(q, k, v, jnp.where(visible, 0.0, MAXTEXT_FILL))
    [match] = xkern.explain(step)(q, k, v, lengths).matches
    assert match.pattern == "attention/maxtext dot_product+mask" and match.kernels == ["attention_fwd_split_kv"]
    close(xkern.jit(step)(q, k, v, lengths), jax.jit(step)(*(a.astype(jnp.float32) for a in (q, k, v)), lengths),
          jnp.bfloat16)


def _equinox_attention(q, k, v, mask=None, softmax_axis=-1):
    """Equinox's MultiheadAttention core as it is written: for one example and one head, q divided by
    sqrt(d), the mask applied with finfo.min, softmax in float32 and cast back; the heads mapped by
    jax.vmap over axis 1 (a mask of one example, [q, k], closed over). softmax_axis: a near miss."""
    def per_head(q, k, v):
        logits = jnp.einsum("sd,Sd->sS", q / math.sqrt(q.shape[-1]), k)
        if mask is not None:
            logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(logits.dtype, jnp.float32)
        weights = jax.nn.softmax(logits.astype(dtype), axis=softmax_axis).astype(logits.dtype)
        return jnp.einsum("sS,Sd->sd", weights, v)
    return jax.vmap(per_head, in_axes=1, out_axes=1)(q, k, v)


@pytest.mark.parametrize("case", ["no mask", "causal", "padding per example", "one mask for every example"])
def test_equinox_attention_is_found(case):
    """Equinox's attention under the user's jax.vmap over the batch: one kernel call (a constant
    causal mask read as causal, a padding mask per example passed on, its row that sees no key the
    mean of the values as XLA's finfo.min fill gives); values and gradients as jax.jit's in float32.
    A softmax over the queries is no attention."""
    b, s, h, d = 2, 20, 4, 16
    q, k, v, do = make(b, s, s, h, h, d, jnp.bfloat16, seed=43)
    lengths = jnp.array([s, 0])
    padding = jnp.broadcast_to(jnp.arange(s)[None, None, :] < lengths[:, None, None], (b, s, s))
    shared = jnp.asarray(np.random.default_rng(44).random((s, s)) < 0.6).at[:, 0].set(True)

    def f(q, k, v, axis=-1):
        if case == "causal":
            return jax.vmap(lambda *a: _equinox_attention(*a, jnp.tril(jnp.ones((s, s), bool)), axis))(q, k, v)
        if case == "padding per example":
            return jax.vmap(lambda *a: _equinox_attention(*a[:3], a[3], axis))(q, k, v, padding)
        if case == "one mask for every example":
            return jax.vmap(lambda *a: _equinox_attention(*a, shared, axis))(q, k, v)
        return jax.vmap(lambda *a: _equinox_attention(*a, None, axis))(q, k, v)
    [match] = [m for m in xkern.explain(f)(q, k, v).matches if m.pattern.startswith("attention/")]
    assert match.pattern.startswith("attention/equinox MultiheadAttention")
    assert match.params.get("mask_kind") == ("causal" if case == "causal" else None)
    vjp = lambda *a: (lambda out, back: (out, back(do.astype(out.dtype))))(*jax.vjp(f, *a))
    got = xkern.jit(vjp)(q, k, v)
    want = jax.jit(vjp)(*(a.astype(jnp.float32) for a in (q, k, v)))
    assert kernel_names(jax.make_jaxpr(xkern.optimize(vjp))(q, k, v)).count("attention_fwd") == 1
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)
    assert not [m for m in xkern.explain(lambda *a: f(*a, axis=0))(q, k, v).matches
                if m.pattern.startswith("attention/")]


def test_soft_capped_scores_by_hand_are_found():
    """Scores scaled, capped (tanh(s / c) * c), causal, softmax in float32: the kernels cap them,
    values and gradients as jax.jit's; tanh(s / a) * b with a != b is no soft cap and stays XLA's."""
    def f(q, k, v, a=0.9, b=0.9):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
        s = jnp.where(jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool)), jnp.tanh(s / a) * b, -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype), v)

    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in make(2, 19, 19, 2, 2, 16, jnp.bfloat16, seed=29))
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern == "attention/einsum[bhsd]+soft cap+causal+float32 softmax"
    assert match.params["cap"] == float(jnp.bfloat16(0.9))  # as the program holds it
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    got = xkern.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*(a.astype(jnp.float32) for a in (q, k, v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)
    assert not [m for m in xkern.explain(lambda q, k, v: f(q, k, v, 0.9, 1.2))(q, k, v).matches
                if m.pattern.startswith("attention/")]


def _sunk(q, k, v, sinks, causal=False, mask=None, lengths=None):
    """Attention with sinks as gpt-oss's reference defines it, in float32: a column of sink logits
    [b, h, q, 1] joined to the masked scores, the softmax, the column dropped (GQA by repeating k, v)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, 2), jnp.repeat(v, group, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    visible = jnp.ones(s.shape, bool) if mask is None else jnp.broadcast_to(mask, s.shape)
    if causal:
        visible = visible & jnp.tril(jnp.ones(s.shape[-2:], bool))
    if lengths is not None:
        visible = visible & (jnp.arange(s.shape[-1]) < lengths[:, None, None, None])
    column = jnp.broadcast_to(sinks.reshape((1, -1, 1, 1) if sinks.ndim == 1 else sinks.shape), s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([jnp.where(visible, s, -jnp.inf), column], -1), -1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("case", ["per head, gqa, causal", "per row, mask with an empty row, lengths",
                                  "bf16, soft cap, edge sinks"])
def test_sinks_values_and_gradients_against_the_reference(case):
    """Attention sinks (a zero-valued key of its own logit per row): values and every gradient, the
    sinks' included, against gpt-oss's definition in float32: sinks per head and per row (4-D, as a
    program joins them to its scores), GQA, causal, a mask that hides a whole row (zero, whatever
    masked_rows says), kv_lengths, and sinks of -inf (no sink) and far above the scores (o ~ 0)."""
    b, sq, sk, h, hk, d = 2, 19, 23, 4, 2, 16
    dtype = jnp.bfloat16 if case.startswith("bf16") else jnp.float32
    q, k, v, do = make(b, sq, sk, h, hk, d, dtype, seed=33)
    rng = np.random.default_rng(34)
    kw, ref_kw = {}, {}
    if case.startswith("per head"):
        sinks, kw = jnp.asarray(rng.standard_normal(h) * 2, jnp.float32), {"causal": True}
    elif case.startswith("per row"):
        sinks = jnp.asarray(rng.standard_normal((b, h, sq, 1)), jnp.float32)
        mask = jnp.asarray(rng.random((b, 1, sq, sk)) > 0.3).at[1, 0, 4].set(False)
        lengths = jnp.array([23, 15])
        kw = {"mask": mask, "masked_rows": "average", "kv_lengths": lengths}
        ref_kw = {"mask": mask, "lengths": lengths}
    else:
        sinks = jnp.asarray([-jnp.inf, 40.0, 0.5, -1.0], dtype)
        kw = ref_kw = {"causal": True}
    cap = 30.0 if dtype == jnp.bfloat16 else None
    ref_kw = ref_kw or kw
    f32 = [a.astype(jnp.float32) for a in (q, k, v, sinks)]
    (out, grads), (want, grads_ref) = (
        value_and_grads(lambda *a, **kw: attention(*a[:3], sinks=a[3], logits_soft_cap=cap, **kw),
                        (q, k, v, sinks), do, **kw),
        value_and_grads(lambda q, k, v, s, **kw: _sunk(q, k, v, s, **kw) if cap is None else reference(
            q, k, v, causal=True, logits_soft_cap=cap, sinks=s),
            f32, do.astype(jnp.float32), **ref_kw))
    assert out.dtype == dtype and grads[3].dtype == sinks.dtype and grads[3].shape == sinks.shape
    close(out, want, dtype)
    for g, w in zip(grads, grads_ref):
        close(g, w, dtype)
    if case.startswith("per row"):  # the hidden row: zero, and its sink gets no gradient
        assert not np.any(np.asarray(out[1, 4, :2])) and grads[3][1, 0, 4, 0] == 0
    if cap is not None:  # the reference's sinks are the definition's (finite ones too): the first one is no sink
        f32_no_cap = lambda causal: reference(*f32[:3], causal=causal, sinks=f32[3].at[0].set(-2.0))
        close(f32_no_cap(True), _sunk(*f32[:3], f32[3].at[0].set(-2.0), causal=True), jnp.float32)
        close(reference(q, k, v, causal=True, logits_soft_cap=cap, sinks=jnp.full((b, h, sq, 1), -jnp.inf)),
              reference(q, k, v, causal=True, logits_soft_cap=cap), dtype)
        assert np.abs(np.asarray(out[:, :, 1], np.float32)).max() < 1e-6  # a sink of 40 takes every weight


def test_sinks_errors_name_the_argument():
    q, k, v, _ = make(1, 8, 8, 4, 2, 16, jnp.float32)
    for sinks, error, words in [(jnp.zeros(3), ValueError, "[heads] = [4]"), (jnp.zeros((1, 4, 8, 2)), ValueError,
                                                                              "[batch, heads, q_seq, 1]"),
                                (jnp.zeros(4, jnp.int32), TypeError, "floating-point")]:
        with pytest.raises(error, match=r"sinks") as info:
            attention(q, k, v, sinks=sinks)
        assert words in str(info.value)


@pytest.mark.parametrize("form", ["causal window as a -inf bias", "float32 softmax"])
def test_gpt_oss_attention_sinks_are_found(form):
    """gpt-oss's attention as a JAX program writes it: scores scaled, its causal (here also sliding
    window) mask a constant -inf bias, the sinks [heads] joined as a column, softmax, the column
    dropped: one kernel call, its mask read as a window; values and gradients (the sinks' too) as
    jax.jit's. The sink column first is a near miss, XLA's; a -inf bias that hides a whole row stays
    a bias (that row weights only its sink: zero, as under XLA)."""
    b, s, h, d = 2, 24, 4, 16
    qp, kp = np.arange(s)[:, None], np.arange(s)[None, :]
    window = np.where(kp > qp, -np.inf, 0.0) + np.where(qp - kp > 5, -np.inf, 0.0)

    def gpt_oss(q, k, v, sinks, mask=window if form.startswith("causal") else None, first=False):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
        if mask is not None:
            scores = scores + jnp.asarray(mask, scores.dtype)[None, None]
        scores = scores.astype(jnp.float32) if form == "float32 softmax" else scores
        column = jnp.broadcast_to(sinks.reshape(1, h, 1, 1).astype(scores.dtype), (b, h, s, 1))
        if first:
            w = jax.nn.softmax(jnp.concatenate([column, scores], -1), -1)[..., 1:]
        else:
            w = jax.nn.softmax(jnp.concatenate([scores, column], -1), -1)[..., :-1]
        return jnp.einsum("bhqk,bkhd->bqhd", w.astype(q.dtype), v)

    q, k, v, do = make(b, s, s, h, h, d, jnp.bfloat16, seed=35)
    sinks = jnp.asarray(np.random.default_rng(36).standard_normal(h), jnp.bfloat16)
    attention_matches = lambda f: [m for m in xkern.explain(f)(q, k, v, sinks).matches
                                   if m.pattern.startswith("attention/")]
    [match] = attention_matches(gpt_oss)
    assert match.pattern.endswith("+sinks")
    if form.startswith("causal"):
        assert (match.params["mask_kind"], match.params["left"], match.params["right"]) == ("window", 5, 0)
    # (each output and gradient element, not their sum with do: 3072 roundings of bf16 outputs)
    vjp = lambda *a: (lambda out, back: (out, back(do.astype(out.dtype))))(*jax.vjp(gpt_oss, *a))
    got = xkern.jit(vjp)(q, k, v, sinks)
    want = jax.jit(vjp)(*(a.astype(jnp.float32) for a in (q, k, v, sinks)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)
    assert not attention_matches(lambda *a: gpt_oss(*a, first=True))
    if form.startswith("causal"):
        hides_a_row = window.copy()
        hides_a_row[3] = -np.inf
        [match] = attention_matches(lambda *a: gpt_oss(*a, mask=hides_a_row))
        assert "bias_kind" not in match.params
        got = xkern.jit(lambda *a: gpt_oss(*a, mask=hides_a_row))(q, k, v, sinks)
        close(got, jax.jit(lambda *a: gpt_oss(*a, mask=hides_a_row))(*(a.astype(jnp.float32) for a in (q, k, v, sinks))),
              jnp.bfloat16)
        assert not np.any(np.asarray(got[:, 3]))


@pytest.mark.parametrize("layout, shape, dtype", [("bshd", (1, 4, 1, 1), jnp.bfloat16),
                                                  ("bhsd", (4, 1, 1), jnp.float32),
                                                  ("bshd", (2, 4, 19, 1), jnp.bfloat16)],
                         ids=["per head", "per head [h,1,1], bhsd, float32", "per row"])
def test_scores_scaled_per_row_scale_q(layout, shape, dtype):
    """A learned temperature per head (scores times a [1, h, 1, 1] or [h, 1, 1] array; per row alike):
    q is scaled by it for the kernels, values and gradients as jax.jit's in float32. The temperature's
    own gradient sums hundreds of terms per head: in bf16 it must be no farther from float32 than
    jax.jit's bf16 program (in float32, within float32's tolerance). An array that varies over the
    keys is declined, and explain says why; in float32 the scalar scale's template (whose cast is then
    absent) declines a row scale instead of taking it."""
    def f(q, k, v, t):
        s = jnp.einsum("bqhd,bkhd->bhqk" if layout == "bshd" else "bhqd,bhkd->bhqk", q, k) * t
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd" if layout == "bshd" else "bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    q, k, v, do = make(2, 19, 19, 4, 4, 16, dtype, seed=37)
    if layout == "bhsd":
        q, k, v, do = (a.transpose(0, 2, 1, 3) for a in (q, k, v, do))
    t = jnp.asarray(np.random.default_rng(38).random(shape) + 0.2, dtype)
    [match] = [m for m in xkern.explain(f)(q, k, v, t).matches if m.pattern.startswith("attention/")]
    assert match.pattern == f"attention/einsum[{layout}]*rows+causal"
    vjp = lambda *a: (lambda out, back: (out, back(do.astype(out.dtype))))(*jax.vjp(f, *a))
    (out, grads), (want, grads_ref) = xkern.jit(vjp)(q, k, v, t), jax.jit(vjp)(*(a.astype(jnp.float32) for a in (q, k, v, t)))
    for g, w in zip((out, *grads[:3]), (want, *grads_ref[:3])):
        close(g, w, dtype)
    error = lambda g: np.abs(np.asarray(g, np.float64) - np.asarray(grads_ref[3], np.float64)).max()
    xla_error = error(jax.jit(vjp)(q, k, v, t)[1][3]) if dtype != jnp.float32 else 0.0
    assert error(grads[3]) <= max(xla_error, TOL[dtype] * np.abs(np.asarray(grads_ref[3])).max())
    per_key = jnp.ones((1, 1, 1, 19), dtype)
    report = xkern.explain(f)(q, k, v, per_key)
    assert not [m for m in report.matches if m.pattern.startswith("attention/")]
    assert any("an array of shape (1, 1, 1, 19)" in d.reason for d in report.declined)


def test_explain_names_attention_no_spelling_took():
    """Scores scaled per key (times a [keys] array) are no spelling the kernels take: explain says so
    at the softmax, which alone is fused; attention that is taken, and a softmax after an unbatched
    product (an LM head's loss), get no such note."""
    import flax.linen as nn
    from xkern.jaxpr_passes.rewrite import UNMATCHED_ATTENTION

    def per_head(q, k, v, per_key):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * per_key
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q, k, v, _ = make(2, 16, 16, 2, 2, 16, jnp.bfloat16, seed=28)
    notes = lambda f, *args: [d for d in xkern.explain(f)(*args).declined if d.reason == UNMATCHED_ATTENTION]
    [note] = notes(per_head, q, k, v, jnp.linspace(0.2, 0.3, 16, dtype=jnp.bfloat16))
    assert note.pattern == "attention" and "attention.py" in note.location
    assert notes(lambda q, k, v: nn.dot_product_attention(q, k, v), q, k, v) == []
    # AlphaFold's batch of batches ([b, r, s, h, c]) is taken, its batch dims made one: no note
    five_d = lambda q, k, v: jnp.einsum("...hqk,...khc->...qhc",
                                        jax.nn.softmax(jnp.einsum("...qhc,...khc->...hqk", q * 0.25, k)), v)
    assert [m.op for m in xkern.explain(five_d)(q[None], k[None], v[None]).matches] == ["attention"]
    assert notes(five_d, q[None], k[None], v[None]) == []
    # k and v of a batch q's broadcasts over (jnp.einsum allows it): no spelling, the note says so
    report = xkern.explain(five_d)(q[None].repeat(2, 0), k[None], v[None])
    assert [m.op for m in report.matches] == ["softmax"]
    assert [d.reason for d in report.declined if d.pattern.startswith("attention")] == [UNMATCHED_ATTENTION]
    w, labels = jnp.ones((16, 50)), jnp.zeros((2, 16), jnp.int32)
    lm = lambda w: jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(q[:, :, 0].astype(jnp.float32) @ w), labels[
        ..., None], -1))
    assert notes(jax.grad(lm), w) == []


def test_float32_out_stores_the_accumulator():
    """out_dtype=float32 from bfloat16 inputs: a float32 result nearer the float32 reference than the
    bfloat16 one (not the rounded result cast up), with GQA, causal, a mask with an empty row, and
    the split-key forward; its gradients in q's dtype against the reference's; errors name it."""
    b, sq, sk, h, hk, d = 2, 19, 23, 4, 2, 16
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.bfloat16, seed=31)
    mask = jnp.asarray(np.random.default_rng(32).random((b, 1, sq, sk)) > 0.3).at[1, 0, 4].set(False)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    for kw in ({"causal": True}, {"mask": mask, "masked_rows": "average"}):
        (out, grads), (want, grads_ref) = (value_and_grads(lambda *a, **kw: attention(*a, out_dtype=jnp.float32, **kw),
                                                           (q, k, v), do.astype(jnp.float32), **kw),
                                           value_and_grads(reference, f32, do.astype(jnp.float32), **kw))
        assert out.dtype == jnp.float32 and all(g.dtype == jnp.bfloat16 for g in grads)
        close(out, want, jnp.bfloat16)
        rounded = attention(q, k, v, **kw).astype(jnp.float32)
        assert np.mean(np.abs(out - want)) < 0.6 * np.mean(np.abs(rounded - want))
        for g, w in zip(grads, grads_ref):
            close(g, w, jnp.bfloat16)
    q1 = q[:, :1]  # a decode step: the split-key forward, merged in float32
    out = attention(q1, k, v, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    close(out, reference(q1.astype(jnp.float32), *f32[1:]), jnp.bfloat16)
    with pytest.raises(TypeError, match="out_dtype must be q's dtype \\(bfloat16\\) or float32"):
        attention(q, k, v, out_dtype=jnp.float16)


@pytest.mark.parametrize("spelling", ["flax force_fp32_for_softmax", "np.sqrt(d), float32 out",
                                      "lax.rsqrt(d), probabilities cast back"])
def test_float32_scales_and_probabilities_are_found(spelling):
    """Float32 enters the scores through a float32 scale (numpy's, lax.rsqrt's) or flax's
    force_fp32_for_softmax; where the float32 probabilities weight v, the result is float32 (the
    kernels' out_dtype). Values and gradients as jax.jit's."""
    import flax.linen as nn

    def f(q, k, v):
        if spelling.startswith("flax"):
            return nn.dot_product_attention(q, k, v, force_fp32_for_softmax=True)
        if spelling.startswith("np.sqrt"):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
            return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jax.lax.rsqrt(jnp.float32(q.shape[-1]))
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)

    q, k, v, do = make(2, 19, 19, 2, 2, 16, jnp.bfloat16, seed=33)
    out_dtype = jnp.bfloat16 if "cast back" in spelling else jnp.float32
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern == {"flax force_fp32_for_softmax": "attention/flax.linen.dot_product_attention"
                                                           "+force_fp32_for_softmax",
                             "np.sqrt(d), float32 out": "attention/einsum[bhsd]/divisor+upcast product+float32 out",
                             "lax.rsqrt(d), probabilities cast back": "attention/einsum[bshd]*array+upcast product"
                                                                      "+causal"}[spelling]
    assert xkern.jit(f)(q, k, v).dtype == jax.eval_shape(f, q, k, v).dtype == out_dtype
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    got = xkern.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*(a.astype(jnp.float32) for a in (q, k, v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)


def test_a_scale_passed_to_the_jitted_function_scales_q():
    """A scale the program is given (a Python number passed to the jitted function, traced) cannot
    be the kernels' constant: q is scaled by it (in float32, so its gradient sums precisely), and
    its gradient is jax.jit's."""
    def f(q, k, v, scale):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype), v)

    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in make(2, 19, 19, 2, 2, 16, jnp.bfloat16, seed=26))
    [match] = xkern.explain(f)(q, k, v, 0.3).matches
    assert match.pattern == "attention/einsum[bhsd]*array+float32 softmax" and "scale_value" not in match.params
    loss = lambda q, k, v, s: jnp.sum(f(q, k, v, s).astype(jnp.float32) * do.astype(jnp.float32))
    got = xkern.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(q, k, v, 0.3)
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(*(a.astype(jnp.float32) for a in (q, k, v)), 0.3)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("cap", [None, 0.7], ids=["uncapped", "soft cap"])
def test_masked_rows_bias_gives_the_gradients_of_a_finfo_min_bias(cap):
    """masked_rows="bias": a mask that stands for a bias of finfo.min, rows it hides entirely
    included (their uniform weights pass gradients to q and k through the scores, and through a
    soft cap's slope), with GQA, causal and a mask per head, against the float32 program that adds
    the bias."""
    b, sq, sk, h, hk, d = 2, 19, 23, 4, 2, 16
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.float32, seed=23)
    rng = np.random.default_rng(24)
    mask = jnp.asarray(rng.random((b, h, sq, sk)) > 0.4).at[0, 1, 3].set(False).at[1, :, 5].set(False)

    def added(q, k, v):
        bias = jnp.where(mask & jnp.tril(jnp.ones((sq, sk), bool)), 0.0, jnp.finfo(jnp.float32).min)
        kr, vr = (jnp.repeat(a, h // hk, axis=2) for a in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) * 0.25
        p = jax.nn.softmax((s if cap is None else cap * jnp.tanh(s / cap)) + bias, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vr)

    ours = lambda q, k, v: attention(q, k, v, mask=mask, causal=True, scale=0.25, masked_rows="bias",
                                     logits_soft_cap=cap)
    got, want = value_and_grads(ours, (q, k, v), do), value_and_grads(added, (q, k, v), do)
    assert np.abs(np.asarray(got[1][0][1, 5])).max() > 0  # a hidden row's dq: XLA's, not zero
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(g, w, jnp.float32)


def test_a_small_mask_fill_is_not_taken():
    # -50 does not hide a key exactly (exp(-50 - max) is not 0 for every score): left to XLA.
    q, k, v, _ = make(1, 16, 16, 2, 2, 16, jnp.float32, seed=17)
    mask = jnp.asarray(np.random.default_rng(18).random((1, 2, 16, 16)) > 0.3)
    f = _by_hand_masked("bshd", -50.0, mask, upcast=False)
    report = xkern.explain(f)(q, k, v)
    assert not [m for m in report.matches if m.pattern.startswith("attention/")]
    assert any("fill" in d.reason for d in report.declined)
    close(xkern.jit(f)(q, k, v), jax.jit(f)(q, k, v), jnp.float32)

def test_masked_rows_average_against_the_reference_with_gqa_and_lengths():
    q, k, v, do = make(2, 18, 21, 4, 2, 16, jnp.float32, seed=13)
    mask = jnp.asarray(np.random.default_rng(14).random((2, 1, 18, 21)) > 0.4).at[1, 0, 2].set(False)
    kw = dict(mask=mask, causal=True, kv_lengths=jnp.array([21, 9]), masked_rows="average")
    out, grads = value_and_grads(attention, (q, k, v), do, **kw)
    want, grads_ref = value_and_grads(reference, (q, k, v), do, **kw)
    close(out, want, jnp.float32)
    for g, w in zip(grads, grads_ref):
        close(g, w, jnp.float32)
    with pytest.raises(ValueError, match="masked_rows must be one of"):
        attention(q, k, v, masked_rows="mean")


def test_attention_with_dropout_applies_the_programs_random_bits():
    """Dropout on the probabilities (flax's dropout_rate with a padding mask, nn.Dropout on the
    weights, a multiplier by hand): the program's multiplier goes to the kernels, so values and
    gradients are jax.jit's, random bits included. A multiplier computed from a float input (which
    could want a gradient) is declined, saying why; without dropout the programs are fused too."""
    import flax.linen as nn

    class ByHand(nn.Module):
        @nn.compact
        def __call__(self, q, k, v, train):
            probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3, axis=-1)
            probs = nn.Dropout(0.2)(probs, deterministic=not train)
            return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

    padding = jnp.arange(16)[None, None, None, :] < jnp.array([16, 0])[:, None, None, None]  # entry 1: none

    def flax_mha(q, k, v, train):
        return nn.dot_product_attention(q, k, v, mask=padding, dropout_rng=jax.random.key(3), dropout_rate=0.1,
                                        deterministic=not train)

    def multiplier(q, k, v, train):
        probs = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype), -1)
        keep = jax.random.bernoulli(jax.random.key(4), 0.9, probs.shape[-2:])
        return jnp.einsum("bhqk,bhkd->bhqd", probs * (keep / 0.9).astype(q.dtype) if train else probs, v)

    q, k, v, _ = make(2, 16, 16, 2, 2, 16, jnp.bfloat16, seed=10)
    programs = {"flax": flax_mha, "nn.Dropout": lambda q, k, v, train: ByHand().apply(
                    {}, q, k, v, train, rngs={"dropout": jax.random.key(5)}), "multiplier": multiplier}
    for name, f in programs.items():
        for train in (True, False):
            g = lambda q, k, v: f(q, k, v, train)
            report = xkern.explain(g)(q, k, v)
            fused = [m.pattern for m in report.matches if m.pattern.startswith("attention/")]
            assert len(fused) == 1 and ("dropout" in fused[0]) == train, (name, report)
            close(xkern.jit(g)(q, k, v), jax.jit(g)(q, k, v), jnp.bfloat16)
            if train:
                loss = lambda q, k, v: jnp.sum(g(q, k, v).astype(jnp.float32) * v)
                for got, want in zip(xkern.jit(jax.grad(loss, (0, 1, 2)))(q, k, v),
                                     jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)):
                    close(got, want, jnp.bfloat16)
    learned = lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.einsum(
        "bqhd,bkhd->bhqk", q, k) * 0.25, -1) * (jax.random.bernoulli(jax.random.key(1), 0.9, (16, 16))
                                                 * jnp.mean(v)).astype(v.dtype), v)  # a "multiplier" reading v
    report = xkern.explain(learned)(q, k, v)
    assert not any(m.pattern.startswith("attention/") for m in report.matches)
    assert any("dropout multiplier is computed from a floating-point input" in d.reason for d in report.declined)


def test_dropout_multiplier_values_and_gradients_against_the_reference(rng):
    """xkern.ops.attention's dropout: a multiplier of every broadcast shape, with causal masking, a
    key padding mask that empties a batch entry (masked_rows="average": the dropped mean), a bias
    and GQA; flax's rate-and-rng form draws flax's bits; bad arguments name themselves."""
    from xkern.kernels import attention as A
    for b, sq, sk, h, hk, shape, causal in [(2, 19, 23, 4, 2, (1, 1, 19, 23), False),
                                            (2, 17, 17, 2, 1, (2, 2, 17, 17), True), (2, 9, 21, 2, 2, (21,), False)]:
        q, k, v, _ = make(b, sq, sk, h, hk, 16, jnp.float32, seed=sq)
        multiplier = jnp.asarray((rng.random(shape) < 0.8) / 0.8, jnp.float32)
        mask = jnp.asarray(np.arange(sk)[None, None, None, :] < np.array([sk, 0])[:, None, None, None])
        bias = jnp.asarray(rng.standard_normal((1, h, sq, sk)), jnp.float32)
        kw = dict(causal=causal, mask=mask, bias=bias, masked_rows="average", dropout_multiplier=multiplier)
        f = lambda q, k, v, bias: attention(q, k, v, **{**kw, "bias": bias})
        r = lambda q, k, v, bias: A.reference(q, k, v, **{**kw, "bias": bias})
        close(jax.jit(f)(q, k, v, bias), r(q, k, v, bias), jnp.float32)
        grads = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), (0, 1, 2, 3)))
        for got, want in zip(grads(f)(q, k, v, bias), grads(r)(q, k, v, bias)):
            close(got, want, jnp.float32)
        batched = jax.jit(jax.vmap(lambda q: attention(q, k, v, **kw)))(jnp.stack([q, -q]))
        close(batched[1], r(-q, k, v, bias), jnp.float32)
    import flax.linen as nn
    q, k, v, _ = make(2, 12, 12, 2, 2, 16, jnp.float32, seed=3)
    for broadcast in (True, False):
        got = attention(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(7), broadcast_dropout=broadcast)
        want = nn.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(7),
                                        broadcast_dropout=broadcast, deterministic=False)
        close(got, want, jnp.float32)
    with pytest.raises(ValueError, match="dropout_rate must be a number in"):
        attention(q, k, v, dropout_rate=1.0, dropout_rng=jax.random.key(0))
    close(attention(q, k, v, dropout_rate=np.float32(0.3), dropout_rng=jax.random.key(7)),  # a NumPy scalar
          attention(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(7)), jnp.float32)
    with pytest.raises(ValueError, match="needs dropout_rng"):
        attention(q, k, v, dropout_rate=0.1)
    close(attention(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(7)),  # a raw uint32 key
          nn.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(7),
                                   deterministic=False), jnp.float32)
    with pytest.raises(TypeError, match="dropout_rng must be a jax.random key .* got int"):
        attention(q, k, v, dropout_rate=0.1, dropout_rng=3)
    with pytest.raises(TypeError, match="bias must be a real .* got complex64"):
        attention(q, k, v, bias=jnp.ones((12, 12), jnp.complex64))
    with pytest.raises(TypeError, match="causal must be a bool; got 'yes'"):
        attention(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="dropout_multiplier must be a floating-point array"):
        attention(q, k, v, dropout_multiplier=jnp.ones((12, 12), bool))
    with pytest.raises(ValueError, match="dropout_multiplier must broadcast to"):
        attention(q, k, v, dropout_multiplier=jnp.ones((3, 12, 12)))


@pytest.mark.parametrize("scale", [np.inf, np.nan, 0.0])
def test_scores_scaled_by_no_positive_finite_number_run_as_written(scale):
    """A constant scale of inf, NaN or 0 is not one the kernels take: declined with its reason (not
    an error), and the program is jax.jit's."""
    q, k, v, _ = make(1, 16, 16, 2, 2, 16, jnp.float32, seed=5)
    f = lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(
        jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, -1), v)
    report = xkern.explain(f)(q, k, v)
    assert not [m for m in report.matches if m.op == "attention"]
    assert any("take a positive finite scale" in d.reason for d in report.declined)
    got = xkern.jit(f)(q, k, v)
    if np.isnan(scale):  # (every score NaN; jaxlib 0.10 CPU's fused row max can drop a NaN, so not jax.jit)
        assert np.isnan(got).all()
    else:
        close(got, jax.jit(f)(q, k, v), jnp.float32)


def test_attention_near_misses_are_not_rewritten():
    q, k, v, _ = make(1, 16, 16, 2, 2, 16, jnp.float32, seed=9)
    softmax_av = lambda s, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    near_misses = {
        # softmax over the query axis
        "other axis": lambda q, k, v: jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(
            jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25, axis=-2), v),
        # the causal mask on the wrong side (keys after the query)
        "anti-causal": lambda q, k, v: softmax_av(jnp.where(jnp.triu(jnp.ones((16, 16), bool)),
                                                            jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -jnp.inf), v),
    }
    for name, f in near_misses.items():
        report = xkern.explain(f)(q, k, v)
        found = [m.pattern for m in report.matches if m.pattern.startswith("attention/")]
        if name == "anti-causal":  # not causal; a constant boolean mask applied by `where`, and so taken
            assert found == ["attention/einsum[bshd]+mask(broadcast)"], found
        else:
            assert not found, name
        close(xkern.jit(f)(q, k, v), jax.jit(f)(q, k, v), jnp.float32)


@pytest.mark.parametrize("spelling", ["[b,q,h,k], q scaled, a key mask broadcast", "[b,h,q,k], q scaled",
                                      "[b,h,q,k], causal, q scaled", "[b,h,q,k], cast after the cap"])
def test_soft_capped_scores_in_more_spellings(spelling):
    """Gemma 2's cap tanh(s / c) * c where q carries the scale (as the gemma library scales it) in
    either scores layout, with a key mask [b, k] broadcast over the queries, causal, or the capped
    scores cast to float32 before the mask: the kernels take the cap; values and gradients as
    jax.jit's in float32."""
    b, t, h, d, cap = 2, 20, 4, 8, 5.0
    q, k, v, do = make(b, t, t, h, h, d, jnp.bfloat16, seed=31)
    q, k = q * 3, k * 3  # scores of a few caps
    keys = jnp.arange(t)[None, :] < jnp.array([7, 20])[:, None]
    bqhk = spelling.startswith("[b,q,h,k]")
    qk, pv = ("bqhd,bkhd->bqhk", "bqhk,bkhd->bqhd") if bqhk else ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")

    def f(q, k, v, keys):
        if "q scaled" in spelling:
            q = q * d ** -0.5
        s = jnp.einsum(qk, q, k)
        s = s if "q scaled" in spelling else s * d ** -0.5
        s = jnp.tanh(s / cap) * cap
        s = s.astype(jnp.float32) if "cast after" in spelling else s
        if "causal" in spelling:
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -2.3819763e38)
        else:
            s = jnp.where(keys[:, None, None, :], s, -2.3819763e38)
        return jnp.einsum(pv, jax.nn.softmax(s, -1).astype(v.dtype), v)
    [match] = [m for m in xkern.explain(f)(q, k, v, keys).matches if m.op == "attention"]
    assert match.params.get("cap") == cap, match
    matches_float32_jax_jit(f, q, k, v, keys, do)


def test_float32_queries_against_a_bfloat16_cache_as_jnp_promotes_them():
    """float32 queries against a bfloat16 cache (jnp promotes k and v inside the einsums, a float32
    result): taken, k and v promoted as jnp does, in a prefill and a decode step (the split-key
    kernel); values and gradients as jax.jit's. Queries narrower than the cache (bfloat16 q, float32
    k and v: the program rounds q's scale in bfloat16) are declined, saying what the kernels take."""
    q, _, _, do = make(2, 5, 5, 4, 4, 8, jnp.float32, seed=2)
    _, k, v, _ = make(2, 16, 16, 4, 4, 8, jnp.bfloat16, seed=3)
    lengths = jnp.array([5, 16])

    def step(q, k, v, lengths):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        s = jnp.where(jnp.arange(16)[None, None, None] < lengths[:, None, None, None], s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    for rows, kernel in ((5, "attention_fwd"), (1, "attention_fwd_split_kv")):
        report = xkern.explain(step)(q[:, :rows], k, v, lengths)
        assert kernel in report.kernels, report
        close(xkern.jit(step)(q[:, :rows], k, v, lengths), jax.jit(step)(q[:, :rows], k, v, lengths), jnp.float32)
    loss = lambda q, k, v: jnp.sum(step(q, k, v, lengths) * do)
    for got, want in zip(jax.jit(jax.grad(xkern.optimize(loss), (0, 1, 2)))(q, k, v),
                         jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)):
        assert got.dtype == want.dtype
        close(got, want, jnp.float32 if want.dtype == jnp.float32 else jnp.bfloat16)
    narrow = xkern.explain(step)(q.astype(jnp.bfloat16), k.astype(jnp.float32), v.astype(jnp.float32), lengths)
    assert not [m for m in narrow.matches if m.op == "attention"]
    assert any("the kernels take k and v promoted to q's dtype where q's is the widest" in d.reason
               for d in narrow.declined), narrow


@pytest.mark.skipif(not L.INTERPRET, reason="interpreter tiles; on a GPU, test_warp_specialized_kernels_on_hopper")
@pytest.mark.parametrize("shape", [(2, 40, 48, 2, 2, 32), (1, 37, 32, 4, 2, 32), (2, 16, 64, 2, 1, 64)],
                         ids=["odd queries", "gqa", "mqa"])
def test_warp_specialized_forward_matches_the_reference(shape):
    """The Hopper forward (TMA loads of 2-D views, one unmasked loop over every key block) runs
    through the interpreter too: queries past sq read the next batch's rows and are never stored."""
    import dataclasses
    from xkern.kernels import attention as A
    b, sq, sk, h, hk, d = shape
    q, k, v, _ = make(b, sq, sk, h, hk, d, jnp.float32, seed=4)
    st = A.Static(False, d ** -0.5, None, None, False, "interpret", A.default_configs(d, "interpret"))
    fwd = st.configs[0].replace(WS=1)
    assert sk % fwd["BLOCK_N"] == 0
    ws = dataclasses.replace(st, configs=(fwd,) + st.configs[1:])
    o, lse = A._launch_fwd(q, k, v, None, None, None, None, None, ws)
    close(o, reference(q, k, v), jnp.float32)
    o2, lse2 = A._launch_fwd(q, k, v, None, None, None, None, None, st)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), rtol=0, atol=1e-5)
    sinks = jnp.asarray(np.random.default_rng(5).standard_normal((b, h, sq)), jnp.float32)  # counted after the loop
    o, _ = A._launch_fwd(q, k, v, None, None, None, None, None, ws, sinks)
    close(o, reference(q, k, v, sinks=sinks[..., None]), jnp.float32)


@pytest.mark.skipif(not L.INTERPRET, reason="interpreter tiles; on a GPU, test_warp_specialized_kernels_on_hopper")
@pytest.mark.parametrize("shape,dkdv_keys", [((2, 48, 48, 2, 2, 32), 16), ((1, 32, 32, 4, 2, 32), 32)],
                         ids=["mha", "gqa, smaller diagonal tiles"])  # (the forward's: 16 of 32)
def test_warp_specialized_causal_kernels_add_the_diagonal_after(shape, dkdv_keys):
    """Causal: the warp-specialized loops take the blocks off the diagonal (forward: keys left of
    each query block's diagonal block; dk/dv: queries below each key block's), then _fwd_diagonal
    resumes the softmax from (o, lse) and _dkdv_diagonal adds to dk and dv the diagonal blocks,
    masked; through the interpreter, against the reference and the two-loop kernel's lse."""
    import dataclasses
    from xkern.kernels import attention as A
    b, sq, sk, h, hk, d = shape
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.float32, seed=9)
    st = A.Static(True, d ** -0.5, None, None, False, "interpret", A.default_configs(d, "interpret"))
    ws = dataclasses.replace(st, configs=(st.configs[0].replace(WS=1, BLOCK_M=dkdv_keys),
                                          st.configs[1].replace(WS=1, BLOCK_N=dkdv_keys),
                                          st.configs[2].replace(WS=1, BLOCK_M=dkdv_keys)))
    o, lse = A._launch_fwd(q, k, v, None, None, None, None, None, ws)
    close(o, reference(q, k, v, causal=True), jnp.float32)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(A._launch_fwd(q, k, v, None, None, None, None, None, st)[1]),
                               rtol=0, atol=1e-5)
    backward = lambda q, k, v: jax.vjp(lambda *a: A._attention(*a, None, None, None, None, None, ws), q, k, v)[1](do)
    want = jax.jit(lambda q, k, v: jax.vjp(lambda *a: reference(*a, causal=True), q, k, v)[1](do))(q, k, v)
    for g, w in zip(jax.jit(backward)(q, k, v), want):
        close(g, w, jnp.float32)
    assert {"attention_dkdv_diagonal", "attention_dq_diagonal"} <= set(kernel_names(jax.make_jaxpr(backward)(q, k, v)))
    batched = jax.vmap(lambda k: backward(q, k, v)[:2])(jnp.stack([k, k]))
    close(batched[0][1], want[0], jnp.float32)
    close(batched[1][1], want[1], jnp.float32)
    launched = kernel_names(jax.make_jaxpr(lambda *a: A._launch_fwd(*a, None, None, None, None, None, ws))(q, k, v))
    assert launched == ["attention_fwd", "attention_fwd_diagonal"]
    batched = jax.vmap(lambda q: A._launch_fwd(q, k, v, None, None, None, None, None, ws)[0])(jnp.stack([q, -q]))
    close(batched[1], reference(-q, k, v, causal=True), jnp.float32)


@pytest.mark.skipif(not L.INTERPRET, reason="interpreter tiles; on a GPU, test_values_and_gradients' soft cap cases")
@pytest.mark.parametrize("causal", [False, True])
def test_warp_specialized_kernels_take_a_soft_cap(causal):
    """A soft cap is no masking: the warp-specialized kernels (and, causal, the diagonal ones after
    them) cap the scores in their loops, the backward's multiply ds by the cap's slope; forward and
    every gradient against the reference, lse against the two-loop kernel's."""
    import dataclasses
    from xkern.kernels import attention as A
    b, sq, sk, h, hk, d = 2, 32, 32, 2, 1, 32
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.float32, seed=34)
    q = q * 3
    st = A.Static(causal, d ** -0.5, None, None, False, "interpret", A.default_configs(d, "interpret"), softcap=1.5)
    ws = dataclasses.replace(st, configs=(st.configs[0].replace(WS=1),) + st.configs[1:])
    o, lse = A._launch_fwd(q, k, v, None, None, None, None, None, ws)
    close(o, reference(q, k, v, causal=causal, logits_soft_cap=1.5), jnp.float32)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(A._launch_fwd(q, k, v, None, None, None, None, None, st)[1]),
                               rtol=0, atol=1e-5)
    ws = dataclasses.replace(ws, configs=(ws.configs[0], st.configs[1].replace(WS=1), st.configs[2].replace(WS=1)))
    backward = lambda q, k, v: jax.vjp(lambda *a: A._attention(*a, None, None, None, None, None, ws), q, k, v)[1](do)
    want = jax.vjp(lambda *a: reference(*a, causal=causal, logits_soft_cap=1.5), q, k, v)[1](do)
    for g, w in zip(jax.jit(backward)(q, k, v), want):
        close(g, w, jnp.float32)
    assert {"attention_dkdv_diagonal", "attention_dq_diagonal"} <= set(
        kernel_names(jax.make_jaxpr(backward)(q, k, v))) or not causal
    assert A.Static(False, 1.0, None, None, False, "triton", (), softcap=1.5).fit(q, k)["unmasked_keys"] == sk


def test_gluon_forward_is_offered_first_only_where_it_applies():
    """attention_hopper's forward (Gluon) is the first candidate on a Hopper GPU for 16-bit problems
    at head dims 128 and 256 without masking whose key count its key block (128; 64 at head dim 256)
    divides, and for causal ones with as many queries as keys (a multiple of its 128-row block);
    never with a soft cap, masks, float32, head dim 64 (where it lost), other key counts, without
    TMA, on AMD's GPUs or in the interpreter. Static.fit says whether scores are capped."""
    import dataclasses
    from xkern.kernels import attention as A
    first = lambda d=128, gpu="cuda", **kw: dict(A.candidates("fwd", d, "triton", gpu, **kw)[0].meta).get("GLUON")
    assert first(unmasked_keys=4096) and first(unmasked_keys=384) and first(causal_square=4096)
    assert first(causal_square=4096, unmasked_keys=0, mask=False, bias=False)
    assert first(d=256, unmasked_keys=4096) and first(d=256, unmasked_keys=320) and first(d=256, causal_square=384)
    for refused in (dict(unmasked_keys=4000), dict(causal_square=4000), dict(unmasked_keys=4096, capped=True),
                    dict(causal_square=4096, capped=True), dict(unmasked_keys=4096, itemsize=4),
                    dict(unmasked_keys=4096, tma=False), dict(d=64, unmasked_keys=4096),
                    dict(d=256, unmasked_keys=4000), dict(d=256, causal_square=4032), dict(d=256, unmasked_keys=4096,
                    itemsize=4), dict(gpu="rocm", unmasked_keys=4096), dict(window_keys=4096), {}):
        assert not first(**refused), refused
    assert not any(dict(c.meta).get("GLUON") for c in A.candidates("fwd", 128, "interpret", unmasked_keys=4096))
    for d, exact in ((128, 164112), (256, 196880)):  # (sm_90 builds)
        config = [c for c in A.candidates("fwd", d, "triton", "cuda", unmasked_keys=4096) if dict(c.meta).get("GLUON")]
        assert len(config) == 1 and config[0]["BLOCK_D"] == d
        assert exact <= A.shared_bytes("fwd", config[0], 2, False, False) <= A.shared_memory_limit("cuda")
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    plain = A.Static(False, 0.1, None, None, False, "triton", ())
    assert not plain.fit(q, q)["capped"] and dataclasses.replace(plain, softcap=30.0).fit(q, q)["capped"]


def test_gluon_backward_is_offered_first_only_where_it_applies():
    """attention_hopper's backward (Gluon: dk, dv and dq in one kernel) is the first dk/dv candidate
    on a Hopper GPU for 16-bit problems at head dims 64 and 128 without masking whose key count its
    128-key block and whose query count its 64-row block divide, and for causal ones with as many
    queries as keys (a multiple of 128); at 256 its wide kernel, in 64-key programs, where
    BWD_WIDE; not for other query counts. Its shared memory (k, v, the q/do ring, dS^T and dQ
    halves; the wide one's P^T and dS^T and dQ's chunks) fits the H200's; the tuner then times no dq
    candidates, since none would run."""
    from xkern.kernels import attention as A
    from xkern.kernels import attention_hopper as AH
    first = lambda d=128, gpu="cuda", **kw: dict(A.candidates("dkdv", d, "triton", gpu, **kw)[0].meta).get("GLUON")
    assert first(unmasked_keys=4096, unmasked_queries=4096) and first(unmasked_keys=384, unmasked_queries=192)
    assert first(causal_square=4096) and first(causal_square=384)
    assert first(d=64, causal_square=4096) and first(d=64, unmasked_keys=384, unmasked_queries=192)
    for refused in (dict(unmasked_keys=4096, unmasked_queries=4000), dict(unmasked_keys=4096),
                    dict(unmasked_keys=4000, unmasked_queries=4096), dict(causal_square=4032),
                    dict(causal_square=4096, capped=True), dict(causal_square=4096, itemsize=4),
                    dict(causal_square=4096, tma=False), dict(d=64, causal_square=4096, capped=True),
                    dict(gpu="rocm", causal_square=4096), dict(window_keys=4096), {}):
        assert not first(**refused), refused
    # at 256 the wide kernel (64-key programs) where BWD_WIDE, each such count a multiple of 64
    wide = _gluon_backward_at(256)
    for taken in (dict(causal_square=4096), dict(causal_square=320), dict(unmasked_keys=320, unmasked_queries=192)):
        assert bool(first(d=256, **taken)) == wide, taken
    for refused in (dict(causal_square=4000), dict(unmasked_keys=4096, unmasked_queries=4000),
                    dict(causal_square=4096, capped=True)):
        assert not first(d=256, **refused), refused
    assert not any(dict(c.meta).get("GLUON") for c in A.candidates("dkdv", 128, "interpret", causal_square=4096))
    assert not any(dict(c.meta).get("GLUON") for c in A.candidates("dq", 128, "triton", "cuda", causal_square=4096))
    config = A.candidates("dkdv", 128, "triton", "cuda", causal_square=4096)[0]
    assert 198000 <= A.shared_bytes("dkdv", config, 2, False, False) <= A.shared_memory_limit("cuda")  # (sm_90 build)
    config = A.candidates("dkdv", 64, "triton", "cuda", causal_square=4096)[0]
    assert 116080 <= A.shared_bytes("dkdv", config, 2, False, False) <= A.shared_memory_limit("cuda")  # (sm_90 build)
    wide = AH.bwd_config(256)
    assert 230800 <= A.shared_bytes("dkdv", wide, 2, False, False) <= A.shared_memory_limit("cuda")  # (sm_90 build)
    # the Triton dk/dv stays next: the tuner times both
    assert dict(A.candidates("dkdv", 128, "triton", "cuda", causal_square=4096)[1].meta).get("WS")


def test_warp_specialized_forward_is_offered_only_where_it_applies():
    """First candidate on a TMA GPU for 16-bit problems without masking at head dims 128 and 256
    (where it won on the H200) and for causal ones with as many queries as keys (a multiple of its
    BLOCK_M); never under masks, biases, kv_lengths, float32, head dim 64, key counts its tile does
    not divide, or without TMA."""
    import dataclasses
    from xkern.kernels import attention as A
    ws = lambda d, **kw: [c for c in A.candidates("fwd", d, "triton", "cuda", **kw) if dict(c.meta).get("WS")]
    # at head dim 128 the Gluon forward (attention_hopper) comes first, the warp-specialized one next
    assert ws(128, unmasked_keys=4096)[0] == A.candidates("fwd", 128, "triton", "cuda", unmasked_keys=4096)[1]
    assert ws(256, unmasked_keys=4096) and ws(256, unmasked_keys=4096)[0].num_warps == 4
    assert not ws(128, unmasked_keys=4096, tma=False)
    assert not ws(128, unmasked_keys=4096, itemsize=4)
    assert not ws(64, unmasked_keys=4096)
    assert not ws(128, unmasked_keys=4000)
    assert not ws(128) and not any(c["WS"] for c in A.candidates("fwd", 128, "triton", "rocm", unmasked_keys=4096))
    # WS carries the stage count: hopper.free_dead_barriers frees that many unused barriers (1 to 4)
    assert all(1 <= c["WS"] == c.num_stages <= 4 for d in (128, 256) for kernel in ("fwd", "dkdv", "dq")
               for c in A.candidates(kernel, d, "triton", "cuda", unmasked_keys=4096, unmasked_queries=4096)
               if dict(c.meta).get("WS"))
    dq = lambda d, **kw: A.candidates("dq", d, "triton", "cuda", **kw)[0]["WS"]  # at d128 not causal (won there)
    assert dq(256, unmasked_keys=4096, unmasked_queries=4096) and dq(256, causal_square=4096)
    assert dq(128, unmasked_keys=4096, unmasked_queries=4096) and not dq(128, causal_square=4096)
    assert not dq(64, unmasked_keys=4096, unmasked_queries=4096) and not dq(256, causal_square=4000)
    assert not dq(256, unmasked_keys=4096, unmasked_queries=4000) and not dq(256, unmasked_keys=4096)
    dkdv = lambda **kw: next(dict(c.meta).get("WS") for c in A.candidates("dkdv", 128, "triton", "cuda", **kw)
                             if not dict(c.meta).get("GLUON"))  # (after attention_hopper's backward, at d128)
    assert dkdv(unmasked_keys=4096, unmasked_queries=4096)
    assert not dkdv(unmasked_keys=4096, unmasked_queries=4000) and not dkdv(unmasked_keys=4096)
    assert ws(128, causal_square=4096) and ws(256, causal_square=4096)
    assert not ws(128, causal_square=4000) and dkdv(causal_square=4096) and not dkdv(causal_square=4000)
    q, k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16), jnp.zeros((1, 512, 2, 128), jnp.bfloat16)
    plain = A.Static(False, 0.1, None, None, False, "triton", ())
    assert plain.fit(q, k)["unmasked_keys"] == 512 and plain.fit(q, k)["causal_square"] == 0
    causal = dataclasses.replace(plain, causal=True)
    assert causal.fit(q, q)["causal_square"] == 256 and causal.fit(q, k)["causal_square"] == 0
    assert dataclasses.replace(causal, has_kv_len=True).fit(q, q)["causal_square"] == 0
    for other in (dict(causal=True), dict(has_kv_len=True), dict(mask_bh=(False, False)), dict(bias_bh=(True, True))):
        assert dataclasses.replace(plain, **other).fit(q, k)["unmasked_keys"] == 0, other


@pytest.mark.skipif(not L.INTERPRET, reason="interpreter tiles; on a GPU, test_warp_specialized_kernels_on_hopper")
def test_warp_specialized_backward_matches_the_reference():
    """dk/dv with the query heads of a group and their blocks flattened into one warp-specialized
    loop, and dq with one (TMA loads; lse and delta as 1-D views), through the interpreter: dq, dk
    and dv against the reference, GQA included (the test above covers when they are offered)."""
    import dataclasses
    from xkern.kernels import attention as A
    for b, sq, sk, h, hk, d in [(2, 32, 48, 2, 2, 32), (1, 48, 32, 4, 2, 32)]:
        q, k, v, do = make(b, sq, sk, h, hk, d, jnp.float32, seed=5)
        st = A.Static(False, d ** -0.5, None, None, False, "interpret", A.default_configs(d, "interpret"))
        o, lse = A._launch_fwd(q, k, v, None, None, None, None, None, st)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
        ws = dataclasses.replace(st, configs=(st.configs[0], st.configs[1].replace(WS=1),
                                              st.configs[2].replace(WS=1)))
        dq, dk, dv = A._launch_bwd(q, k, v, None, None, None, None, None, do, lse, delta, ws)
        for got, want in zip((dq, dk, dv), jax.jit(lambda *a: jax.vjp(reference, *a)[1](do))(q, k, v)):
            close(got, want, jnp.float32)



def _gluon_backward_at(head_dim: int) -> bool:
    """Whether attention_hopper's backward takes problems at this head dim (256: where BWD_WIDE)."""
    from xkern.kernels import attention_hopper as AH
    return head_dim in AH.BWD_HEAD_DIMS or (head_dim == 256 and bool(AH.BWD_WIDE))


def _bf16_against_the_reference_with_launches(shape, seed, **options) -> dict:
    """attention(**options) on random bfloat16 inputs: values and every gradient against the float32
    reference; returns the forward+backward's launches as {kernel: its config's meta}."""
    q, k, v, do = make(*shape, jnp.bfloat16, seed=seed)
    f = lambda q, k, v: attention(q, k, v, **options)
    want_o, vjp = jax.vjp(lambda *a: reference(*(x.astype(jnp.float32) for x in a), **options), q, k, v)
    got_o, got_vjp = jax.vjp(f, q, k, v)
    close(got_o, want_o, jnp.bfloat16)
    for got, want in zip(got_vjp(do), vjp(do.astype(jnp.float32))):
        close(got, want, jnp.bfloat16)
    return {e.params["kernel"]: dict(e.params["config"].meta)
            for e in L.launches(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1](do))(q, k, v))}


@pytest.mark.skipif(not L.tma_supported(), reason="needs a GPU with TMA (Hopper): the tiles the H200 runs")
@pytest.mark.parametrize("shape,causal,cap,sinks", [((1, 256, 256, 4, 2, 128), False, None, False),
                                                    ((1, 256, 256, 4, 2, 128), True, None, False),
                                                    ((1, 256, 256, 2, 2, 256), False, None, False),
                                                    ((1, 256, 256, 2, 1, 256), True, None, False),
                                                    ((1, 256, 256, 4, 2, 128), False, 2.0, False),
                                                    ((1, 256, 256, 4, 2, 128), True, 2.0, False),
                                                    ((1, 256, 256, 4, 2, 128), False, None, True),
                                                    ((1, 256, 256, 4, 2, 128), True, None, True)],
                         ids=["d128", "d128 causal", "d256", "d256 causal mqa", "d128 soft cap", "d128 causal soft cap",
                              "d128 sinks", "d128 causal sinks"])
def test_warp_specialized_kernels_on_hopper(shape, causal, cap, sinks):
    """On a Hopper GPU the public op picks the warp-specialized kernels at the tiles measured there
    (the interpreter tests above run their source at 16-wide tiles), where attention_hopper's Gluon
    kernels do not take the pass: values and every gradient against the float32 reference, and the
    launches' configs say which kernels ran. A soft cap (of
    2: the scores bend) takes them too, its tanh PTX's, and so do sinks (here per row)."""
    d = shape[-1]
    sink = jnp.asarray(np.random.default_rng(12).standard_normal((1, shape[3], shape[1], 1)), jnp.float32)
    ran = _bf16_against_the_reference_with_launches(shape, 11, causal=causal, logits_soft_cap=cap,
                                                    sinks=sink if sinks else None)
    ws = {kernel: bool(meta.get("WS")) for kernel, meta in ran.items()}  # WS: the stage count, or 0
    gluon = not cap  # attention_hopper's forward (head dims 128 and 256), causal diagonal included
    gluon_bwd = _gluon_backward_at(d) and not cap  # and its backward (64 and 128; 256 where BWD_WIDE)
    assert bool(ran["attention_fwd"].get("GLUON")) == gluon and ws["attention_fwd"] != gluon
    assert bool(ran["attention_bwd_dkdv"].get("GLUON")) == gluon_bwd and ("attention_bwd_dq" in ran) != gluon_bwd
    assert gluon_bwd or ws["attention_bwd_dq"] == (d == 256 or not causal)
    assert ws["attention_bwd_dkdv"] == (d == 128 and not gluon_bwd)
    assert ("attention_fwd_diagonal" in ran) == (causal and not gluon)


@pytest.mark.skipif(not L.hopper(), reason="needs a Hopper GPU (wgmma); the interpreter cannot run Gluon")
@pytest.mark.parametrize("shape,options", [((2, 200, 384, 4, 4, 128), {}),
                                           ((2, 192, 384, 8, 2, 128), {}),
                                           ((3, 384, 384, 2, 1, 128), {"causal": True}),
                                           ((1, 640, 640, 8, 2, 128), {"causal": True, "out_dtype": jnp.float32}),
                                           ((2, 256, 256, 4, 2, 128), {"causal": True, "sinks": "per head"}),
                                           ((2, 200, 320, 2, 1, 256), {}),
                                           ((1, 384, 384, 4, 2, 256), {"causal": True}),
                                           ((2, 192, 320, 4, 2, 256), {}),
                                           ((1, 256, 256, 6, 1, 256), {"causal": True}),
                                           ((2, 192, 384, 4, 2, 64), {}),
                                           ((1, 384, 384, 4, 1, 64), {"causal": True})],
                         ids=["queries past a block, two batches", "gqa, fewer queries than keys",
                              "causal mqa, three batches (6 heads: groups of 4 and 2)", "causal gqa, float32 out",
                              "causal, sinks",
                              "d256, 64-key blocks, queries past a block", "d256 causal gqa",
                              "d256 gqa, 64-row query blocks", "d256 causal mqa",
                              "d64 gqa, the backward alone", "d64 causal mqa, the backward alone"])
def test_gluon_kernels_on_hopper(shape, options):
    """attention_hopper's forward and backward (Gluon; at head dim 256 the forward in 64-key blocks,
    and the wide backward where BWD_WIDE; at 64 the backward alone), where the heuristic picks them: query counts the forward's 128-row block does not
    divide (the rows past a batch's end read the next batch's and are never stored; the backward,
    whose query blocks are 64 rows, declines them), causal with every key block of a query block
    masked on the diagonal (its grid in groups of 4 heads, here also a last group of 2), GQA/MQA, a
    float32 result, sinks; values and every gradient (dq through the backward's float32 reductions)
    against the float32 reference, and under vmap."""
    if options.get("sinks"):
        options = {**options, "sinks": jnp.asarray(np.random.default_rng(3).standard_normal((shape[3],)), jnp.float32)}
    trained = {n: o for n, o in options.items() if n != "out_dtype"}  # (the helper's cotangents are bf16)
    ran = _bf16_against_the_reference_with_launches(shape, 17, **trained)
    assert bool(ran["attention_fwd"].get("GLUON")) == (shape[-1] != 64) and "attention_fwd_diagonal" not in ran
    gluon_bwd = _gluon_backward_at(shape[-1]) and shape[1] % 64 == 0
    assert bool(ran["attention_bwd_dkdv"].get("GLUON")) == gluon_bwd and ("attention_bwd_dq" in ran) != gluon_bwd
    q, k, v, _ = make(*shape, jnp.bfloat16, seed=18)
    stacked = [jnp.stack([x, x[:, ::-1]]) for x in (q, k, v)]
    got = jax.vmap(lambda q, k, v: attention(q, k, v, **options))(*stacked)
    assert got.dtype == options.get("out_dtype", jnp.bfloat16)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * jnp.cos(jnp.arange(shape[-1])))
    grads = jax.vmap(jax.grad(loss(lambda *a: attention(*a, **trained)), argnums=(0, 1, 2)))(*stacked)
    for i in range(2):
        one = [x[i].astype(jnp.float32) for x in stacked]
        close(got[i], reference(*one, **options), jnp.bfloat16)
        want = jax.grad(loss(lambda *a: reference(*a, **trained)), argnums=(0, 1, 2))(*one)
        for g, w in zip(grads, want):
            close(g[i], w, jnp.bfloat16)


def _run_exp2_ptx(ptx: str, x: np.ndarray) -> np.ndarray:
    """attention_hopper.exp2_ptx's PTX executed on float32 inputs, one instruction at a time (numpy
    gives each instruction's float32 result; ex2.approx as exact exp2), 4 inputs per run."""
    def rounded_down(exact):  # add.rm: the float32 at or below the exact sum
        near = exact.astype(np.float32)
        return np.where(near.astype(np.float64) > exact, np.nextafter(near, np.float32(-np.inf)), near)

    def value(regs, token):
        if token.startswith("0f"):
            return np.uint32(int(token[2:], 16)).view(np.float32)
        return int(token) if token.isdigit() else regs[token]
    x = x.reshape(-1, 4)
    regs = {f"${i + 4}": x[:, i].astype(np.float32) for i in range(4)}
    with np.errstate(invalid="ignore", over="ignore"):
        for line in ptx.splitlines():
            line = line.strip().rstrip(";")
            if line in ("{", "}") or line.startswith(".reg"):
                continue
            op, args = line.split(None, 1)
            out, *ins = [a.strip() for a in args.split(",")]
            a = [value(regs, t) for t in ins]
            if op == "max.NaN.f32":
                regs[out] = np.where(np.isnan(a[0]), a[0], np.maximum(a[0], a[1])).astype(np.float32)
            elif op == "add.rm.f32":
                regs[out] = rounded_down(a[0].astype(np.float64) + np.float64(a[1]))
            elif op in ("sub.f32", "mul.f32"):
                f = np.subtract if op == "sub.f32" else np.multiply
                regs[out] = f(*(np.asarray(v).view(np.float32) for v in a)).astype(np.float32)
            elif op == "fma.rn.f32":  # (float64 holds the exact product of two float32s)
                regs[out] = (a[0].astype(np.float64) * np.float64(a[1]) + np.float64(a[2])).astype(np.float32)
            elif op == "mov.b32":
                regs[out] = np.asarray(a[0]).view(np.uint32)
            elif op == "shl.b32":
                regs[out] = (a[0] << np.uint32(a[1])).astype(np.uint32)
            elif op == "ex2.approx.ftz.f32":
                regs[out] = np.exp2(a[0]).astype(np.float32)
            else:
                raise AssertionError(f"an instruction the test does not know: {line}")
    return np.stack([np.asarray(regs[f"${i}"]).view(np.float32) for i in range(4)], 1).reshape(-1)


@pytest.mark.parametrize("poly", [1, 2, 4])
def test_exp2_split_ptx_computes_exp2(poly):
    """The Gluon kernels' exps split between MUFU and the FMA units (attention_hopper.exp2_ptx, in
    use where a config's EXP2 > 0): its instructions, run here in float32, give 2**x within 1e-4
    relative for a softmax's range (x <= 0, and up to 127 above), exactly 1 at 0, 0 at -inf and
    below -126, NaN at NaN; the first `poly` of each 4 by the polynomial, the rest by ex2."""
    from xkern.kernels import attention_hopper as AH

    ptx = AH.exp2_ptx(poly)
    assert ptx.count("ex2.approx") == 4 - poly and ptx.count("add.rm.f32") == poly
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-126, 0, 4000), rng.uniform(-1, 1, 4000), rng.uniform(0, 127.9, 396),
                        np.arange(-126, 1), [0.0, -0.0, -1e-30, -125.99]]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % 4, np.float32)])
    got = _run_exp2_ptx(ptx, x)
    want = np.exp2(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=0)
    assert np.all(got[x == 0] == 1.0)
    edges = np.array([-np.inf, np.nan, -127.0, -126.5, -1e4, np.float32(-3.4e38)] * 4, np.float32)
    got = _run_exp2_ptx(ptx, edges).reshape(-1, 4)[:, :poly].reshape(-1, poly)
    by_poly = edges.reshape(-1, 4)[:, :poly]
    assert np.all(np.isnan(got) == np.isnan(by_poly)) and np.all(got[~np.isnan(by_poly)] == 0.0)


@pytest.mark.skipif(not L.hopper(), reason="needs a Hopper GPU (wgmma); the interpreter cannot run Gluon")
@pytest.mark.parametrize("fwd_poly,bwd_poly", [(2, 0), (2, 2), (1, 1)])
@pytest.mark.parametrize("shape,options", [((2, 192, 384, 8, 2, 128), {}),
                                           ((3, 384, 384, 2, 1, 128), {"causal": True})], ids=["gqa", "causal mqa"])
def test_gluon_exp2_split_on_hopper(shape, options, fwd_poly, bwd_poly, monkeypatch):
    """attention_hopper's kernels with part of their exps by the polynomial (FWD_EXP2, BWD_EXP2 > 0):
    values and every gradient against the float32 reference, as with ex2 alone."""
    from xkern.kernels import attention_hopper as AH

    monkeypatch.setattr(AH, "FWD_EXP2", fwd_poly)
    monkeypatch.setattr(AH, "BWD_EXP2", bwd_poly)  # (and no tuned configs, cached with other splits)
    monkeypatch.setattr(A, "tuned_configs", lambda q, k, st: A.default_configs(q.shape[-1], st.backend, **st.fit(q, k)))
    ran = _bf16_against_the_reference_with_launches(shape, 23, **options)
    assert ran["attention_fwd"].get("EXP2") == fwd_poly and ran["attention_bwd_dkdv"].get("EXP2") == bwd_poly


# Problems whose every tuner candidate is checked on a GPU: (b, sq, sk, h, hk, d), options. The
# masked one takes the two-loop kernels (tile lists), the others the warp-specialized ones where a
# head dim has them, so each kernel's candidates of both kinds run.
CANDIDATE_CASES = {"d64": ((1, 512, 512, 4, 2, 64), {}), "d64 causal": ((1, 512, 512, 4, 2, 64), {"causal": True}),
                   "d128 causal": ((1, 512, 512, 4, 2, 128), {"causal": True}),
                   "d128 key padding": ((2, 300, 300, 4, 2, 128), {"mask": "keys"}),
                   "d256 causal": ((1, 256, 256, 2, 1, 256), {"causal": True}),
                   # where the tuner's check caught a dk/dv tile that 512 queries had passed
                   "d128 s2048": ((2, 2048, 2048, 16, 16, 128), {}),
                   "d128 s2048 causal": ((2, 2048, 2048, 16, 16, 128), {"causal": True})}


@pytest.mark.skipif(L.INTERPRET, reason="the interpreter has one tile; on a GPU the tuner chooses among many")
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("case", list(CANDIDATE_CASES))
def test_every_tuner_candidate_gives_the_reference(case, kernel, monkeypatch):
    """The tuner keeps whichever candidate is fastest without looking at its result, so each config
    it may be offered must give the reference's values and gradients: each kernel's candidates for
    the problem, one after another, the other two kernels at their heuristic configs. (A dk/dv tile
    that did not, at head dim 64 on the H200, was taken out of the lists this way.)"""
    (b, sq, sk, h, hk, d), options = CANDIDATE_CASES[case]
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.bfloat16, seed=7)
    if options.get("mask") == "keys":
        options = {"mask": (jnp.arange(sk) < jnp.array([sk - 45, sk - 100])[:, None])[:, None, None]}
    index = ("fwd", "dkdv", "dq").index(kernel)
    offered = []

    def one_candidate(q, k, st):
        fit = st.fit(q, k)
        offered[:] = A.candidates(kernel, q.shape[-1], st.backend, **fit)
        configs = list(A.default_configs(q.shape[-1], st.backend, **fit))
        if kernel == "dq":  # attention_hopper's backward would give dq itself: the Triton dk/dv then
            configs[1] = next(c for c in A.candidates("dkdv", q.shape[-1], st.backend, **fit)
                              if not dict(c.meta).get("GLUON"))
        configs[index] = offered[tried]
        return tuple(configs)
    monkeypatch.setattr(A, "tuned_configs", one_candidate)
    want_o, want_vjp = jax.vjp(lambda *a: reference(*(x.astype(jnp.float32) for x in a), **options), q, k, v)
    want = (want_o, *want_vjp(do.astype(jnp.float32)))
    tried = 0
    while tried == 0 or tried < len(offered):
        got_o, got_vjp = jax.vjp(lambda *a: attention(*a, **options), q, k, v)
        for name, got_x, want_x in zip(("o", "dq", "dk", "dv"), (got_o, *got_vjp(do)), want):
            err = float(jnp.max(jnp.abs(got_x.astype(jnp.float32) - want_x)))
            bound = TOL[jnp.bfloat16] * max(float(jnp.max(jnp.abs(want_x))), 1.0)
            assert err <= bound, f"{kernel} candidate {offered[tried]}: {name} off by {err:.3g} (bound {bound:.3g})"
        tried += 1
    assert tried > 1  # (a GPU offers several)


# Decoding against a cache: few queries, many keys, one program per chunk of the keys and key head.
DECODE_CASES = {  # name: ((b, sq, sk, h, hk, d), dtype, options)
    "gqa 8/2, one query": ((2, 1, 100, 8, 2, 32), jnp.float32, {}),
    "mha, lengths with an empty cache": ((2, 1, 97, 4, 4, 32), jnp.bfloat16, {"kv_lengths": np.array([37, 0])}),
    "mqa, 3 queries, lengths": ((2, 3, 70, 4, 1, 32), jnp.float16, {"kv_lengths": np.array([70, 5])}),
    "causal (top-left), 2 queries": ((1, 2, 50, 4, 2, 64), jnp.float32, {"causal": True}),
    "key padding mask": ((2, 1, 90, 4, 2, 32), jnp.bfloat16, {"mask": (2, 1, 1, 90)}),
    "mask per head, 2 queries": ((1, 2, 77, 4, 2, 32), jnp.float32, {"mask": (1, 4, 2, 77)}),
    "bias per head, scale": ((2, 2, 90, 4, 2, 32), jnp.float32, {"bias": (2, 4, 2, 90), "scale": 0.3}),
    "a key bias and a bias, lengths": ((2, 2, 90, 4, 2, 32), jnp.float32, {"bias": ((2, 1, 1, 90), (1, 4, 2, 90)),
                                                                           "kv_lengths": np.array([90, 41])}),
    "head dim 40 (padded), 128 keys": ((1, 1, 128, 2, 1, 40), jnp.bfloat16, {}),
    "soft cap, lengths": ((2, 1, 100, 8, 2, 32), jnp.float32, {"kv_lengths": np.array([100, 41]),
                                                               "logits_soft_cap": 0.5}),
    "soft cap, bf16 (PTX tanh on CUDA)": ((2, 1, 130, 8, 2, 64), jnp.bfloat16, {"logits_soft_cap": 0.5}),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_split_key_forward_values_and_gradients(case):
    """The split-key forward (several chunks merged by XLA) against the float32 reference, with the
    usual backward kernels after it; the forward launch is the split-key kernel (in the interpreter,
    with several chunks of 32 keys)."""
    shape, dtype, opts = DECODE_CASES[case]
    q, k, v, do = make(*shape, dtype, seed=7)
    kw = _options(opts, seed=8)
    args = (q, k, v, *kw.pop("bias", ()))
    ours = lambda q, k, v, *b, **kw: attention(q, k, v, bias=None if not b else b[0] if len(b) == 1 else b, **kw)
    ref = lambda q, k, v, *b, **kw: reference(q, k, v, bias=sum(b) if b else None, **kw)
    (forward,) = [e for e in L.launches(jax.make_jaxpr(lambda *a: ours(*a, **kw))(*args))
                  if e.params["kernel"].startswith("attention")]
    assert forward.params["kernel"] == "attention_fwd_split_kv"
    assert forward.params["grid"][0] > 1 or not L.INTERPRET  # a GPU's chunks hold >= 1024 keys
    out, grads = value_and_grads(ours, args, do, **kw)
    want, grads_ref = value_and_grads(ref, [a.astype(jnp.float32) for a in args], do.astype(jnp.float32), **kw)
    assert out.dtype == dtype
    close(out, want, dtype)
    for g, w, a in zip(grads, grads_ref, args):
        assert g.dtype == a.dtype
        close(g, w, dtype)


def test_split_key_forward_takes_sinks():
    """A decode step with sinks (per head, GQA 8/2, an empty cache entry: zero) through the split-key
    kernel, whose merge counts each row's sink as a chunk of its own: values and gradients, the
    sinks' too, against the float32 reference."""
    q, k, v, do = make(2, 1, 100, 8, 2, 32, jnp.bfloat16, seed=9)
    sinks = jnp.asarray(np.random.default_rng(10).standard_normal(8), jnp.float32)
    lengths = jnp.array([100, 0])
    ours = lambda q, k, v, s, kv_lengths: attention(q, k, v, sinks=s, kv_lengths=kv_lengths)
    ref = lambda q, k, v, s, kv_lengths: reference(q, k, v, kv_lengths=kv_lengths, sinks=s)
    (forward,) = [e for e in L.launches(jax.make_jaxpr(ours)(q, k, v, sinks, lengths))
                  if e.params["kernel"].startswith("attention")]
    assert forward.params["kernel"] == "attention_fwd_split_kv"
    out, grads = value_and_grads(ours, (q, k, v, sinks), do, kv_lengths=lengths)
    want, grads_ref = value_and_grads(ref, [a.astype(jnp.float32) for a in (q, k, v, sinks)], do.astype(jnp.float32),
                                      kv_lengths=lengths)
    close(out, want, jnp.bfloat16)
    assert not np.any(np.asarray(out[1]))
    for g, w in zip(grads, grads_ref):
        close(g, w, jnp.bfloat16)


def test_split_key_forward_of_rows_a_far_bias_hides_and_lengths_past_int32():
    """A decode step whose keys a bias of -1e9 all hides (padding given as data): XLA's scores tie,
    so its weights are uniform over every key; the merge weights each chunk by its count of keys
    (each chunk's lse, one float at -1.4e9, kept no count: chunks of 32, 32 and 1 key weighed
    alike). And uint32 lengths past 2^31 are all the keys, not a wrapped negative length."""
    q, k, v, _ = make(2, 1, 65, 4, 2, 16, jnp.float32, seed=11)
    bias = jnp.zeros((2, 1, 1, 65)).at[1].set(-1e9)
    assert "attention_fwd_split_kv" in kernel_names(jax.make_jaxpr(lambda q: attention(q, k, v, bias=bias))(q))
    close(attention(q, k, v, bias=bias), reference(q, k, v, bias=bias), jnp.float32)
    lengths = jnp.array([2**32 - 1, 40], jnp.uint32)
    close(attention(q, k, v, bias=bias, kv_lengths=lengths),
          reference(q, k, v, bias=bias, kv_lengths=jnp.array([65, 40])), jnp.float32)


def test_gradients_with_a_bias_under_jax_enable_x64():
    """With jax_enable_x64 the rows' key counts (rows a large bias lifts keys of) stay float32: the
    backward's cond took a float64 branch and crashed."""
    with jax.enable_x64(True):
        q, k, v, do = make(1, 33, 33, 2, 2, 16, jnp.float32, seed=12)
        bias = jnp.zeros((1, 2, 33, 33), jnp.float32)
        got = jax.grad(lambda q: jnp.sum(attention(q, k, v, bias=bias) * do))(q)
        want = jax.grad(lambda q: jnp.sum(reference(q, k, v, bias=bias) * do))(q)
        assert got.dtype == jnp.float32
        close(got, want, jnp.float32)


@settings(max_examples=4, deadline=None)  # ~6 s each through the interpreter
@given(sq=st.integers(1, 4), sk=st.integers(1, 120), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 8]),
       d=st.sampled_from([16, 24, 64]), option=st.sampled_from(["none", "lengths", "mask", "causal"]),
       seed=st.integers(0, 2**16))
def test_split_key_forward_on_random_decode_shapes(sq, sk, kv_heads, group, d, option, seed):
    """Random decode problems (any cache length, some shorter than a chunk or a block; odd head dims;
    lengths of 0 to past the end; random key masks) against the float32 reference, forward and dq."""
    sk = max(sk, 4 * sq)  # the split-key kernel's problems
    rng = np.random.default_rng(seed)
    q, k, v, do = make(2, sq, sk, kv_heads * group, kv_heads, d, jnp.float32, seed=seed)
    kw = {"lengths": {"kv_lengths": jnp.asarray(rng.integers(0, sk + 3, 2), jnp.int32)},
          "mask": {"mask": jnp.asarray(rng.random((2, 1, 1, sk)) < 0.6)}, "causal": {"causal": True},
          "none": {}}[option]
    assert "attention_fwd_split_kv" in kernel_names(jax.make_jaxpr(lambda q: attention(q, k, v, **kw))(q))
    out, (dq,) = value_and_grads(lambda q, **kw: attention(q, k, v, **kw), (q,), do, **kw)
    want, (dq_ref,) = value_and_grads(lambda q, **kw: reference(q, k, v, **kw), (q,), do, **kw)
    close(out, want, jnp.float32)
    close(dq, dq_ref, jnp.float32)


def test_split_key_forward_edge_values_and_vmap():
    """A NaN query stays NaN in its own row only; a row whose keys are all hidden gets zeros (or the
    mean of the values, masked_rows="average"); inf and large magnitudes in k and v as the reference;
    vmap folds into the batch of the split-key launch."""
    q, k, v, do = make(2, 1, 80, 4, 2, 32, jnp.float32, seed=9)
    q = q.at[0, 0, 1, 3].set(jnp.nan)
    got, want = np.asarray(attention(q, k, v)), np.asarray(reference(q, k, v))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[0, 0, 1]).all()
    close(np.nan_to_num(got), np.nan_to_num(want), jnp.float32)
    q = q.at[0, 0, 1, 3].set(1e4)
    mask = jnp.ones((2, 1, 1, 80), bool).at[1].set(False)  # batch entry 1 sees no key
    for rows in ("zeros", "average"):
        got = attention(q, k, v, mask=mask, masked_rows=rows)
        close(got, reference(q, k, v, mask=mask, masked_rows=rows), jnp.float32)
    assert np.all(np.asarray(attention(q, k, v, mask=mask))[1] == 0)
    big = v.at[0, 5].set(3e4)
    close(attention(q, k, big), reference(q, k, big), jnp.float32)
    qs = jnp.stack([q, -q, q * 0.1])
    lengths = jnp.array([80, 33], jnp.int32)
    f = lambda q: attention(q, k, v, kv_lengths=lengths)
    r = lambda q: reference(q, k, v, kv_lengths=lengths)
    assert any(e.params["kernel"] == "attention_fwd_split_kv" for e in L.launches(jax.make_jaxpr(jax.vmap(f))(qs)))
    close(jax.jit(jax.vmap(f))(qs), jax.jit(jax.vmap(r))(qs), jnp.float32)
    g = jax.jit(jax.vmap(jax.grad(lambda q: jnp.sum(f(q) * do))))(qs)
    close(g, jax.jit(jax.vmap(jax.grad(lambda q: jnp.sum(r(q) * do))))(qs), jnp.float32)


def test_split_key_forward_is_offered_only_for_decoding():
    """Few query rows per key head (queries x group <= SPLIT_KV_ROWS) and many more keys than
    queries: the split-key tiles come first (on both vendors, within shared memory); otherwise the
    usual forward's. The chunk count fills the GPU: more chunks for fewer (batch x key head)s."""
    import dataclasses
    from xkern.kernels import attention as A
    plain = A.Static(False, 0.1, None, None, False, "triton", ())
    fit = lambda sq, sk, h, hk, b=8: plain.fit(jnp.zeros((b, sq, h, 128), jnp.bfloat16),
                                               jnp.zeros((b, sk, hk, 128), jnp.bfloat16))["split_kv"]
    assert fit(1, 8192, 32, 8) == (4, 64, 8192) and fit(4, 8192, 32, 8) == (16, 64, 8192)
    assert fit(1, 8192, 128, 1) is None and fit(2048, 8192, 32, 32) is None and fit(16, 48, 4, 4) is None
    assert dataclasses.replace(plain, causal=True, has_kv_len=True).fit(
        jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 64, 4, 64)))["split_kv"] == (1, 4, 64)
    for gpu, limit in (("cuda", 232448), ("rocm", 65536)):
        for d in (64, 128, 256):
            few = A.candidates("fwd", d, "triton", gpu, limit=limit, split_kv=(4, 8, 32768))
            many = A.candidates("fwd", d, "triton", gpu, limit=limit, split_kv=(4, 512, 32768))
            assert "SPLITS" in dict(few[0].meta) and all(A.shared_bytes("fwd", c, 2, False, False, gpu) <= limit
                                                         for c in few)
            assert few[0]["SPLITS"] > many[0]["SPLITS"] >= 1 and few[0]["BLOCK_M"] == 16
            assert "SPLITS" not in dict(A.candidates("fwd", d, "triton", gpu, limit=limit)[0].meta)
    chunks = lambda programs, keys: A.candidates("fwd", 128, "triton", "cuda",
                                                 split_kv=(4, programs, keys))[0]["SPLITS"]
    assert chunks(8, 3000) == 3 and chunks(8, 1000) == 1  # >= SPLIT_KV_MIN_KEYS keys a chunk
    assert chunks(512, 32768) == 3 and chunks(8, 32768) == 32 and chunks(64, 8192) == 4


def test_jax_nn_decoding_takes_the_split_key_kernel():
    """A decode step as jax.nn spells it (one query against a cache, a key padding mask) is rewritten
    to the split-key kernel and equals jax.jit's result."""
    q, k, v, _ = make(2, 1, 96, 8, 2, 32, jnp.bfloat16, seed=10)
    lengths = jnp.array([40, 96], jnp.int32)
    for step in (lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
                 lambda q, k, v: jax.nn.dot_product_attention(
                     q, k, v, mask=(jnp.arange(96) < lengths[:, None])[:, None, None, :])):
        report = xkern.explain(step)(q, k, v)
        assert "attention_fwd_split_kv" in report.kernels, report
        close(xkern.jit(step)(q, k, v), jax.jit(step)(q, k, v), jnp.bfloat16)


@pytest.mark.parametrize("shape,causal", [((3, 1, 96, 8, 2, 32), False), ((3, 20, 20, 4, 4, 16), False),
                                          ((3, 20, 20, 4, 2, 16), True)],
                         ids=["decode step, gqa", "prefill", "causal prefill, gqa"])
def test_jax_nn_key_value_seq_lengths_are_kv_lengths(shape, causal):
    """jax.nn.dot_product_attention(key_value_seq_lengths=...) is matched and equals jax.jit's result
    and gradients, lengths of 0 (jax.nn then averages every value, padding included, causal or not;
    here also with a NaN query, which jax.nn's fill hides) and past the cache's end included."""
    b, sq, sk, h, hk, d = shape
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.float32, seed=12)
    lengths = jnp.array([sk // 2, 0, sk + 5], jnp.int32)
    f = lambda q, k, v, lengths: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, is_causal=causal)
    report = xkern.explain(f)(q, k, v, lengths)
    assert [m.pattern for m in report.matches] == [
        f"attention/jax.nn.dot_product_attention{'(causal)' if causal else ''}+key_value_seq_lengths"], report
    hidden_nan = q.at[1, 0, 0, 0].set(jnp.nan)  # (jax.nn's dk is NaN there: 0 * NaN; the kernels' is not)
    close(xkern.jit(f)(hidden_nan, k, v, lengths), jax.jit(f)(hidden_nan, k, v, lengths), jnp.float32)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v, lengths) * do))
    grads = lambda f: jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)
    for got, want in zip(grads(xkern.optimize(f)), grads(f)):
        close(got, want, jnp.float32)


@pytest.mark.parametrize("causal, kv", [(False, False), (True, True)], ids=["queries", "causal, queries and keys"])
def test_jax_nn_query_seq_lengths_zero_the_padded_queries(causal, kv):
    """jax.nn.dot_product_attention(query_seq_lengths=...) (and key_value_seq_lengths): each query
    past its length gets zeros and passes no gradient, as jax.nn makes it, whatever its q holds (NaN
    here: jax.nn's dk is NaN then, 0 * NaN, the kernels' is not); lengths of 0 and past the end; GQA."""
    q, k, v, do = make(3, 13, 11, 4, 2, 16, jnp.float32, seed=13)
    q_lengths, kv_lengths = jnp.array([7, 13, 0], jnp.int32), jnp.array([5, 0, 20], jnp.int32)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_lengths, is_causal=causal,
                                            key_value_seq_lengths=kv_lengths if kv else None)
    [match] = xkern.explain(f)(q, k, v).matches
    assert match.pattern == (f"attention/jax.nn.dot_product_attention{'(causal)' * causal}+query_seq_lengths"
                             f"{'+key_value_seq_lengths' * kv}")
    hidden_nan = q.at[0, 9, 1, 3].set(jnp.nan)  # a padded query
    close(xkern.jit(f)(hidden_nan, k, v), jax.jit(f)(hidden_nan, k, v), jnp.float32)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * do))
    for got, want in zip(jax.jit(jax.grad(loss(xkern.optimize(f)), (0, 1, 2)))(q, k, v),
                         jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)):
        close(got, want, jnp.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_nn_lengths_of_one_number_for_every_entry(causal):
    """Lengths made by jnp.full((b,), n) from a traced n (a decode step's position): canonicalize makes
    them a broadcast of n, which the templates, traced with lengths [b], did not take (the scores were
    made, the softmax alone fused). Now they do: values and gradients against jax.jit's, n of 0 (every
    key hidden), inside and past the sequence. So are lengths of a literal n (`jnp.full((b,), 5)`),
    which canonicalize keeps as that [b] array (a broadcast of it was folded into one of the literal,
    which no template takes)."""
    q, k, v, do = make(2, 13, 11, 4, 2, 16, jnp.float32, seed=14)

    def f(q, k, v, n):
        every = jnp.full((q.shape[0],), n, jnp.int32)
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, key_value_seq_lengths=every,
                                            query_seq_lengths=every if causal else None)
    [match] = xkern.explain(f)(q, k, v, 5).matches
    assert match.pattern.startswith("attention/jax.nn") and "key_value_seq_lengths" in match.pattern
    loss = lambda f: (lambda q, k, v, n: jnp.sum(f(q, k, v, n) * do))
    for n in (5, 0, 20):
        close(xkern.jit(f)(q, k, v, n), jax.jit(f)(q, k, v, n), jnp.float32)
        for got, want in zip(jax.jit(jax.grad(loss(xkern.optimize(f)), (0, 1, 2)))(q, k, v, n),
                             jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v, n)):
            close(got, want, jnp.float32)
        literal = lambda q, k, v, n=n: f(q, k, v, n)  # (n a Python int: a literal in the program)
        [match] = xkern.explain(literal)(q, k, v).matches
        assert match.pattern.startswith("attention/jax.nn") and "key_value_seq_lengths" in match.pattern, n
        close(xkern.jit(literal)(q, k, v), jax.jit(literal)(q, k, v), jnp.float32)
        for got, want in zip(jax.jit(jax.grad(lambda *a: jnp.sum(xkern.optimize(literal)(*a) * do), (0, 1, 2)))(q, k, v),
                             jax.jit(jax.grad(lambda *a: jnp.sum(literal(*a) * do), (0, 1, 2)))(q, k, v)):
            close(got, want, jnp.float32)


# --------------------------------------------------------------------------------------------------
# Sliding windows (local_window_size)
# --------------------------------------------------------------------------------------------------

def test_windows_that_bound_nothing_take_the_plain_kernels():
    """A window wider than the sequences is no window; (None, 0) and a causal window wider than the
    queries are plain causal; the kernels get the window only where it hides a key. Each equals the
    reference, and (0, 0) lets a query see only its own key."""
    q, k, v, _ = make(1, 24, 24, 2, 2, 16, jnp.float32, seed=20)
    cases = [({"local_window_size": 23}, (False, -1, -1)), ({"local_window_size": (None, 0)}, (True, -1, -1)),
             ({"local_window_size": (30, 4), "causal": True}, (True, -1, -1)),
             ({"local_window_size": (5, 30)}, (False, 5, -1)), ({"local_window_size": (0, 0)}, (False, 0, 0)),
             ({"local_window_size": (6, 2), "causal": True}, (False, 6, 0))]
    for kw, (causal, left, right) in cases:
        [launch] = _constexprs(lambda q, k, v: attention(q, k, v, **kw), q, k, v)
        assert (launch["CAUSAL"], launch["WINDOW_L"], launch["WINDOW_R"]) == (causal, left, right), kw
        close(attention(q, k, v, **kw), reference(q, k, v, **kw), jnp.float32)
    close(attention(q, k, v, local_window_size=0), v, jnp.float32)


def test_rows_a_window_empties_beside_a_bias_get_no_gradient_through_it():
    """masked_rows="average" with a bias: a row the window leaves without keys (17 queries, 16 keys,
    window (0, 0)) is averaged through a `where`, so no gradient reaches q or k from it; only a row
    a bias hid passes one through the add."""
    q, k, v, do = make(1, 17, 16, 2, 2, 16, jnp.float32, seed=21)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, 1, 16)), jnp.float32)
    kw = dict(bias=bias, local_window_size=(0, 0), masked_rows="average")
    (out, grads), (want, grads_ref) = (value_and_grads(attention, (q, k, v), do, **kw),
                                       value_and_grads(reference, (q, k, v), do, **kw))
    close(out, want, jnp.float32)
    for got, ref in zip(grads, grads_ref):
        close(got, ref, jnp.float32)
    assert not np.asarray(grads[0])[0, 16].any()  # the empty row's dq


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grouped", [True, False])
def test_jax_nn_local_window_size_is_found(causal, grouped):
    """jax.nn.dot_product_attention(local_window_size=...) runs as the windowed kernels (jax.nn builds
    the window from two position constants, which the pattern matches by value); a query whose
    window holds no key (more queries than keys) averages every value, as jax.nn's fill gives it.
    Values and gradients equal jax.jit's."""
    q, k, v, do = make(2, 40, 36, 4, 2 if grouped else 4, 16, jnp.bfloat16, seed=21)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    window = (9, 0) if causal else (3, 1)
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window)
    report = xkern.explain(f)(q, k, v)
    assert [m.pattern for m in report.matches] == [
        f"attention/jax.nn.dot_product_attention{'(causal)' if causal else ''}+local_window_size"]
    assert report.matches[0].params["left"] == window[0] and report.matches[0].params["right"] == window[1]
    [launch] = _constexprs(f, q, k, v)
    assert (launch["CAUSAL"], launch["WINDOW_L"], launch["WINDOW_R"]) == (False, *window)
    close(xkern.jit(f)(q, k, v), jax.jit(f)(*f32), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v)
    for g, w in zip(got, jax.jit(jax.grad(loss(f), (0, 1, 2)))(*f32)):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("causal,mask_shape,grouped", [(False, (2, 1, 40, 36), True), (True, (2, 4, 40, 36), True),
                                                       (False, (1, 1, 40, 36), False)])
def test_jax_nn_local_window_size_with_a_mask_is_found(causal, mask_shape, grouped):
    """jax.nn.dot_product_attention with local_window_size and a mask (it joins the two): the
    kernels take both; a query whose window the mask hides entirely averages every value, as
    jax.nn's fill gives it (the first query's row here). Values and gradients equal jax.jit's."""
    q, k, v, do = make(2, 40, 36, 4, 2 if grouped else 4, 16, jnp.bfloat16, seed=23)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    mask = jnp.asarray(np.random.default_rng(23).random(mask_shape) > 0.4).at[..., 0, :].set(False)
    window = (9, 0) if causal else (3, 1)
    f = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=causal, local_window_size=window)
    [match] = xkern.explain(f)(q, k, v, mask).matches
    assert match.pattern.startswith(f"attention/jax.nn.dot_product_attention{'(causal)' if causal else ''}+mask")
    assert "+local_window_size" in match.pattern and (match.params["left"], match.params["right"]) == window
    close(xkern.jit(f)(q, k, v, mask), jax.jit(f)(*f32, mask), jnp.bfloat16)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v, mask).astype(jnp.float32) * do.astype(jnp.float32)))
    got = jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(q, k, v)
    for g, w in zip(got, jax.jit(jax.grad(loss(f), (0, 1, 2)))(*f32)):
        close(g, w, jnp.bfloat16)


def test_constant_band_masks_run_as_windows():
    """A sliding-window mask the program builds from constants (Flax users combine a causal mask with
    a band) is read when planning and runs as the windowed kernels; a band that differs between
    heads, or one that is not a band, stays a mask. Values equal jax.jit's."""
    import flax.linen as nn

    q, k, v, _ = make(2, 32, 32, 2, 2, 16, jnp.bfloat16, seed=22)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    i = np.arange(32)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 12)
    both_sides = (i[None, :] >= i[:, None] - 3) & (i[None, :] <= i[:, None] + 5)
    per_head = np.stack([band, both_sides])[None]
    strided = band & (i[None, :] % 2 == 0)
    programs = {  # name: (mask, expected (mask_kind, left, right))
        "flax, causal band": (band[None, None], ("window", 11, 0)),
        "both sides": (both_sides[None, None], ("window", 3, 5)),
        "per head": (per_head, (None, None, None)),
        "not a band": (strided[None, None], (None, None, None)),
    }
    for name, (mask, want) in programs.items():
        f = lambda q, k, v: nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask))
        [match] = [m for m in xkern.explain(f)(q, k, v).matches if m.op == "attention"]
        assert tuple(match.params.get(n) for n in ("mask_kind", "left", "right")) == want, name
        [launch] = _constexprs(f, q, k, v)
        assert launch["HAS_MASK"] == (want[0] is None), name
        close(xkern.jit(f)(q, k, v), jax.jit(f)(*f32), jnp.bfloat16)


@pytest.mark.skipif(not L.INTERPRET, reason="interpreter tiles; on a GPU, test_warp_specialized_window_dkdv_on_hopper")
@pytest.mark.parametrize("shape, window", [((1, 48, 48, 4, 2, 16), (10, 0)), ((2, 40, 64, 2, 1, 16), (7, 20)),
                                           ((1, 64, 64, 2, 2, 16), (3, 3))])
def test_warp_specialized_window_dkdv_adds_the_edges_after(shape, window):
    """A sliding window on Hopper: the warp-specialized dk/dv takes the query blocks that see the
    whole key block, then _dkdv_diagonal the window's edges (all of it when the window is narrower
    than the tile). Through the interpreter, against the reference's gradients. The tiles are
    offered to dk/dv only (the forward's tied the two-loop kernel), and only for whole key blocks."""
    import dataclasses
    from xkern.kernels import attention as A
    b, sq, sk, h, hk, d = shape
    q, k, v, do = make(b, sq, sk, h, hk, d, jnp.float32, seed=23)
    st = A.Static(False, d ** -0.5, None, None, False, "interpret", A.default_configs(d, "interpret"), False, window)
    ws = dataclasses.replace(st, configs=(st.configs[0], st.configs[1].replace(WS=1, BLOCK_N=32), st.configs[2]))
    backward = lambda q, k, v: jax.vjp(lambda *a: A._attention(*a, None, None, None, None, None, ws), q, k, v)[1](do)
    want = jax.jit(lambda q, k, v: jax.vjp(lambda *a: reference(*a, local_window_size=window), q, k, v)[1](do))(q, k, v)
    for g, w in zip(jax.jit(backward)(q, k, v), want):
        close(g, w, jnp.float32)
    assert "attention_dkdv_diagonal" in kernel_names(jax.make_jaxpr(backward)(q, k, v))
    offered = lambda kernel, keys: A.candidates(kernel, 128, "triton", "cuda", tma=True, window_keys=keys)[0]["WS"]
    assert offered("dkdv", 4096) and not offered("dkdv", 4000) and not offered("fwd", 4096) and not offered("dq", 4096)


@pytest.mark.skipif(not L.tma_supported(), reason="needs a GPU with TMA (Hopper): the tiles the H200 runs")
@pytest.mark.parametrize("window", [(256, 0), (100, 28)])
def test_warp_specialized_window_dkdv_on_hopper(window):
    """On a Hopper GPU a sliding window's dk/dv runs warp-specialized at the measured tiles, then
    _dkdv_diagonal adds the window's edges: values and every gradient against the reference."""
    ran = _bf16_against_the_reference_with_launches((1, 1024, 1024, 4, 2, 128), 13, local_window_size=window)
    assert ran["attention_bwd_dkdv"].get("WS") and "attention_dkdv_diagonal" in ran
    assert not ran["attention_fwd"].get("WS") and not ran["attention_fwd"].get("GLUON")
