"""Fused Triton kernels for the elementwise work of a training step that torch.compile does not reach (an eager
step, or the ops between our FSDP's hooks): RMSNorm, RoPE of q and k, SwiGLU's silu(a) * b, and the cross-entropy's
softmax over vocab tiles, each forward and backward, each as an autograd Function whose launches torch.compile sees
as custom ops. `systems.model.TransformerConfig.fused` names the ones a model uses.

Imported on first use by the model, so that systems.model imports where Triton is not installed.
"""

from systems.kernels.cross_entropy import cross_entropy_rows, logit_gradients_
from systems.kernels.rmsnorm import rms_norm
from systems.kernels.rope import rotate_qk
from systems.kernels.swiglu import silu_mul

__all__ = ["cross_entropy_rows", "logit_gradients_", "rms_norm", "rotate_qk", "silu_mul"]
