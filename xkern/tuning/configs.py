"""Launch-config heuristics shared by kernel families (each fitted to an H200 sweep recorded in
benchmarks/results/)."""
from __future__ import annotations

from xkern.kernels import launch as L


def one_block_rows(n_rows: int, n_cols: int, backend: str) -> L.Config:
    """A config for kernels that keep BLOCK_M whole rows per program in registers.

    From the generated-kernel sweep (h200-generated-sweep.json, 16384x8192 bf16): programs of one
    8192-wide row want 4 warps (layer norm 0.175 ms vs 0.194 with 16; rms norm 0.138 vs 0.159;
    gelu chain 0.156 either way); short rows are packed ~4096 elements to a program. The
    interpreter pays per program, so there programs take as many rows as fit 64K elements.
    """
    block_n = L.next_pow2(n_cols)
    if backend == "interpret":
        return L.Config.of(BLOCK_M=min(L.next_pow2(n_rows), max(1, (1 << 16) // block_n)), BLOCK_N=block_n)
    block_m = max(1, min(L.next_pow2(n_rows), 4096 // block_n))
    return L.Config.of(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 8192 else 8)
