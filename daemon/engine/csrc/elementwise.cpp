// Fused float32 elementwise steps of a decoder layer (CPU), registered as torch.ops.ringstream.rms_norm and
// torch.ops.ringstream.silu_and_mul.
//
// rms_norm(x [..., H], weight [H], eps) = weight * x / sqrt(mean(x^2) + eps): the RMSNorm of Zhang and Sennrich
// ("Root Mean Square Layer Normalization", 2019) as Llama's modules compute it, in one pass for the mean and one
// for the output instead of six tensor ops (to, pow, mean, add, rsqrt, two muls), each a pass over memory.
// silu_and_mul(y [..., 2I]) = silu(y[..., :I]) * y[..., I:]: the gated MLP's activation (Shazeer, "GLU Variants
// Improve Transformer", 2020) read from the fused gate/up projection's output, as vLLM's SiluAndMul.
// Rows are split across torch's threads with at::parallel_for.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "exp_avx2.h"
#endif

namespace {

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_float(input, "rms_norm", "input");
  check_float(weight, "rms_norm", "weight");
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1),
              "rms_norm: weight must be [", input.size(-1), "], got ", weight.sizes());
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * H;
      float* orow = op + r * H;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < H; ++i) sum += xr[i] * xr[i];
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * scale);
    }
  });
  return out;
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
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = yp + r * width;
      const float* up = gate + half;
      float* orow = op + r * half;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      // silu(g) = g / (1 + exp(-g)); with e = exp(-|g|) (an argument <= 0): g / (1 + e) for g >= 0, g e / (1 + e)
      // below, the same value without overflow
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= half; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_neg(_mm256_or_ps(g, sign));  // -|g|
        const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g);  // sign bit of g picks g * e
        // below exp's range (g < -87) silu(g) is -0 to float32 precision; num would be g times exp's floor
        const __m256 s = _mm256_and_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)),
                                       _mm256_cmp_ps(g, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < half; ++i) orow[i] = gate[i] < -87.0f ? 0.0f : gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
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
