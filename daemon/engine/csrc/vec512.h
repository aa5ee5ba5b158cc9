// AVX-512 loads shared by the engine's attention kernels: sixteen float32 lanes from float32, bfloat16 or float16
// memory, and exp over them. Compiled for their own target (RINGSTREAM_AVX512), run only where
// ringstream_cpu::host_has_avx512() says the host has the instructions.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_features.h"
#include "exp_poly.h"

#ifdef RINGSTREAM_X86
#define RINGSTREAM_VEC512 1

namespace ringstream_cpu {

RINGSTREAM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
RINGSTREAM_AVX512 inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
RINGSTREAM_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for x <= 0 (softmax after the maximum is subtracted), exp_avx2.h's exp_neg over sixteen lanes (the
// constants of exp_poly.h). Arguments below -87.3 give exp(-87.3) ~ 1e-38, not 0; -inf (a masked score) gives 0
// through the caller's mask.
RINGSTREAM_AVX512 inline __m512 exp_neg16(__m512 x) {
  namespace ep = exp_poly;
  x = _mm512_max_ps(x, _mm512_set1_ps(ep::kLowest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(ep::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ep::kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ep::kLn2Low), r);
  __m512 y = _mm512_set1_ps(ep::kCoefficients[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ep::kCoefficients[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

}  // namespace ringstream_cpu

#endif
