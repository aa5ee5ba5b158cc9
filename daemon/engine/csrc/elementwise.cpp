// Fused float32 elementwise steps of a decoder layer (CPU), registered as torch.ops.ringstream.rms_norm and
// torch.ops.ringstream.silu_and_mul.
//
// rms_norm(x [..., H], weight [H], eps) = weight * x / sqrt(mean(x^2) + eps): the RMSNorm of Zhang and Sennrich
// ("Root Mean Square Layer Normalization", 2019) as Llama's modules compute it, in one pass for the mean and one
// for the output instead of six tensor ops (to, pow, mean, add, rsqrt, two muls), each a pass over memory.
// silu_and_mul(y [..., 2I]) = silu(y[..., :I]) * y[..., I:]: the gated MLP's activation (Shazeer, "GLU Variants
// Improve Transformer", 2020) read from the fused gate/up projection's output, as vLLM's SiluAndMul.
// Rows are split across torch's threads with at::parallel_for.
//
// bfloat16 inputs are computed in float32 and rounded to bfloat16 (to nearest even, as torch rounds) where the
// modules' own bfloat16 code rounds: RMSNorm's normalised value before the weight's product and the product;
// the gate's silu before the product with up, and the product.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "exp_avx2.h"
#endif

namespace {

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

using bf16 = c10::BFloat16;

// float32 <-> bfloat16 of 8 lanes: widening is exact; narrowing rounds to nearest even (NaN stays a quiet NaN),
// the rounding of c10::BFloat16(float).
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256i bf16_bits(__m256 v) {  // the rounded bfloat16 of each lane, in the low 16 bits of its 32
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 round8(const float*, __m256 v) { return v; }  // float32 storage: no rounding between steps
inline __m256 round8(const bf16*, __m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v), bf16_bits(v)), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// A value as its storage type T holds it (float32: as it is; bfloat16: rounded), as a float.
template <typename T>
inline float rounded(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
void rms_norm_rows(const T* xp, const T* wp, T* op, int64_t rows, int64_t H, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * H;
      T* orow = op + r * H;
      float sum = 0.0f;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < H; ++j) sum += xr[j] * xr[j];
        i = H;
      } else {
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= H; i += 8) {
          const __m256 v = load8(xr + i);
          acc = _mm256_fmadd_ps(v, v, acc);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc);
        for (float lane : lanes) sum += lane;
#endif
        for (; i < H; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      }
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      i = 0;
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) orow[j] = wp[j] * (xr[j] * scale);
        i = H;
      } else {
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 sv = _mm256_set1_ps(scale);
        for (; i + 8 <= H; i += 8)
          store8(orow + i, _mm256_mul_ps(load8(wp + i), round8(xr, _mm256_mul_ps(load8(xr + i), sv))));
#endif
        for (; i < H; ++i)
          orow[i] = static_cast<T>(static_cast<float>(wp[i]) * rounded<T>(static_cast<float>(xr[i]) * scale));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_float(input, "rms_norm", "input");
  check_float(weight, "rms_norm", "weight");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), "rms_norm: weight and input must have one dtype, got ",
              weight.scalar_type(), " and ", input.scalar_type());
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1),
              "rms_norm: weight must be [", input.size(-1), "], got ", weight.sizes());
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<bf16>(), w.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, H, eps);
  } else {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, H, eps);
  }
  return out;
}

template <typename T>
void silu_and_mul_rows(const T* yp, T* op, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = yp + r * 2 * half;
      const T* up = gate + half;
      T* orow = op + r * half;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      // silu(g) = g / (1 + exp(-g)); with e = exp(-|g|) (an argument <= 0): g / (1 + e) for g >= 0, g e / (1 + e)
      // below, the same value without overflow
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= half; i += 8) {
        const __m256 g = load8(gate + i);
        const __m256 e = exp_neg(_mm256_or_ps(g, sign));  // -|g|
        const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g);  // sign bit of g picks g * e
        // below exp's range (g < -87) silu(g) is -0 to float32 precision; num would be g times exp's floor
        const __m256 s = _mm256_and_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)),
                                       _mm256_cmp_ps(g, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
        store8(orow + i, _mm256_mul_ps(round8(gate, s), load8(up + i)));
      }
#endif
      for (; i < half; ++i) {
        const float g = static_cast<float>(gate[i]);
        orow[i] = static_cast<T>(rounded<T>(g < -87.0f ? 0.0f : g / (1.0f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& input) {
  check_float(input, "silu_and_mul", "input");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, "silu_and_mul: last dimension must be even, got ",
              input.sizes());
  const at::Tensor y = input.contiguous();
  const int64_t width = y.size(-1), half = width / 2, rows = width == 0 ? 0 : y.numel() / width;
  std::vector<int64_t> shape(y.sizes().begin(), y.sizes().end());
  shape.back() = half;
  at::Tensor out = at::empty(shape, y.options());
  if (y.scalar_type() == at::kBFloat16) {
    silu_and_mul_rows(y.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, half);
  } else {
    silu_and_mul_rows(y.data_ptr<float>(), out.data_ptr<float>(), rows, half);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringstream, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor input) -> Tensor");
}

TORCH_LIBRARY_IMPL(ringstream, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
