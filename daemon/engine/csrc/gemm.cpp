// Float32 and bfloat16 linear layers over a weight packed once into column panels (CPU), registered as
// torch.ops.ringstream.pack_linear_weight and torch.ops.ringstream.packed_linear.
//
// bfloat16: the weight stays bfloat16 in its panels, so a decode step streams half the bytes; each output is a
// float32 sum of exact products, rounded to bfloat16 once. Where the host has AVX512_BF16 the panel holds pairs
// of consecutive k per column and VDPBF16PS multiplies two pairs per lane (twice the float32 FMA's products per
// instruction); elsewhere the weights are widened to float32 as they load (Bf16Widened on AVX-512 hosts, the
// 24-column AVX2 kernel's widening load elsewhere), so every host gives the same sums.
// 2-core AMD EPYC (AVX512_BF16), 2 threads, a decode step's weights of the 82M Llama (157 MB): 4.4 ms at 16 rows
// (35 GB/s) against 5.1 for oneDNN's packed bfloat16 matmul and 11.8 for F.linear; 46.7 ms at 256 rows, oneDNN
// 44.6.
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
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>

#include "cpu_features.h"

namespace {

constexpr int64_t kPanelAvx2 = 24;    // output columns per panel: three AVX2 registers
constexpr int64_t kRowsAvx2 = 4;      // rows of its microkernel
constexpr int64_t kPanelAvx512 = 48;  // three AVX-512 registers
constexpr int64_t kRowsAvx512 = 8;

using ringstream_cpu::host_has_avx512;
using ringstream_cpu::host_has_avx512_bf16;

int64_t host_panel() { return host_has_avx512() ? kPanelAvx512 : kPanelAvx2; }

constexpr int64_t kPairPanel = 2 * kPanelAvx512;  // a bfloat16 panel of k-pairs: 48 columns x 2 k per row

// Software prefetches of a microkernel, by the place of its row block in a panel's pass (rows of one task):
// the first block reads the panel from memory and fetches kAheadRows k-rows ahead into L1; every block fetches
// its share of the next panel into L2 as it computes (panel24, panel48), so that the next panel's memory reads
// overlap all of this one's arithmetic. Measured on the AVX-512 host over a decode step's weights (314 MB, 16
// rows): 1.3-1.4x the kernel without them; on a 2-core AMD EPYC (AVX-512), sharing the next panel's reads among
// the blocks instead of leaving them to the last: 24 rows 12.2 -> 10.5 ms, 16 rows 9.9 -> 9.3 (medians of six
// alternating runs), bfloat16 at 48 rows 10.2 -> 9.3; on a 2-core AMD EPYC with AVX2 alone, the AVX2 kernel
// (bench_linears, 302 MB, alternating pairs): 8 rows 15.6-16.6 -> 13.3-14.5 ms, 16 rows 22.4-22.5 -> 16.2-20.4,
// 24 rows 28.7-32.2 -> 21.9-28.9.
constexpr int kFetchAhead = 1, kFetchNext = 2;
constexpr int64_t kAheadRows = 16;

// ---- P = 24: AVX2 + FMA, or the same blocking left to the compiler's vectoriser

// The part of the next panel that a row block fetches into L2 as it computes: one k-row (row, advanced by a
// panel row each time) every `every` k-steps while row < end.
template <typename W>
struct NextSlice {
  const W* row = nullptr;
  const W* end = nullptr;
  int every = 1;
  int countdown = 1;
};

// Row block b's slice of `next` (a panel of K k-rows of `row` elements) among `blocks` blocks: k-rows
// [b K / blocks, (b + 1) K / blocks), one every `blocks` k-steps; empty where there is no next panel.
template <typename W>
NextSlice<W> next_slice(const W* next, int64_t K, int64_t row, int64_t b, int64_t blocks) {
  NextSlice<W> s{};
  if (next != nullptr) {
    s.row = next + b * K / blocks * row;
    s.end = next + (b + 1) * K / blocks * row;
    s.every = s.countdown = static_cast<int>(blocks);
  }
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)

// Eight weights as float32: loaded, or bfloat16 widened (the top half of a float32: exact).
inline __m256 load_weights8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_weights8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Both cache lines that a k-row of a 24-column panel (96 bytes of float32, 48 of bfloat16) can touch: its first
// and its last byte.
template <bool kToL2, typename W>
inline void prefetch_panel_row(const W* row) {
  const char* c = reinterpret_cast<const char*>(row);
  _mm_prefetch(c, kToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
  _mm_prefetch(c + kPanelAvx2 * sizeof(W) - 1, kToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

template <int MR, int FETCH, typename W>
inline void microkernel24(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy,
                          const float* bias, int64_t cols, NextSlice<W> next) {
  constexpr int V = kPanelAvx2 / 8;  // registers across a panel row
  __m256 acc[MR][V];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = load_weights8(w + k * kPanelAvx2 + 8 * v);
    if constexpr ((FETCH & kFetchAhead) != 0) prefetch_panel_row<false>(w + (k + kAheadRows) * kPanelAvx2);
    if constexpr ((FETCH & kFetchNext) != 0) {
      if (--next.countdown == 0) {  // one k-row of this block's slice of the next panel every `every` k-steps
        next.countdown = next.every;
        if (next.row < next.end) prefetch_panel_row<true>(next.row);
        next.row += kPanelAvx2;
      }
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

template <int MR, int FETCH, typename W>
inline void microkernel24(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy,
                          const float* bias, int64_t cols, NextSlice<W> /*next*/) {
  float acc[MR][kPanelAvx2] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int64_t j = 0; j < kPanelAvx2; ++j)
        acc[r][j] += x[r * ldx + k] * static_cast<float>(w[k * kPanelAvx2 + j]);
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}

#endif

template <int MR, typename W>
void block24(int fetch, const float* x, int64_t K, const W* w, float* y, int64_t N, const float* bias,
             int64_t cols, NextSlice<W> next) {
  switch (fetch) {
    case 0: return microkernel24<MR, 0>(x, K, w, K, y, N, bias, cols, next);
    case kFetchAhead: return microkernel24<MR, kFetchAhead>(x, K, w, K, y, N, bias, cols, next);
    case kFetchNext: return microkernel24<MR, kFetchNext>(x, K, w, K, y, N, bias, cols, next);
    default: return microkernel24<MR, kFetchAhead | kFetchNext>(x, K, w, K, y, N, bias, cols, next);
  }
}

// rows [0, rows) of x [rows, K] (row stride K) times one panel -> y (row stride N), cols of the panel's columns;
// next: the panel this task computes after it, or null. Each row block fetches its share of the next panel into
// L2 (block b of nb: k-rows [b K / nb, (b + 1) K / nb), one every nb k-steps), as panel48's do. W: float32, or
// bfloat16 widened as it loads.
template <typename W>
void panel24(int64_t rows, const float* x, int64_t K, const W* w, float* y, int64_t N, const float* bias,
             int64_t cols, const W* next) {
  static_assert(kRowsAvx2 == 4, "the tail below covers 1 to 3 rows");
  const int64_t blocks = (rows + kRowsAvx2 - 1) / kRowsAvx2;
  const auto slice = [&](int64_t b) { return next_slice(next, K, kPanelAvx2, b, blocks); };
  const int with_next = next != nullptr ? kFetchNext : 0;
  int64_t m = 0;
  for (; m + kRowsAvx2 <= rows; m += kRowsAvx2)
    block24<kRowsAvx2>((m == 0 ? kFetchAhead : 0) | with_next, x + m * K, K, w, y + m * N, N, bias, cols,
                       slice(m / kRowsAvx2));
  const int fetch = (m == 0 ? kFetchAhead : 0) | with_next;
  const NextSlice<W> last = slice(m / kRowsAvx2);
  x += m * K, y += m * N;
  switch (rows - m) {
    case 3: return block24<3>(fetch, x, K, w, y, N, bias, cols, last);
    case 2: return block24<2>(fetch, x, K, w, y, N, bias, cols, last);
    case 1: return block24<1>(fetch, x, K, w, y, N, bias, cols, last);
    default: return;
  }
}

// ---- P = 48: AVX-512

#ifdef RINGSTREAM_X86

// How an AVX-512 microkernel reads a panel and x: the weights of one k-step (kRow elements of W, V vectors of
// kLane), the x value(s) of a row broadcast, and the FMA. Three kinds:
// - Float32: float32 weights and x (48 columns per k, one FMA per column).
// - Bf16Widened: bfloat16 weights widened to float32 as they are loaded (bfloat16 is the top half of a float32:
//   exact), float32 x: half the bytes streamed, float32 arithmetic; every AVX-512 host.
// - Bf16Pairs: bfloat16 weights packed as pairs of consecutive k (48 columns x 2 per k-step) and bfloat16 x, by
//   AVX512_BF16's VDPBF16PS (acc += x[2k] w[2k] + x[2k+1] w[2k+1] per column, float32 accumulation): twice the
//   products per instruction of the float32 FMA, for the prompt chunks' compute-bound GEMMs.

struct Float32 {
  using W = float;
  using X = float;
  using Out = float;
  using Vec = __m512;
  using XB = __m512;
  static constexpr int64_t kRow = kPanelAvx512, kLane = 16;
  RINGSTREAM_AVX512 static Vec load(const W* p) { return _mm512_loadu_ps(p); }
  RINGSTREAM_AVX512 static XB broadcast(const X* x, int64_t k) { return _mm512_set1_ps(x[k]); }
  RINGSTREAM_AVX512 static __m512 fma(__m512 acc, XB x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct Bf16Widened : Float32 {
  using W = c10::BFloat16;
  RINGSTREAM_AVX512 static Vec load(const W* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
};

struct Bf16Pairs {
  using W = c10::BFloat16;
  using X = c10::BFloat16;
  using Out = c10::BFloat16;  // rounded by VCVTNEPS2BF16 (to nearest even, as torch rounds) as it is stored
  using Vec = __m512i;
  using XB = __m512i;
  static constexpr int64_t kRow = 2 * kPanelAvx512, kLane = 32;
  RINGSTREAM_AVX512 static Vec load(const W* p) { return _mm512_loadu_si512(p); }
  RINGSTREAM_AVX512 static XB broadcast(const X* x, int64_t k) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * k, sizeof(pair));
    return _mm512_set1_epi32(pair);
  }
  RINGSTREAM_AVX512 static __m512 fma(__m512 acc, XB x, Vec w) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(w));
  }
};

// y[r, c] (+ bias) for MR rows of x (row stride ldx, in X elements) and one panel: K k-steps (pairs of k for
// Bf16Pairs) of kRow weights each.
template <int MR, int FETCH, typename S>
RINGSTREAM_AVX512 inline void microkernel48(const typename S::X* x, int64_t ldx, const typename S::W* w, int64_t K,
                                            typename S::Out* y, int64_t ldy, const float* bias, int64_t cols,
                                            NextSlice<typename S::W> next) {
  constexpr int V = kPanelAvx512 / 16;
  constexpr int64_t R = S::kRow, L = S::kLane;
  __m512 acc[MR][V];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    typename S::Vec wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = S::load(w + k * R + L * v);
    if constexpr ((FETCH & kFetchAhead) != 0) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAheadRows) * R + L * v), _MM_HINT_T0);
    }
    if constexpr ((FETCH & kFetchNext) != 0) {
      if (--next.countdown == 0) {  // one k-row of this block's slice of the next panel every `every` k-steps
        next.countdown = next.every;
        if (next.row < next.end) {
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) _mm_prefetch(reinterpret_cast<const char*>(next.row + L * v), _MM_HINT_T1);
        }
        next.row += R;
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const typename S::XB xv = S::broadcast(x + r * ldx, k);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = S::fma(acc[r][v], xv, wv[v]);
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
    for (int v = 0; v < V; ++v) {
      const __m512 out = bias ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + 16 * v)) : acc[r][v];
      if constexpr (std::is_same_v<typename S::Out, float>) {
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v], out);
      } else {
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask[v], reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(out)));
      }
    }
}

