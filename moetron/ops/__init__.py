"""Small math kernels (RMSNorm, SwiGLU, RoPE, cross-entropy) behind one fusion switch."""

from moetron.ops.functional import (apply_rope, cross_entropy, fusion_mode, resolve_fusion, rms_norm,
                                    rms_norm_rope, set_fusion, swiglu)

__all__ = ["apply_rope", "cross_entropy", "fusion_mode", "resolve_fusion", "rms_norm", "rms_norm_rope", "set_fusion",
           "swiglu"]
