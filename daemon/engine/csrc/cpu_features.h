// What the host's CPU can run, shared by the engine's CPU kernels: the AVX-512 code is compiled for its own target
// (a function attribute) whatever the library's flags, so one library serves every x86 host, and it runs only
// where host_has_avx512() says the CPU has the instructions.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RINGSTREAM_X86 1
// AVX512_BF16 is in the target for VDPBF16PS alone (run only after host_has_avx512_bf16()); the compiler emits
// none of its three instructions on its own.
#define RINGSTREAM_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,fma")))
#endif

namespace ringstream_cpu {

// AVX-512 F, VL, BW and DQ, and FMA.
inline bool host_has_avx512() {
#ifdef RINGSTREAM_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

// The above and AVX512_BF16 (VDPBF16PS, VCVTNEPS2BF16).
inline bool host_has_avx512_bf16() {
#ifdef RINGSTREAM_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return host_has_avx512() && __builtin_cpu_supports("avx512bf16");
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace ringstream_cpu
