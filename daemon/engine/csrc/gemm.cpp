// Float32 linear layers over a weight packed once into column panels (CPU), registered as
// torch.ops.ringstream.pack_linear_weight and torch.ops.ringstream.packed_linear.
//
// y[M, N] = x[M, K] W[N, K]^T + b. The weight is stored as ceil(N / P) panels of [K, P] (P output columns, K
// contiguous, the last panel zero-padded), so a panel streams from memory once, sequentially. Two microkernels,
// chosen by the panel width the weight was packed with (the host's best unless asked):
//
// - P = 48, AVX-512 (hosts with AVX-512 F/VL/BW/DQ): an 8 x 48 block of y in 24 zmm registers; for each k the
//   panel's 48 weights are loaded once and 8 x values broadcast: 24 FMAs to 11 loads. Measured on a 2-core Intel
//   Xeon (AVX-512, 2 FMA units), 2 threads: 220-250 GFLOPS at 16 rows against 85-150 for torch's F.linear (MKL)
//   and 164 for the AVX2 kernel on the same host; 290-330 at 48-1,056 rows, on par with oneDNN and MKL. 8 x 48
//   and 6 x 64 were the best of 4 x 32, 8 x 32, 12 x 32, 4 x 64 and 16 x 16 at 16-1,056 rows; 48 divides the
//   row count of decode batches of 8 and 16 and wastes little padding on widths that are multiples of 16.
// - P = 24, AVX2 + FMA: a 4 x 24 block in twelve ymm registers, 12 FMAs to 7 loads (measured faster than 6 x 16
//   and 8 x 8 at 15-100 rows). On a 2-core AMD EPYC (AVX2), 2 threads, weights streamed from memory as in a
//   decode step: 1.4-1.8x oneDNN's packed matmul at 16 rows, 1.1x at 64, 0.9-1.3x at 128-1,024 rows.
//
// Both are the register blocking of BLIS / GotoBLAS ("Anatomy of High-Performance Matrix Multiplication", Goto
// and van de Geijn, 2008) with the packed B panel and no packing of x (decode steps have few rows; x stays in
// cache). Tasks are panels, split by at::parallel_for, each over all rows; only a weight of fewer panels than 4
// per thread is split by rows too, so that every thread has work. Each output is one float32 sum over k in
// order, as a dot product is. The AVX-512 code is compiled for its target alone (a function attribute), so one
// library serves both kinds of host; it runs only where the CPU reports the instructions.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RINGSTREAM_X86 1
// The AVX-512 code's own target: compiled for it whatever the library's flags, run only after host_has_avx512().
#define RINGSTREAM_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma")))
#endif

namespace {

constexpr int64_t kPanelAvx2 = 24;    // output columns per panel: three AVX2 registers
constexpr int64_t kRowsAvx2 = 4;      // rows of its microkernel
constexpr int64_t kPanelAvx512 = 48;  // three AVX-512 registers
constexpr int64_t kRowsAvx512 = 8;

bool host_has_avx512() {
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

int64_t host_panel() { return host_has_avx512() ? kPanelAvx512 : kPanelAvx2; }

// Software prefetches of a microkernel, by the place of its row block in a panel's pass (rows of one task):
// the first block reads the panel from memory and fetches kAheadRows k-rows ahead into L1; the last block
// (which finds the panel in cache) fetches the same k-row of the next panel into L2, so that the next panel's
// memory reads overlap this one's arithmetic. A single block does both. Measured on the AVX-512 host over a
// decode step's weights (314 MB, 16 rows): 1.3-1.4x the kernel without them.
constexpr int kFetchAhead = 1, kFetchNext = 2;
constexpr int64_t kAheadRows = 16;

inline int fetch_flags(int64_t m, int64_t rows, int64_t block, bool has_next) {
  return (m == 0 ? kFetchAhead : 0) | (m + block >= rows && has_next ? kFetchNext : 0);
}

// ---- P = 24: AVX2 + FMA, or the same blocking left to the compiler's vectoriser

#if defined(__AVX2__) && defined(__FMA__)

template <int MR, int FETCH>
inline void microkernel24(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                          const float* bias, int64_t cols, const float* next) {
  constexpr int V = kPanelAvx2 / 8;  // registers across a panel row
  __m256 acc[MR][V];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(w + k * kPanelAvx2 + 8 * v);
    // a k-row of a 24-column panel is 96 bytes: its two cache lines at offsets 0 and 64
    if constexpr ((FETCH & kFetchAhead) != 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAheadRows) * kPanelAvx2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAheadRows) * kPanelAvx2 + 16), _MM_HINT_T0);
    }
    if constexpr ((FETCH & kFetchNext) != 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanelAvx2), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanelAvx2 + 16), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  alignas(32) float tail[kPanelAvx2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* out = cols == kPanelAvx2 ? y + r * ldy : tail;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      _mm256_storeu_ps(out + 8 * v, bias ? _mm256_add_ps(acc[r][v], _mm256_loadu_ps(bias + 8 * v)) : acc[r][v]);
    if (cols != kPanelAvx2) std::copy(tail, tail + cols, y + r * ldy);
  }
}