template <int MR, typename S>
RINGSTREAM_AVX512 void block48(int fetch, const typename S::X* x, int64_t ldx, const typename S::W* w, int64_t K,
                               typename S::Out* y, int64_t N, const float* bias, int64_t cols,
                               NextSlice<typename S::W> next) {
  switch (fetch) {
    case 0: return microkernel48<MR, 0, S>(x, ldx, w, K, y, N, bias, cols, next);
    case kFetchAhead: return microkernel48<MR, kFetchAhead, S>(x, ldx, w, K, y, N, bias, cols, next);
    case kFetchNext: return microkernel48<MR, kFetchNext, S>(x, ldx, w, K, y, N, bias, cols, next);
    default: return microkernel48<MR, kFetchAhead | kFetchNext, S>(x, ldx, w, K, y, N, bias, cols, next);
  }
}

// rows [0, rows) of x [rows, ldx] times one panel of K k-steps -> y (row stride N), cols of the panel's columns;
// next: the panel this task computes after it, or null. Each of the panel's row blocks fetches its share of the
// next panel into L2 (block b of nb: k-rows [b K / nb, (b + 1) K / nb), one every nb k-steps), so that the next
// panel streams from memory during all of this one's arithmetic, not during its last block alone.
template <typename S>
RINGSTREAM_AVX512 void panel48(int64_t rows, const typename S::X* x, int64_t ldx, const typename S::W* w, int64_t K,
                               typename S::Out* y, int64_t N, const float* bias, int64_t cols,
                               const typename S::W* next) {
  static_assert(kRowsAvx512 == 8, "the tail below covers 1 to 7 rows");
  constexpr int64_t R = S::kRow;
  const int64_t blocks = (rows + kRowsAvx512 - 1) / kRowsAvx512;
  const auto slice = [&](int64_t b) { return next_slice(next, K, R, b, blocks); };
  const int with_next = next != nullptr ? kFetchNext : 0;
  int64_t m = 0;
  for (; m + kRowsAvx512 <= rows; m += kRowsAvx512)
    block48<kRowsAvx512, S>((m == 0 ? kFetchAhead : 0) | with_next, x + m * ldx, ldx, w, K, y + m * N, N, bias, cols,
                            slice(m / kRowsAvx512));
  const int fetch = (m == 0 ? kFetchAhead : 0) | with_next;
  const NextSlice<typename S::W> last = slice(m / kRowsAvx512);
  x += m * ldx, y += m * N;
  switch (rows - m) {
    case 7: return block48<7, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    case 6: return block48<6, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    case 5: return block48<5, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    case 4: return block48<4, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    case 3: return block48<3, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    case 2: return block48<2, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    case 1: return block48<1, S>(fetch, x, ldx, w, K, y, N, bias, cols, last);
    default: return;
  }
}

