"""precision: FP8 recipes and quantization (fp8), FP8 GEMMs and linear functions (fp8_matmul),
FP8 modules (tensor-parallel ones too) and apply_fp8 (fp8_modules), the backend choice by capability
(fp8_backend), the Transformer Engine modules (te_modules), the FP8 ZeRO parameter all-gather
(fp8_param_gather), checkpoint-style 128×128 block quantization (blockwise)."""

from moetron.precision.fp8 import (FP8_RECIPES, FP8Recipe, Quantized, blockwise, delayed, get_fp8_recipe, mxfp8,
                                   tensorwise)
from moetron.precision.fp8_backend import FP8Capabilities, choose_fp8_backend, probe_capabilities
from moetron.precision.fp8_matmul import fp8_gemm, fp8_grouped_linear, fp8_linear
from moetron.precision.fp8_modules import (FP8GroupedExperts, FP8Linear, apply_fp8, cache_fp8_weights, fp8_backend_choice,
                                           fp8_modules, fp8_state_dict, load_fp8_state_dict)

__all__ = ["FP8_RECIPES", "FP8Recipe", "Quantized", "blockwise", "delayed", "tensorwise", "mxfp8", "get_fp8_recipe",
           "FP8Capabilities", "choose_fp8_backend", "probe_capabilities", "fp8_backend_choice",
           "fp8_gemm", "fp8_linear", "fp8_grouped_linear", "FP8Linear", "FP8GroupedExperts", "apply_fp8", "cache_fp8_weights",
           "fp8_modules", "fp8_state_dict", "load_fp8_state_dict"]
