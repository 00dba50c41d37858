// One translation unit for the kernels compiled with fused multiply-adds (simd_math.h): the weighted
// SwiGLU (swiglu_cpu.cpp) and the causal attention (causal_attention_cpu.cpp). Every C++ file of the
// library pays ~15 s of CPU for torch's headers alone, and the library's first build runs inside the
// first `moetron train`: compiling the two together saves that once. The kernels stay in their files,
// each readable on its own; moetron/kernels/cpp_build.py compiles this one and hashes all three.
#include "swiglu_cpu.cpp"
#include "causal_attention_cpu.cpp"