#else

template <int MR, int FETCH>
inline void microkernel24(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                          const float* bias, int64_t cols, const float* /*next*/) {
  float acc[MR][kPanelAvx2] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int64_t j = 0; j < kPanelAvx2; ++j) acc[r][j] += x[r * ldx + k] * w[k * kPanelAvx2 + j];
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}

#endif

template <int MR>
void block24(int fetch, const float* x, int64_t K, const float* w, float* y, int64_t N, const float* bias,
             int64_t cols, const float* next) {
  switch (fetch) {
    case 0: return microkernel24<MR, 0>(x, K, w, K, y, N, bias, cols, next);
    case kFetchAhead: return microkernel24<MR, kFetchAhead>(x, K, w, K, y, N, bias, cols, next);
    case kFetchNext: return microkernel24<MR, kFetchNext>(x, K, w, K, y, N, bias, cols, next);
    default: return microkernel24<MR, kFetchAhead | kFetchNext>(x, K, w, K, y, N, bias, cols, next);
  }
}

// rows [0, rows) of x [rows, K] (row stride K) times one panel -> y (row stride N), cols of the panel's columns;
// next: the panel this task computes after it, or null.
void panel24(int64_t rows, const float* x, int64_t K, const float* w, float* y, int64_t N, const float* bias,
             int64_t cols, const float* next) {
  static_assert(kRowsAvx2 == 4, "the tail below covers 1 to 3 rows");
  int64_t m = 0;
  for (; m + kRowsAvx2 <= rows; m += kRowsAvx2)
    block24<kRowsAvx2>(fetch_flags(m, rows, kRowsAvx2, next != nullptr), x + m * K, K, w, y + m * N, N, bias, cols,
                       next);
  const int fetch = fetch_flags(m, rows, rows - m, next != nullptr);
  x += m * K, y += m * N;
  switch (rows - m) {
    case 3: return block24<3>(fetch, x, K, w, y, N, bias, cols, next);
    case 2: return block24<2>(fetch, x, K, w, y, N, bias, cols, next);
    case 1: return block24<1>(fetch, x, K, w, y, N, bias, cols, next);
    default: return;
  }
}

// ---- P = 48: AVX-512

#ifdef RINGSTREAM_X86

template <int MR, int FETCH>
RINGSTREAM_AVX512 inline void microkernel48(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                                            int64_t ldy, const float* bias, int64_t cols, const float* next) {
  constexpr int V = kPanelAvx512 / 16;
  __m512 acc[MR][V];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(w + k * kPanelAvx512 + 16 * v);
    if constexpr ((FETCH & kFetchAhead) != 0) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAheadRows) * kPanelAvx512 + 16 * v), _MM_HINT_T0);
    }
    if constexpr ((FETCH & kFetchNext) != 0) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanelAvx512 + 16 * v), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  __mmask16 mask[V];  // the columns this panel has (the last panel of a weight may be partial)
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>((1u << left) - 1u);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v],
                            bias ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + 16 * v)) : acc[r][v]);
}

template <int MR>
RINGSTREAM_AVX512 void block48(int fetch, const float* x, int64_t K, const float* w, float* y, int64_t N,
                               const float* bias, int64_t cols, const float* next) {
  switch (fetch) {
    case 0: return microkernel48<MR, 0>(x, K, w, K, y, N, bias, cols, next);
    case kFetchAhead: return microkernel48<MR, kFetchAhead>(x, K, w, K, y, N, bias, cols, next);
    case kFetchNext: return microkernel48<MR, kFetchNext>(x, K, w, K, y, N, bias, cols, next);
    default: return microkernel48<MR, kFetchAhead | kFetchNext>(x, K, w, K, y, N, bias, cols, next);
  }
}

