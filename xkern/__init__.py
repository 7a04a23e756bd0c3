"""xkern: fast JAX programs on GPUs through fused, tuned Triton kernels launched as XLA custom calls."""
from xkern import ops
from xkern.api import Report, explain, jit, optimize, patterns
from xkern.kernels.launch import BACKENDS, Config, resolve_backend

__version__ = "0.1.0"
__all__ = ["jit", "optimize", "explain", "patterns", "Report", "ops", "Config", "BACKENDS",
           "resolve_backend", "__version__"]
