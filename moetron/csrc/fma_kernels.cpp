// One translation unit for the kernels compiled with fused multiply-adds (simd_math.h): the weighted
// SwiGLU (swiglu_cpu.cpp), the causal attention (causal_attention_cpu.cpp) and the token cross-entropy
// (cross_entropy_cpu.cpp). Every unit of the library pays ~10 s of CPU for torch's headers alone, and the
// library's first build runs inside the first `moetron train`: the rest compiles as base_kernels.cpp. The
// kernels stay in their files, each readable on its own; moetron/kernels/cpp_build.py compiles the two
// units and hashes them all.
#include "swiglu_cpu.cpp"
#include "causal_attention_cpu.cpp"
#include "cross_entropy_cpu.cpp"