#else

struct Float32 { using W = float; using X = float; using Out = float; };
struct Bf16Widened { using W = c10::BFloat16; using X = float; using Out = float; };
struct Bf16Pairs { using W = c10::BFloat16; using X = c10::BFloat16; using Out = c10::BFloat16; };

template <typename S>
void panel48(int64_t, const typename S::X*, int64_t, const typename S::W*, int64_t, typename S::Out*, int64_t,
             const float*, int64_t, const typename S::W*) {
  TORCH_CHECK(false, "packed_linear: 48-column panels need AVX-512");
}

#endif

// panel: 24 or 48 columns (float32, or bfloat16 widened as it loads), or kPairPanel (bfloat16 k-pairs of 48
// columns).
void check_panel(int64_t panel, bool bf16, const char* op) {
  TORCH_CHECK(panel == kPanelAvx2 || panel == kPanelAvx512 || panel == kPairPanel, op, ": panels are ", kPanelAvx2,
              " or ", kPanelAvx512, " columns wide (", kPairPanel, ": bfloat16 pairs of ", kPanelAvx512, "), got ",
              panel);
  TORCH_CHECK(bf16 || panel != kPairPanel, op, ": ", kPairPanel, "-wide panels hold bfloat16 weights only");
  TORCH_CHECK(panel == kPanelAvx2 || host_has_avx512(), op, ": ", panel, "-wide panels need AVX-512, which this CPU ",
              "does not have");
  TORCH_CHECK(panel != kPairPanel || host_has_avx512_bf16(), op, ": bfloat16 pair panels need AVX512_BF16, which "
              "this CPU does not have");
}

