"""transformer_engine.pytorch (fake, TE 2.20.0.dev0 @d0067d0d): the names moetron uses."""

from transformer_engine.pytorch.attention import DotProductAttention
from transformer_engine.pytorch.module import GroupedLinear, Linear, UserBufferQuantizationMode, destroy_ub, initialize_ub
from transformer_engine.pytorch.quantization import (FP8GlobalStateManager, autocast, check_fp8_block_scaling_support,
                                                     check_fp8_support, check_mxfp8_support, fp8_autocast)

__all__ = ["DotProductAttention", "GroupedLinear", "Linear", "initialize_ub", "destroy_ub", "UserBufferQuantizationMode", "FP8GlobalStateManager", "autocast", "fp8_autocast",
           "check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support"]
