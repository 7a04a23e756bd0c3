"""Ahead-of-time compile check: every kernel in the library builds for NVIDIA and AMD targets.

Triton compiles for any target on a machine without a GPU, so this is how tests prove that each
kernel, at representative configs, builds for CUDA (sm_90, sm_80) and ROCm (gfx942, gfx90a), within
the shared memory those devices have.
It needs compiled (not interpreted) kernels, so run it in its own process:

    XKERN_BACKEND=triton python -m xkern.kernels.aot [--json]
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

TARGETS = {  # name: (backend, arch, warp size)
    "sm_90": ("cuda", 90, 32),
    "sm_80": ("cuda", 80, 32),
    "gfx942": ("hip", "gfx942", 64),
    "gfx90a": ("hip", "gfx90a", 64),
}
SHARED_MEMORY = {"sm_90": 232448, "sm_80": 166912, "gfx942": 65536, "gfx90a": 65536}  # bytes per program
KERNEL_MODULES = ("softmax", "norms", "cross_entropy", "attention", "glu", "rope", "generated")  # each defines aot_cases()


def compile_kernel(fn, signature: dict, config, target: str):
    """Compile `fn` for `target` with `config`'s meta-parameters; returns Triton's CompiledKernel.

    signature: Triton types of the pointer and scalar parameters ("*bf16", "i32"); the rest are
    constexprs, whose values come from config.meta.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.compiler import make_backend

    backend, arch, warp_size = TARGETS[target]
    if config.num_warps * warp_size > 1024:
        raise ValueError(f"num_warps={config.num_warps} exceeds 1024 threads on {target}")
    gpu = GPUTarget(backend, arch, warp_size)
    # Parameters not typed by the case are constexprs; Triton wants them in the kernel's order.
    signature = {name: signature.get(name, "constexpr") for name in fn.arg_names}
    # Pointers 16-byte aligned, as jax_triton declares every array it passes (XLA's buffers are):
    # without it Triton cannot vectorize loads, nor pipeline them, and the code is not what runs.
    aligned = make_backend(gpu).parse_attr("D")
    attrs = {(i,): aligned for i, name in enumerate(fn.arg_names) if signature[name].startswith("*")}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True}
    from xkern.kernels.launch import is_gluon

    if is_gluon(fn):  # (as launch.gluon_module builds it under jax_triton)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, signature, dict(config.meta), attrs)
        if getattr(fn, "xkern_maxnreg", None):
            options["maxnreg"] = fn.xkern_maxnreg
    else:
        src = ASTSource(fn=fn, signature=signature, constexprs=dict(config.meta), attrs=attrs)
    return triton.compile(src, target=gpu, options=options)  # as jax_triton compiles


def frees_dead_barriers(ptx: str) -> bool:
    """Whether a kernel that initializes mbarriers at the start of shared memory (Triton 3.6's warp
    specialization leaves unused ones at offsets 0, 8, ..., one per stage, over the first buffer it
    loads) invalidates each of them (hopper.free_dead_barriers) after those inits and before its
    first TMA copy."""
    offsets = {}  # register -> its offset from global_smem
    for base in re.findall(r"mov\.b32\s+(%r\d+), global_smem;", ptx):
        offsets[base] = 0
        offsets.update((reg, int(n)) for reg, n in
                       re.findall(rf"add\.s32\s+(%r\d+), {re.escape(base)}, (\d+);", ptx))
    inits = [(m.start(), 0 if m[1] == "global_smem" else offsets.get(m[1])) for m in
             re.finditer(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[(%r\d+|global_smem)\]", ptx)]
    low = [(at, offset) for at, offset in inits if offset is not None and offset < 64]
    first_copy = ptx.find("cp.async.bulk.tensor")
    for offset in {offset for _, offset in low}:
        address = "global_smem" + (f"+{offset}" if offset else "")
        inval = ptx.find(f"mbarrier.inval.shared::cta.b64 [{address}]")
        last_init = max(at for at, o in low if o == offset)
        if not (0 <= inval and last_init < inval and (first_copy < 0 or inval < first_copy)):
            return False
    return True


def all_cases():
    import importlib

    for module in KERNEL_MODULES:
        yield from importlib.import_module(f"xkern.kernels.{module}").aot_cases()


def main(argv: list[str]) -> int:
    from xkern.kernels import launch

    if os.environ.get("TRITON_CACHE_DIR") == "":
        # jax_triton sets it empty on import (it keeps no Triton cache); a process started from one
        # that imported it inherits that, and on a GPU machine Triton's driver then cannot build
        # its launcher ("Could not create or locate cache dir"): use Triton's default cache here.
        del os.environ["TRITON_CACHE_DIR"]
    if launch.INTERPRET:
        print("aot: kernels are interpreted in this process; run with XKERN_BACKEND=triton",
              file=sys.stderr)
        return 2
    shard, shards = 0, 1  # --shard i/n: every n-th compile from the i-th (processes share the work)
    for arg in argv:
        if arg.startswith("--shard="):
            shard, shards = map(int, arg.split("=", 1)[1].split("/"))
    jobs = [(case, target) for case in all_cases()  # a case may name its targets
            for target in (case[4] if len(case) > 4 else TARGETS)]
    results = []
    for (name, fn, signature, config, *_), target in jobs[shard::shards]:
        start = time.perf_counter()
        try:
            compiled = compile_kernel(fn, signature, config, target)
            binary = "cubin" if TARGETS[target][0] == "cuda" else "hsaco"
            shared = compiled.metadata.shared  # more than the device has: the launch would fail
            ok = bool(compiled.asm.get(binary)) and shared <= SHARED_MEMORY[target]
            detail = (f"{len(compiled.asm[binary])} B {binary}, {shared} B shared (of {SHARED_MEMORY[target]}), "
                      f"{compiled.metadata.num_warps} warps")  # more than asked: warp-specialized
            if TARGETS[target][0] == "cuda" and not frees_dead_barriers(compiled.asm["ptx"]):
                ok, detail = False, detail + "; its unused mbarriers at the start of shared memory are not invalidated before a copy"
        except Exception as e:  # report every failure, not only the first
            ok, detail = False, f"{type(e).__name__}: {e}"
        results.append({"case": name, "kernel": fn.__name__, "target": target, "ok": ok, "detail": detail,
                        "seconds": round(time.perf_counter() - start, 3)})
    if "--json" in argv:
        print(json.dumps(results))
    else:
        for r in results:
            print(f"{'ok ' if r['ok'] else 'FAIL'} {r['target']:7} {r['case']:40} {r['detail']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
