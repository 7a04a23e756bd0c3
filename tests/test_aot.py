"""Every kernel in the library compiles ahead of time for CUDA (sm_90, sm_80) and ROCm (gfx942,
gfx90a), on this GPU-less machine, in processes where Triton compiles instead of interpreting (each
taking every n-th compile). The compiles take minutes of CPU: conftest.py starts them when the
suite is collected, on the cores that the interpreted tests (one core) leave idle, and runs this
test last, to collect them."""
import atexit
import json
import os
import subprocess
import sys
import tempfile

from xkern.kernels import aot

_compiles = []  # (process, stdout file, stderr file), once started


def start_compiles(spare_cores: int) -> None:
    """Start the compile processes, one per spare core (at most 4), unless already started."""
    if _compiles:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["XKERN_BACKEND"] = "triton"
    shards = max(1, min(4, spare_cores))
    for i in range(shards):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: a pipe would fill
        proc = subprocess.Popen([sys.executable, "-m", "xkern.kernels.aot", "--json", f"--shard={i}/{shards}"],
                                env=env, stdout=out, stderr=err, text=True)
        _compiles.append((proc, out, err))
    atexit.register(lambda: [proc.kill() for proc, _, _ in _compiles if proc.poll() is None])


def _collect_compiles() -> list[dict]:
    results = []
    for proc, out, err in _compiles:
        proc.wait(timeout=900)
        out.seek(0), err.seek(0)
        assert proc.returncode in (0, 1), err.read()[-2000:]
        results += json.loads(out.read().strip().splitlines()[-1])
    return results


def test_every_kernel_compiles_for_cuda_and_rocm():
    start_compiles(os.cpu_count() or 1)  # when conftest did not (a run of this file alone, xdist)
    results = _collect_compiles()
    failures = [r for r in results if not r["ok"]]
    assert not failures, failures
    assert all(proc.returncode == 0 for proc, _, _ in _compiles)
    kernels = {r["case"].split("/")[0] for r in results}
    assert {"softmax_fwd", "softmax_bwd", "log_softmax_fwd", "log_softmax_bwd"} <= kernels
    assert any(r["case"].startswith("generated/") for r in results)
    assert {r["target"] for r in results} == set(aot.TARGETS)
    assert len({(r["case"], r["target"]) for r in results}) == len(results)  # no compile done twice
    # Hopper's warp-specialized attention kernels: asked for 4 warps, compiled into 12 (3 warp groups)
    specialized = [r for r in results if r["case"] in ("attention/sm_90/d128/bf16/plain/fwd",
                                                       "attention/sm_90/d128/bf16/plain/bwd",
                                                       "attention/sm_90/d128/bf16/softcap/bwd_dkdv",
                                                       "attention/sm_90/d256/bf16/causal-gqa/bwd_dq")]
    assert len(specialized) == 4 and all(r["detail"].endswith(", 12 warps") for r in specialized), specialized
    # The sliding-window kernels (forward, dk/dv, dq) on every target
    window = {r["target"] for r in results if "/window/" in r["case"]}
    assert window == set(aot.TARGETS), window
    # The soft-capped kernels on each vendor's first target
    capped = {r["target"] for r in results if "/softcap/" in r["case"]}
    assert capped == {"sm_90", "gfx942"}, capped
    # The cross-entropy kernels under a soft cap (Gemma 2's final logits): precise tanh on every target,
    # PTX's approximation on CUDA's
    ce_capped = {(r["case"].split("/")[3], r["target"]) for r in results if r["case"].startswith("cross_entropy/")
                 and "/soft_cap" in r["case"]}
    assert ce_capped == {("soft_cap", t) for t in aot.TARGETS} | {("soft_cap_fast_tanh", "sm_90")}, ce_capped
    # cross_entropy_hopper's kernel, on sm_90 alone: 14 chunks (224 KB) in shared memory, a loader
    # warp; integer labels and one-hot targets (a -inf beside the label NaN, or SELECTED: not)
    resident = [r for r in results if r["kernel"] == "lse_dx"]
    assert {r["target"] for r in resident} == {"sm_90"} and len(resident) == 6, resident
    assert all(", 229700 B shared" in r["detail"] and r["detail"].endswith(", 20 warps") for r in resident), resident
    # At head dims 128 and 256 the forward of problems without masking is the Gluon one
    # (attention_hopper) on sm_90, the causal diagonal included; a soft cap keeps the warp-specialized
    # Triton forward
    gluon = {r["case"] for r in results if r["kernel"] == "fwd"}
    kinds = ("plain", "causal-gqa", "sinks", "exp2-split")
    assert gluon == {f"attention/sm_90/d128/bf16/{kind}/fwd" for kind in kinds} | {
        f"attention/sm_90/d256/bf16/{kind}/fwd" for kind in ("causal-gqa", "plain")}, gluon
    assert not any(r["case"].endswith("/causal-gqa/fwd_diagonal") for r in results)
    # and so is the backward (dk, dv and dq in one kernel: no dq kernel, no diagonal ones); both also
    # with half their exps by the FMA units (attention_hopper.exp2_ptx's PTX, assembled by ptxas)
    gluon = {r["case"] for r in results if r["kernel"] == "bwd"}
    kinds = ("plain", "causal-gqa", "sinks", "exp2-split")
    assert gluon == {f"attention/sm_90/d128/bf16/{kind}/bwd" for kind in kinds} | {
        "attention/sm_90/d64/bf16/causal-gqa/bwd"}, gluon
    assert not any(r["case"].startswith("attention/sm_90/d128/bf16/causal-gqa/") and "dq" in r["case"] for r in results)
    # the wide backward at head dim 256 (64-key programs, P^T and dS^T through shared memory): 225 KB
    wide = {r["case"]: r["detail"] for r in results if r["kernel"] == "bwd_wide"}
    assert set(wide) == {f"attention/sm_90/d256/bf16/{kind}/bwd" for kind in ("plain", "causal-gqa")}, wide
    assert all(", 230784 B shared" in detail for detail in wide.values()), wide  # (WIDE_SPLIT 1)
    assert any(r["case"] == "attention/sm_90/d128/bf16/softcap/fwd_diagonal" for r in results)
    # Attention sinks, counted after the loop: in the warp-specialized forward (Hopper) too
    sunk = {r["target"]: r["detail"] for r in results if r["case"].endswith("/sinks/fwd")}
    assert set(sunk) == {"sm_90", "gfx942"} and sunk["sm_90"].endswith(", 12 warps"), sunk
    # The split-key (decoding) forward on every target
    split = {r["target"] for r in results if "/split-kv-" in r["case"]}
    assert split == set(aot.TARGETS), split
    # The matmul template with TMA loads, on sm_90 only (descriptors need Hopper)
    tma = [r for r in results if r["case"].startswith("generated/linear_gelu/") and r["case"].endswith("/tma")]
    assert tma and {r["target"] for r in tma} == {"sm_90"}
    persistent = [r for r in results if r["case"].startswith("generated/linear_gelu/") and r["case"].endswith("/persistent")]
    assert persistent and {r["target"] for r in persistent} == {"sm_90"}


