// Float32 linear layers over a weight packed once into column panels (CPU), registered as
// torch.ops.ringstream.pack_linear_weight and torch.ops.ringstream.packed_linear.
//
// y[M, N] = x[M, K] W[N, K]^T + b. The weight is stored as ceil(N / 24) panels of [K, 24] (24 output columns, K
// contiguous, the last panel zero-padded), so a panel streams from memory once, sequentially. The microkernel
// holds a 4 x 24 block of y in twelve AVX2 registers and, for each k, loads the panel's 24 weights once and
// broadcasts four x values: 12 FMAs to 7 loads (measured faster than 6 x 16 and 8 x 8 at 15-100 rows), the
// register blocking of BLIS / GotoBLAS ("Anatomy of
// High-Performance Matrix Multiplication", Goto and van de Geijn, 2008) with the packed B panel and no packing
// of x (decode steps have few rows; x stays in cache). Tasks are panels, split by at::parallel_for, each over all
// rows (row blocks of x sized for L2 measured no faster here, up to 1,024 rows); only a weight of fewer panels
// than 4 per thread is split by rows too, so that every thread has work.
//
// Measured on a 2-core AMD EPYC (AVX2), 2 threads, weights streamed from memory as in a decode step: at 16 rows
// 1.4-1.8x oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise), 1.3-1.4x at 32, 1.1x at 64, 0.9-1.3x at
// 128-1,024 rows. Each output is one float32 sum over k in order, as a dot product is.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 24;  // output columns per panel: three AVX2 registers
constexpr int64_t kRows = 4;    // rows of the microkernel

#if defined(__AVX2__) && defined(__FMA__)

template <int MR>
inline void microkernel(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                        const float* bias, int64_t cols) {
  constexpr int V = kPanel / 8;  // registers across a panel row
  __m256 acc[MR][V];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(w + k * kPanel + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  alignas(32) float tail[kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* out = cols == kPanel ? y + r * ldy : tail;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      _mm256_storeu_ps(out + 8 * v, bias ? _mm256_add_ps(acc[r][v], _mm256_loadu_ps(bias + 8 * v)) : acc[r][v]);
    if (cols != kPanel) std::copy(tail, tail + cols, y + r * ldy);
  }
}

#else  // portable: the same blocking, left to the compiler's vectoriser

template <int MR>
inline void microkernel(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                        const float* bias, int64_t cols) {
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] += x[r * ldx + k] * w[k * kPanel + j];
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}

#endif

void row_tail(int64_t rows, const float* x, int64_t K, const float* w, float* y, int64_t N, const float* bias,
              int64_t cols) {
  static_assert(kRows == 4, "row_tail covers 1 to 3 rows");
  switch (rows) {
    case 3: return microkernel<3>(x, K, w, K, y, N, bias, cols);
    case 2: return microkernel<2>(x, K, w, K, y, N, bias, cols);
    case 1: return microkernel<1>(x, K, w, K, y, N, bias, cols);
    default: return;
  }
}

// weight [N, K] float32 -> panels [ceil(N / 24), K, 24], the last one zero-padded.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "pack_linear_weight: float32 only, got ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, weight.options());
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = src[(p * kPanel + j) * K + k];
  });
  return packed;
}

// x [..., K] float32, packed from pack_linear_weight of a [N, K] weight, bias [N] or None -> [..., N].
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_linear: float32 only, got ", input.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear: the weight must come from pack_linear_weight");
  const int64_t K = packed.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "packed_linear: input's last dimension must be ", K,
              ", got ", input.sizes());
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "packed_linear: ", N,
              " output features do not fit ", panels, " panels");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "packed_linear: bias must be float32 [",
                N, "]");
    if (N % kPanel == 0) {
      bias_c = bias->contiguous();
    } else {  // padded to whole panels, so the microkernel reads 24 values for the last one too
      bias_c = at::zeros({panels * kPanel}, bias->options());
      bias_c.narrow(0, 0, N).copy_(*bias);
    }
    b = bias_c.data_ptr<float>();
  }
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (K == 0) {  // an empty sum: the bias alone
    out.zero_();
    if (b != nullptr) out.add_(bias_c.narrow(0, 0, N));
    return out;
  }
  const int64_t M = x.numel() / K;
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t wanted = (4 * at::get_num_threads() + panels - 1) / panels;
  const int64_t row_block = ((M + wanted - 1) / wanted + kRows - 1) / kRows * kRows;  // whole microkernels
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels, m_end = std::min(M, (task / panels + 1) * row_block);
      const float* w = wp + p * K * kPanel;
      const float* bp = b ? b + p * kPanel : nullptr;
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      int64_t m = (task / panels) * row_block;
      for (; m + kRows <= m_end; m += kRows)
        microkernel<kRows>(xp + m * K, K, w, K, yp + m * N + p * kPanel, N, bp, cols);
      row_tail(m_end - m, xp + m * K, K, w, yp + m * N + p * kPanel, N, bp, cols);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringstream, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(ringstream, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
