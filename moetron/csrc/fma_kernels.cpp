// One translation unit for the kernels compiled with fused multiply-adds (simd_math.h): the weighted
// SwiGLU (swiglu_cpu.cpp), the causal attention (causal_attention_cpu.cpp) and the token cross-entropy
// (cross_entropy_cpu.cpp). Every C++ file of the
// library pays ~15 s of CPU for torch's headers alone, and the library's first build runs inside the
// first `moetron train`: compiling the two together saves that once. The kernels stay in their files,
// each readable on its own; moetron/kernels/cpp_build.py compiles this one and hashes them all.
#include "swiglu_cpu.cpp"
#include "causal_attention_cpu.cpp"
#include "cross_entropy_cpu.cpp"
