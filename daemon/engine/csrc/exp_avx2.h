// exp over AVX2 registers, shared by the engine's CPU kernels (included inside their AVX2 sections).
#pragma once

#include <immintrin.h>

#include "exp_poly.h"

// exp(x) for x <= 0 (softmax after the max is subtracted), by the method and constants of exp_poly.h, eight lanes
// at a time; relative error ~2e-7, close to std::exp's.
inline __m256 exp_neg(__m256 x) {
  namespace ep = ringstream_cpu::exp_poly;
  x = _mm256_max_ps(x, _mm256_set1_ps(ep::kLowest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(ep::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ep::kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ep::kLn2Low), r);
  __m256 y = _mm256_set1_ps(ep::kCoefficients[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ep::kCoefficients[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
