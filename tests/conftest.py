import os

import jax
import numpy as np
import pytest

# Tests run wherever CI does (a CPU-only machine): kernels go through Triton's interpreter, where
# every pattern match is rewritten (only the triton backend is costed; on a GPU the cost model
# declines the tests' tiny problems, so pattern tests expect the interpreter).
os.environ.setdefault("XKERN_BACKEND", "interpret")
# On a GPU (XKERN_BACKEND=triton) tests check values, not speed: the heuristic tiles, no autotuning
# of every small test problem (tests/test_autotune.py turns it back on for itself).
if os.environ["XKERN_BACKEND"] == "triton":
    os.environ.setdefault("XKERN_AUTOTUNE", "0")
# float32 references in full float32: on a GPU, XLA would otherwise multiply float32 in TF32.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng():
    return np.random.default_rng(0)