// panels [ceil(N / C), S, C * G] of w [N, K]: C columns per panel, G consecutive k per column in a row (G = 1:
// row k holds W[:, k]; G = 2: row s holds W[c, 2s] and W[c, 2s + 1] side by side), zero-padded in N and K.
template <typename T>
void pack_panels(const at::Tensor& w, at::Tensor& packed, int64_t C, int64_t G) {
  const int64_t N = w.size(0), K = w.size(1), panels = packed.size(0), S = packed.size(1);
  const T* src = w.data_ptr<T>();
  T* dst = packed.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < C && p * C + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[((p * S + k / G) * C + j) * G + k % G] = src[(p * C + j) * K + k];
  });
}

// weight [N, K] -> panels [ceil(N / C), S, P]: float32 as 24- or 48-column panels (P = C, S = K); bfloat16 as
// 48-column panels of k-pairs where the host has AVX512_BF16 and K is even (P = 96, S = K / 2), else widened as
// it is read (P = 48 on AVX-512 hosts, 24 elsewhere; S = K). panel 0: the host's best for the dtype and shape.
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t panel) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out_features, in_features], got ",
              weight.sizes());
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.scalar_type() == at::kFloat || bf16, "pack_linear_weight: float32 or bfloat16 only, got ",
              weight.scalar_type());
  const int64_t K = weight.size(1);
  const int64_t P = panel != 0 ? panel
                    : !bf16 ? host_panel()
                    : host_has_avx512_bf16() && K % 2 == 0 ? kPairPanel : host_panel();
  check_panel(P, bf16, "pack_linear_weight");
  // pairs of an even K only: the packed shape then says K exactly (an odd one would be ambiguous with K + 1)
  TORCH_CHECK(P != kPairPanel || K % 2 == 0, "pack_linear_weight: bfloat16 pair panels need an even in_features, "
              "got ", K);
  const int64_t G = P == kPairPanel ? 2 : 1, C = P / G;
  const int64_t N = weight.size(0), panels = (N + C - 1) / C;
  at::Tensor packed = at::zeros({panels, K / G, P}, weight.options());
  const at::Tensor w = weight.contiguous();
  if (bf16) {
    pack_panels<c10::BFloat16>(w, packed, C, G);
  } else {
    pack_panels<float>(w, packed, C, G);
  }
  return packed;
}

