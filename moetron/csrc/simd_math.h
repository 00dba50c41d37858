// Shared by the SwiGLU and attention kernels: GCC vector types of eight floats; exp for one float or
// eight (glibc's vector expf needs -ffast-math), a Cephes-style polynomial within 2 ulp of expf; and the
// AVX2+FMA target their loops are compiled for besides the default one. GCC's target_clones cannot
// ask for two features in one clone (and "arch=haswell" is never picked on AMD), so the callers pick
// with has_avx2_fma() at run time; MOETRON_NO_FMA=1 in the environment picks the default loops (tests
// check them on a CPU that has FMA: tests/test_cpp_simd_fallback.py).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace moetron {
namespace {  // one copy per source file: each compiles it with its own optimisation pragmas

// Eight floats in GCC's vector types: AVX registers in the AVX2+FMA loops, pairs of SSE registers in the
// default ones. They are passed by value only between always_inline functions, so no ABI is involved and
// GCC's note that one would change without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));

__attribute__((always_inline)) inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

__attribute__((always_inline)) inline int32_t to_int32(float x) { return static_cast<int32_t>(x); }
__attribute__((always_inline)) inline ivec8 to_int32(vec8 x) { return __builtin_convertvector(x, ivec8); }

// The steps of exp for one float or eight (T = float or vec8); the same operations either way.
template <typename T>
__attribute__((always_inline)) inline T exp_steps(T x) {
  const T lo = T{} - 87.0f, hi = T{} + 88.0f;
  x = x < lo ? lo : x;  // each clamp one max/min instruction (a nested ternary compiles to compares and blends)
  x = x > hi ? hi : x;
  const T fx = x * 1.44269504088896341f;
  const T fn = (fx + 12582912.0f) - 12582912.0f;  // rounded to the nearest integer (|fx| < 2^22): two adds
  const auto n = to_int32(fn);
  T r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  const T z = r * r;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  const auto bits = (n + 127) << 23;
  T scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

__attribute__((always_inline)) inline float exp_poly(float x) { return exp_steps(x); }

// exp_poly on eight lanes. A loop calling exp_poly vectorises, but GCC if-converts the clamps into
// compare-and-blend chains that it carries through what follows (a sigmoid's division): a SiLU loop
// ran 2.7x slower than one written on vec8 (1.86 vs 0.68 ns an element on the development VM).
__attribute__((always_inline)) inline vec8 exp8(vec8 x) { return exp_steps(x); }

// The sum of a vector's lanes, in lane order.
__attribute__((always_inline)) inline float lane_sum(vec8 v) {
  float s = v[0];
  for (int i = 1; i < 8; ++i) s += v[i];
  return s;
}

inline bool no_fma_requested() {
  const char* v = std::getenv("MOETRON_NO_FMA");
  return v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
}

#if defined(__GNUC__) && defined(__x86_64__)
#define MOETRON_FMA_TARGET __attribute__((target("avx2,fma")))
inline bool has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !no_fma_requested();
  return ok;
}
#else
#define MOETRON_FMA_TARGET
inline bool has_avx2_fma() { return false; }
#endif

}  // namespace
}  // namespace moetron
