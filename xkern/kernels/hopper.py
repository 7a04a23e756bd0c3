"""Workarounds for Triton's Hopper code generation, shared by the hand-written and generated kernels.

Triton 3.6's warp specialization initializes one mbarrier per pipeline stage that nothing uses, at
shared offsets 0, 8, ... (found in the allocation pass's IR dump), and gives the same bytes to the
first buffer the kernel loads. PTX requires an mbarrier's memory to be invalidated before another
use; without it, on the H200, the first row of that buffer came out NaN in 75-80% of programs of the
head-dim-256 attention dq kernel, and a 3-stage pipeline (barriers at 0, 8, 16) NaN'd whenever only
0 and 8 were freed. Proxy fences alone did not help. Triton 3.9 invalidates its own barriers.
`xkern.kernels.aot` checks every sm_90 build for this (aot.frees_dead_barriers).
"""
from __future__ import annotations

from xkern.kernels import launch as L  # noqa: F401  (fixes Triton's compile/interpret mode first)

import triton
import triton.language as tl

# Whether free_dead_barriers has work: compiled by a Triton that leaves unused barriers (3.6 does,
# 3.9 does not: checked on sm_90 builds; the versions between are treated as 3.6). The interpreter
# has no inline assembly and no barriers.
FREES_BARRIERS = tl.constexpr(not L.INTERPRET and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9))


def _inval_asm(stages: int) -> tl.constexpr:
    """PTX: thread 0 invalidates the barriers at offsets 0, 8, ... of `stages` stages, then a proxy
    fence orders that before the copy engine's writes; $0 = $1 ties it to a value."""
    address = lambda offset: "global_smem" + (f"+{offset}" if offset else "")
    invals = "".join(f"@p mbarrier.inval.shared::cta.b64 [{address(8 * s)}];\n\t" for s in range(stages))
    return tl.constexpr("{\n\t.reg .pred p;\n\t.reg .u32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 p, t, 0;\n\t"
                        + invals + "fence.proxy.async.shared::cta;\n\tmov.u32 $0, $1;\n\t}")


_INVAL_1, _INVAL_2, _INVAL_3, _INVAL_4 = (_inval_asm(s) for s in (1, 2, 3, 4))


@triton.jit
def free_dead_barriers(x, STAGES: tl.constexpr):
    """x (an int32 scalar), after thread 0 invalidates the unused barriers of a warp-specialized
    pipeline of STAGES stages (1 to 4). Call it on a value computed before the warp-specialized loop
    and used by its first TMA load (a coordinate), so that it runs after the barriers' inits and
    before any copy; aot.frees_dead_barriers checks that order in the PTX."""
    tl.static_assert(1 <= STAGES and STAGES <= 4, "free_dead_barriers: STAGES must be 1 to 4")
    if FREES_BARRIERS:
        if STAGES == 1:
            x = tl.inline_asm_elementwise(_INVAL_1, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
        elif STAGES == 2:
            x = tl.inline_asm_elementwise(_INVAL_2, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
        elif STAGES == 3:
            x = tl.inline_asm_elementwise(_INVAL_3, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
        else:
            x = tl.inline_asm_elementwise(_INVAL_4, "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    return x
