"""The public ops: each runs xkern's Triton kernels (or, with backend="xla", its jax.numpy definition)."""
from xkern.kernels.attention import attention
from xkern.kernels.cross_entropy import cross_entropy
from xkern.kernels.glu import geglu, swiglu
from xkern.kernels.linear_cross_entropy import linear_cross_entropy
from xkern.kernels.norms import layer_norm, rms_norm
from xkern.kernels.rope import rope
from xkern.kernels.softmax import log_softmax, softmax

__all__ = ["attention", "softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy", "linear_cross_entropy",
           "swiglu", "geglu", "rope"]