def test_the_barrier_check_reads_the_ptx_order():
    """frees_dead_barriers: barriers initialized at the start of shared memory must be invalidated
    after their inits and before the first TMA copy (Triton 3.6's warp specialization; hopper.py)."""
    init = "mov.b32 %r7, global_smem;\nmbarrier.init.shared::cta.b64 [%r7], 1;\n"
    inval = "mbarrier.inval.shared::cta.b64 [global_smem];\n"
    copy = "cp.async.bulk.tensor.2d.shared::cluster.global [%r9], [%rd1, {%r1, %r2}], [%r8];\n"
    assert aot.frees_dead_barriers(init + inval + copy)
    assert not aot.frees_dead_barriers(init + copy)
    assert not aot.frees_dead_barriers(init + copy + inval)  # too late: the copy may land first
    assert not aot.frees_dead_barriers(inval + init + copy)  # too early: re-initialized after
    assert aot.frees_dead_barriers("mov.b32 %r7, global_smem;\nadd.s32 %r8, %r7, 64;\n"
                                   "mbarrier.init.shared::cta.b64 [%r8], 1;\n" + copy)  # offset 64: past the dead barriers (0, 8, ... of at most 4 stages)
    # a 3-stage pipeline's: offsets 0, 8 and 16, each to be freed
    three = init + "".join(f"add.s32 %r{8 + k}, %r7, {8 * k};\nmbarrier.init.shared::cta.b64 [%r{8 + k}], 1;\n"
                           for k in (1, 2))
    inval_at = lambda *offsets: "".join(f"mbarrier.inval.shared::cta.b64 [global_smem{f'+{o}' if o else ''}];\n"
                                        for o in offsets)
    assert aot.frees_dead_barriers(three + inval_at(0, 8, 16) + copy)
    assert not aot.frees_dead_barriers(three + inval_at(0, 8) + copy)
