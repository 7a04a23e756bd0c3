import os

import numpy as np
import pytest

# Tests run wherever CI does (a CPU-only machine): kernels go through Triton's interpreter.
os.environ.setdefault("XKERN_BACKEND", "interpret")


@pytest.fixture
def rng():
    return np.random.default_rng(0)
