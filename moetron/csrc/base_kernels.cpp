// One translation unit for the kernels compiled without fma_kernels.cpp's floating-point pragmas: the
// permute and unpermute (permute_cpu.cpp), RMSNorm and RoPE (rmsnorm_rope_cpu.cpp), the softmax top-k
// router (router_cpu.cpp) and the grouped GEMM (grouped_gemm_cpu.cpp). torch's headers cost each unit
// ~10 s of CPU before a line of moetron's is compiled, and the library's first build runs inside the first
// `moetron train`: two units instead of five took that build from 54 to 26 s on a 2-core machine (each
// unit ~23 s, about the longest of the five, so a machine with more cores waits as long as before). The kernels stay in their files,
// each readable on its own; moetron/kernels/cpp_build.py compiles the two units and hashes every file.
#include "permute_cpu.cpp"
#include "rmsnorm_rope_cpu.cpp"
#include "router_cpu.cpp"
#include "grouped_gemm_cpu.cpp"
