"""What the cross-entropy kernels' soft cap costs on the present GPU (the evidence behind FAST_TANH):

    python -m benchmarks.sweep_soft_cap

Value and gradient of `xkern.ops.cross_entropy` on 8192x256000 bf16 logits (Gemma 2's vocabulary):
uncapped, capped at 30 with PTX's tanh.approx (the shipped CUDA path), capped with the precise tanh
(triton_math.tanh, as on ROCm), and jax.jit of the capped reference.
"""
from __future__ import annotations

import jax

from benchmarks.bench_cross_entropy import _logits_maker
from xkern.kernels import cross_entropy as ce
from xkern.tuning.timing import time_pipelined

ROWS, VOCAB, CAP = 8192, 256000, 30.0


def main() -> None:
    x, y, _ = _logits_maker(ROWS, VOCAB)(jax.random.key(0))
    ours = lambda **kw: jax.jit(jax.value_and_grad(lambda x: ce.cross_entropy(x, y, **kw)))
    runs = [("uncapped", ours()), ("capped, tanh.approx", ours(soft_cap=CAP)),
            ("jax.jit capped", jax.jit(jax.value_and_grad(lambda x: ce.reference(x, y, soft_cap=CAP))))]
    rows = [(name, time_pipelined(f, x) * 1e3, float(f(x)[0])) for name, f in runs]
    shipped = ce._with_tanh
    ce._with_tanh = lambda consts, dtype, backend: {**shipped(consts, dtype, backend), "FAST_TANH": False}
    try:  # (another cap: a new trace, so the kernel is built again without FAST_TANH)
        f = jax.jit(jax.value_and_grad(lambda x: ce.cross_entropy(x, y, soft_cap=CAP - 0.01)))
        rows.append(("capped, precise tanh", time_pipelined(f, x) * 1e3, float(f(x)[0])))
    finally:
        ce._with_tanh = shipped
    for name, ms, loss in rows:
        print(f"  {name:24s} {ms:8.3f} ms  loss {loss:.5f}  {2 * ROWS * VOCAB * 2 / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