// y [M, N] = x [M, ldx] times the panels (C columns and S rows of P weights each; and bias), split into tasks of
// one panel over a block of rows.
template <typename X, typename W, typename Y, typename PanelRows>
void run_panels(const X* xp, int64_t ldx, const W* wp, int64_t S, int64_t P, int64_t C, Y* yp, const float* b,
                int64_t M, int64_t N, int64_t panels, PanelRows panel_rows) {
  const int64_t rows = C == kPanelAvx512 ? kRowsAvx512 : kRowsAvx2;
  const int64_t wanted = (4 * at::get_num_threads() + panels - 1) / panels;
  const int64_t row_block = ((M + wanted - 1) / wanted + rows - 1) / rows * rows;  // whole microkernels
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels, m = (task / panels) * row_block, m_end = std::min(M, m + row_block);
      // the panel this thread computes next: the next task's, where this range holds it
      const W* next = task + 1 < end ? wp + ((task + 1) % panels) * S * P : nullptr;
      panel_rows(m_end - m, xp + m * ldx, ldx, wp + p * S * P, S, yp + m * N + p * C, N, b ? b + p * C : nullptr,
                 std::min(C, N - p * C), next);
    }
  });
}

// x [..., K] float32, packed from pack_linear_weight of a [N, K] weight, bias [N] or None -> [..., N]. A bfloat16
// weight takes a bfloat16 x (and bias): each output one float32 sum over k in order of exact products (the
// bfloat16 values widened, or VDPBF16PS's pairs), rounded to bfloat16 once, at the end.
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK((input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat) ||
              (input.scalar_type() == at::kBFloat16 && bf16),
              "packed_linear: float32 or bfloat16 (input and weight alike), got ", input.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed_linear: the weight must come from pack_linear_weight");
  const int64_t P = packed.size(2);
  check_panel(P, bf16, "packed_linear");
  const bool pairs = P == kPairPanel;
  const int64_t C = pairs ? kPanelAvx512 : P, S = packed.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == (pairs ? 2 * S : S),
              "packed_linear: input's last dimension must be ", pairs ? 2 * S : S, ", got ", input.sizes());
  const int64_t K = input.size(-1);
  TORCH_CHECK(N > (panels - 1) * C && N <= panels * C, "packed_linear: ", N, " output features do not fit ", panels,
              " panels");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() && bias->dim() == 1 && bias->numel() == N,
                "packed_linear: bias must be ", bf16 ? "bfloat16" : "float32", " [", N, "], got ",
                bias->scalar_type(), " ", bias->sizes());
    if (N % C == 0 && !bf16) {
      bias_c = bias->contiguous();
    } else {  // float32, padded to whole panels, so the microkernel reads C values for the last one too
      bias_c = at::zeros({panels * C}, bias->options().dtype(at::kFloat));
      bias_c.narrow(0, 0, N).copy_(*bias);
    }
    b = bias_c.data_ptr<float>();
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  // y in float32, rounded to bfloat16 at the end for a widened bfloat16 weight; in bfloat16 from the pairs'
  // microkernel itself
  at::Tensor out = at::empty(shape, input.options().dtype(pairs ? at::kBFloat16 : at::kFloat));
  const auto result = [&] { return bf16 && !pairs ? out.to(at::kBFloat16) : out; };
  if (K == 0) {  // an empty sum: the bias alone
    out.zero_();
    if (b != nullptr) out.add_(bias_c.narrow(0, 0, N));
    return result();
  }
  const int64_t M = input.numel() / K;
  if (M == 0 || N == 0) return result();
  if (pairs) {  // x as bfloat16 pairs (K is even)
    const at::Tensor x = input.reshape({M, K}).contiguous();
    run_panels(x.data_ptr<c10::BFloat16>(), K, packed.data_ptr<c10::BFloat16>(), S, P, C,
               out.data_ptr<c10::BFloat16>(), b, M, N, panels, panel48<Bf16Pairs>);
    return out;
  }
  float* yp = out.data_ptr<float>();
  // the AVX2 kernel's panel over a block of rows, for float32 or bfloat16 (widened) weights alike
  const auto rows24 = [](int64_t rows, const float* xr, int64_t, const auto* w, int64_t k, float* y, int64_t ldy,
                         const float* bias, int64_t cols, const auto* next) {
    panel24(rows, xr, k, w, y, ldy, bias, cols, next);
  };
  if (bf16) {
    const at::Tensor x = input.to(at::kFloat).contiguous();
    const auto* w = packed.data_ptr<c10::BFloat16>();
    if (P == kPanelAvx512) {
      run_panels(x.data_ptr<float>(), K, w, S, P, C, yp, b, M, N, panels, panel48<Bf16Widened>);
    } else {
      run_panels(x.data_ptr<float>(), K, w, S, P, C, yp, b, M, N, panels, rows24);
    }
  } else {
    const at::Tensor x = input.contiguous();
    const float* w = packed.data_ptr<float>();
    if (P == kPanelAvx512) {
      run_panels(x.data_ptr<float>(), K, w, S, P, C, yp, b, M, N, panels, panel48<Float32>);
    } else {
      run_panels(x.data_ptr<float>(), K, w, S, P, C, yp, b, M, N, panels, rows24);
    }
  }
  return result();
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