// rows [0, rows) of x [rows, K] (row stride K) times one panel -> y (row stride N), cols of the panel's columns;
// next: the panel this task computes after it, or null.
RINGSTREAM_AVX512 void panel48(int64_t rows, const float* x, int64_t K, const float* w, float* y, int64_t N,
                               const float* bias, int64_t cols, const float* next) {
  static_assert(kRowsAvx512 == 8, "the tail below covers 1 to 7 rows");
  int64_t m = 0;
  for (; m + kRowsAvx512 <= rows; m += kRowsAvx512)
    block48<kRowsAvx512>(fetch_flags(m, rows, kRowsAvx512, next != nullptr), x + m * K, K, w, y + m * N, N, bias,
                         cols, next);
  const int fetch = fetch_flags(m, rows, rows - m, next != nullptr);
  x += m * K, y += m * N;
  switch (rows - m) {
    case 7: return block48<7>(fetch, x, K, w, y, N, bias, cols, next);
    case 6: return block48<6>(fetch, x, K, w, y, N, bias, cols, next);
    case 5: return block48<5>(fetch, x, K, w, y, N, bias, cols, next);
    case 4: return block48<4>(fetch, x, K, w, y, N, bias, cols, next);
    case 3: return block48<3>(fetch, x, K, w, y, N, bias, cols, next);
    case 2: return block48<2>(fetch, x, K, w, y, N, bias, cols, next);
    case 1: return block48<1>(fetch, x, K, w, y, N, bias, cols, next);
    default: return;
  }
}

#else

void panel48(int64_t, const float*, int64_t, const float*, float*, int64_t, const float*, int64_t, const float*) {
  TORCH_CHECK(false, "packed_linear: 48-column panels need AVX-512");
}

#endif

void check_panel(int64_t panel, const char* op) {
  TORCH_CHECK(panel == kPanelAvx2 || panel == kPanelAvx512, op, ": panels are ", kPanelAvx2, " or ", kPanelAvx512,
              " columns wide, got ", panel);
  TORCH_CHECK(panel != kPanelAvx512 || host_has_avx512(), op, ": 48-column panels need AVX-512, which this CPU ",
              "does not have");
}

// weight [N, K] float32 -> panels [ceil(N / P), K, P], the last one zero-padded; panel 0 is the host's best.
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t panel) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "pack_linear_weight: float32 only, got ", weight.scalar_type());
  const int64_t P = panel == 0 ? host_panel() : panel;
  check_panel(P, "pack_linear_weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + P - 1) / P;
  at::Tensor packed = at::zeros({panels, K, P}, weight.options());
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < P && p * P + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * P + j] = src[(p * P + j) * K + k];
  });
  return packed;
}

// x [..., K] float32, packed from pack_linear_weight of a [N, K] weight, bias [N] or None -> [..., N].
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_linear: float32 only, got ", input.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed_linear: the weight must come from pack_linear_weight");
  const int64_t P = packed.size(2);
  check_panel(P, "packed_linear");
  const int64_t K = packed.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "packed_linear: input's last dimension must be ", K,
              ", got ", input.sizes());
  TORCH_CHECK(N > (panels - 1) * P && N <= panels * P, "packed_linear: ", N, " output features do not fit ", panels,
              " panels");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == N,
                "packed_linear: bias must be float32 [", N, "], got ", bias->scalar_type(), " ", bias->sizes());
    if (N % P == 0) {
      bias_c = bias->contiguous();
    } else {  // padded to whole panels, so the microkernel reads P values for the last one too
      bias_c = at::zeros({panels * P}, bias->options());
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
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t rows = P == kPanelAvx512 ? kRowsAvx512 : kRowsAvx2;
  const auto panel_rows = P == kPanelAvx512 ? panel48 : panel24;
  const int64_t wanted = (4 * at::get_num_threads() + panels - 1) / panels;
  const int64_t row_block = ((M + wanted - 1) / wanted + rows - 1) / rows * rows;  // whole microkernels
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels, m = (task / panels) * row_block, m_end = std::min(M, m + row_block);
      // the panel this thread computes next: the next task's, where this range holds it
      const float* next = task + 1 < end ? wp + ((task + 1) % panels) * K * P : nullptr;
      panel_rows(m_end - m, xp + m * K, K, wp + p * K * P, yp + m * N + p * P, N, b ? b + p * P : nullptr,
                 std::min(P, N - p * P), next);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringstream, m) {
  m.def("pack_linear_weight(Tensor weight, int panel=0) -> Tensor");
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(ringstream, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
