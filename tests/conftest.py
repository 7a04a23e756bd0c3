import os

import jax
import numpy as np
import pytest

# Tests run wherever CI does (a CPU-only machine): kernels go through Triton's interpreter, where
# every pattern match is rewritten (only the triton backend is costed).
os.environ.setdefault("XKERN_BACKEND", "interpret")
# Four CPU devices for the sharded programs of test_sharding.py (programs on one device are as before).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
# XLA's CPU programs (the references, and the callbacks around interpreted kernels) compiled for
# compile time, not run time: compiling them took two fifths of the tests' time, and each runs once
# on small arrays. Without LLVM's slowest passes, at optimization level 1 (O2's compiles took 2.5x
# as long), and by the loop emitters (the fusion emitters' fixed cost per program is 1.5x theirs).
# The same arithmetic: fast-math stays off (level 0 changed XLA's float32 results); a GPU's tests
# compile as users do.
if os.environ["XKERN_BACKEND"] == "interpret" and "xla_llvm_disable_expensive_passes" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (" --xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=1"
                                " --xla_cpu_use_fusion_emitters=false")
# On a GPU (XKERN_BACKEND=triton) tests check values, not speed: the heuristic tiles, no autotuning
# of every small test problem (tests/test_autotune.py turns it back on for itself).
if os.environ["XKERN_BACKEND"] == "triton":
    os.environ.setdefault("XKERN_AUTOTUNE", "0")
# float32 references in full float32: on a GPU, XLA would otherwise multiply float32 in TF32.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def every_match_rewritten(request, monkeypatch):
    """On a GPU the cost model would decline the tests' tiny problems (a custom call costs more than
    they take), and the tests check matching and values: there the pipeline rewrites every match,
    as it does through the interpreter. Tests of the cost model itself are marked `cost_model`."""
    if os.environ["XKERN_BACKEND"] == "triton" and "cost_model" not in request.keywords:
        from xkern import pipeline
        monkeypatch.setattr(pipeline, "decline_reason", lambda *args, **kwargs: None)


def pytest_collection_modifyitems(config, items):
    """Start the ahead-of-time compiles (minutes of CPU, in other processes) as soon as the suite is
    collected, on the cores the interpreted tests leave idle, and run their test last. Not under
    xdist, where every worker collects every test: there the test starts them itself."""
    aot = [item for item in items if item.name == "test_every_kernel_compiles_for_cuda_and_rocm"]
    if not aot or hasattr(config, "workerinput") or config.option.collectonly:
        return
    others = [item for item in items if item not in aot]
    items[:] = others + aot
    aot[0].module.start_compiles(spare_cores=(os.cpu_count() or 1) - (1 if others else 0))
