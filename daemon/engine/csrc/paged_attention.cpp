// Decode attention read in place from the paged KV pool (CPU), registered as torch.ops.ringstream.paged_decode.
//
// One query token per row attends its context, whose keys and values sit in the pool's blocks: no gather copy.
// Each (row, KV head) pair is one task of at::parallel_for; the query heads that share the KV head (grouped-query
// attention) are computed together, so each key and value row is read from memory once for all of them. The
// context's rows are fetched kPrefetchRows positions ahead (keys into L1, values into L2 during the score pass),
// since the hardware prefetcher loses the stream at every block boundary: on a 2-core Xeon, 16 rows x 316
// positions x 12 layers (124 MB of float32 keys and values, cold), 16.1 ms -> 8.4 ms. Scores and softmax
// in float32 (the pool may hold bfloat16 / float16), two passes over the context: scores, then the weighted sum
// of values. The same algorithm as vLLM's CPU paged attention (csrc/cpu/attention.cpp), written for this pool
// layout: per layer, keys [kv_heads, slots, head_dim] and values [kv_heads, slots, value_dim], slot =
// block * block_size + offset.
//
// On AVX-512 hosts, where both head sizes are multiples of 16, a second path: each position's slot is walked
// block by block once per task (no division per position), sixteen positions' scores come out of one horizontal
// reduction (hsum16) instead of one reduction each, and the weighted sum keeps up to four heads x 64 values in
// registers. On a 2-core AMD EPYC (AVX512_BF16), 16 rows x 12 layers, 4 KV heads of 64, 3 query heads each:
// bfloat16 1.4 / 2.1 / 9.2 ms at 160 / 260 / 1,000 positions against 2.1-3.4 / 4.6 / 11-19 for the AVX2 path;
// float32 on par (1.9 / 3.4 / 14.8 ms: the pool's reads bound both).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "pool_checks.h"
#include "vec512.h"

namespace {

constexpr int64_t kPrefetchRows = 16;  // how far ahead (in context positions) rows are fetched
constexpr bool kToL2 = true;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "exp_avx2.h"

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
  }
  for (; d + 8 <= n; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

// s[t] = exp(s[t] - max) / sum, in place. A NaN score or an infinite maximum makes every weight NaN, as SDPA's
// softmax does (the vector exp clamps its input, which would otherwise hide them).
inline void softmax(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t t = 0; t < n; ++t) {
    top = std::max(top, s[t]);
    nan |= std::isnan(s[t]);
  }
  if (nan || !std::isfinite(top)) {
    std::fill(s, s + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const __m256 tv = _mm256_set1_ps(top);
  __m256 sv = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), tv));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (t = 0; t < n; ++t) s[t] *= inv;
}

// Fetch the cache lines of n elements at p into L1 ahead of their use: the context's rows sit in blocks that the
// hardware prefetcher cannot follow from one block to the next.
template <typename T, bool kToL2 = false>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, kToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

// out[g * out_stride + d] = sum over t of w[g * w_stride + t] * v_t[d] for G query heads at once, d < n, the rows
// v_t found by row(t): each value row is read once for all G heads; accumulators kept in registers (G x 4).
template <typename T, int G, typename Row>
inline void weighted_sum(float* out, int64_t out_stride, const float* w, int64_t w_stride, int64_t count, int64_t n,
                         Row row) {
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    __m256 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; ++t) {
      const T* v = row(t) + d;
      if (t + kPrefetchRows < count) prefetch_row(row(t + kPrefetchRows) + d, 32);
      __m256 wv[G];
      for (int g = 0; g < G; ++g) wv[g] = _mm256_set1_ps(w[g * w_stride + t]);
      for (int j = 0; j < 4; ++j) {
        const __m256 vv = load8(v + 8 * j);
        for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(wv[g], vv, a[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + g * out_stride + d + 8 * j, a[g][j]);
  }
  for (; d < n; ++d) {
    for (int g = 0; g < G; ++g) {
      float a = 0;
      for (int64_t t = 0; t < count; ++t) a += w[g * w_stride + t] * static_cast<float>(row(t)[d]);
      out[g * out_stride + d] = a;
    }
  }
}

template <typename T>
inline void axpy(float* out, float w, const T* v, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, load8(v + d), _mm256_loadu_ps(out + d)));
  for (; d < n; ++d) out[d] += w * static_cast<float>(v[d]);
}
#else
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0;
  for (int64_t d = 0; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

inline void softmax(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
  float sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

template <typename T, bool kToL2 = false>
inline void prefetch_row(const T*, int64_t) {}

template <typename T, int G, typename Row>
inline void weighted_sum(float* out, int64_t out_stride, const float* w, int64_t w_stride, int64_t count, int64_t n,
                         Row row) {
  for (int g = 0; g < G; ++g) {
    for (int64_t d = 0; d < n; ++d) out[g * out_stride + d] = 0;
    for (int64_t t = 0; t < count; ++t) {
      const T* v = row(t);
      for (int64_t d = 0; d < n; ++d) out[g * out_stride + d] += w[g * w_stride + t] * static_cast<float>(v[d]);
    }
  }
}
#endif

// ---- AVX-512: sixteen positions' scores per horizontal reduction

#if defined(RINGSTREAM_VEC512) && defined(__AVX2__) && defined(__FMA__)
#define RINGSTREAM_DECODE512 1

constexpr int64_t kAhead512 = 32;  // positions ahead whose key and value are fetched in the score pass

using ringstream_cpu::load16;

// Lane p of the result is the sum of a[p]'s sixteen lanes: 512 -> 256 -> 128 bits by pairing registers, then the
// four lanes of each 128-bit quarter by unpacking, 45 instructions for sixteen sums (one each would take ~8). The
// last stage leaves quarter j's lane m holding register 4m + j, so registers are fed in that transposed order.
RINGSTREAM_AVX512 inline __m512 hsum16(const __m512 a[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {
    const int x = 4 * ((2 * i) % 4) + (2 * i) / 4, y = 4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4;
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[x], a[y], 0x44), _mm512_shuffle_f32x4(a[x], a[y], 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  const __m512 v0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 v1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512d d0 = _mm512_castps_pd(v0), d1 = _mm512_castps_pd(v1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
}

template <typename T, bool kToL2 = false>
RINGSTREAM_AVX512 inline void fetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, kToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

// scores[g * count + t] = scale * q[g] . key(t) for G query heads (q: [G, D] float32) over count positions whose
// key rows are k + slots[t] * k_slot (D a multiple of 16); the keys kPrefetchRows ahead go to L1 and their values
// (v + slots[t] * v_slot, VD of them) to L2 for the pass over the values.
template <typename T>
RINGSTREAM_AVX512 void scores512(float* scores, const float* q, int64_t G, int64_t D, const T* k, int64_t k_slot,
                                 const T* v, int64_t v_slot, int64_t VD, const int64_t* slots, int64_t count,
                                 float scale) {
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) {
    const T* rows[16];
    for (int p = 0; p < 16; ++p) {
      rows[p] = k + slots[t + p] * k_slot;
      if (t + p + kAhead512 < count) {
        fetch_row(k + slots[t + p + kAhead512] * k_slot, D);
        fetch_row<T, kToL2>(v + slots[t + p + kAhead512] * v_slot, VD);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) acc[p] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + d);
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) acc[p] = _mm512_fmadd_ps(qv, load16(rows[p] + d), acc[p]);
      }
      _mm512_storeu_ps(scores + g * count + t, _mm512_mul_ps(hsum16(acc), sv));
    }
  }
  for (; t < count; ++t) {  // the last positions, one at a time
    const T* row = k + slots[t] * k_slot;
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), load16(row + d), acc);
      scores[g * count + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// out[g * VD + d] = sum over t of w[g * count + t] * value(t)[d] for GB query heads and NC x 16 of the VD values
// from d0 on: each value row read once for the GB heads, GB x NC accumulators in registers.
template <typename T, int GB, int NC>
RINGSTREAM_AVX512 void values512_block(float* out, const float* w, int64_t count, const T* v, int64_t v_slot,
                                       int64_t VD, const int64_t* slots, int64_t d0) {
  __m512 acc[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; ++t) {
    const T* row = v + slots[t] * v_slot + d0;
    if (t + kPrefetchRows < count) fetch_row(v + slots[t + kPrefetchRows] * v_slot + d0, 16 * NC);
    __m512 wv[GB];
    for (int g = 0; g < GB; ++g) wv[g] = _mm512_set1_ps(w[g * count + t]);
    for (int c = 0; c < NC; ++c) {
      const __m512 x = load16(row + 16 * c);
      for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(wv[g], x, acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + g * VD + d0 + 16 * c, acc[g][c]);
}

template <typename T, int NC>
RINGSTREAM_AVX512 void values512_heads(float* out, const float* w, int64_t G, int64_t count, const T* v,
                                       int64_t v_slot, int64_t VD, const int64_t* slots, int64_t d0) {
  for (int64_t g = 0; g < G;) {  // up to four heads at a time: 4 x 4 accumulators and the loads fit 32 registers
    float* o = out + g * VD;
    const float* wg = w + g * count;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: values512_block<T, 4, NC>(o, wg, count, v, v_slot, VD, slots, d0); g += 4; break;
      case 3: values512_block<T, 3, NC>(o, wg, count, v, v_slot, VD, slots, d0); g += 3; break;
      case 2: values512_block<T, 2, NC>(o, wg, count, v, v_slot, VD, slots, d0); g += 2; break;
      default: values512_block<T, 1, NC>(o, wg, count, v, v_slot, VD, slots, d0); g += 1; break;
    }
  }
}

// out [G, VD] = the softmax-weighted values (VD a multiple of 16), 64 of them at a time, then 16.
template <typename T>
RINGSTREAM_AVX512 void values512(float* out, const float* w, int64_t G, int64_t count, const T* v, int64_t v_slot,
                                 int64_t VD, const int64_t* slots) {
  int64_t d = 0;
  for (; d + 64 <= VD; d += 64) values512_heads<T, 4>(out, w, G, count, v, v_slot, VD, slots, d);
  for (; d < VD; d += 16) values512_heads<T, 1>(out, w, G, count, v, v_slot, VD, slots, d);
}
#endif

template <typename T>
void decode_kernel(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& block_index, const at::Tensor& lengths, const at::Tensor& rows,
                   int64_t block_size, double scale, int64_t window) {
  const int64_t groups = rows.size(0);
  const int64_t heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key.size(0), value_dim = value.size(2);
  const int64_t per_kv = heads / kv_heads;
  const int64_t width = block_index.size(0) / std::max<int64_t>(groups, 1);  // blocks per row in block_index
  const T* q_base = query.data_ptr<T>();
  const T* k_base = key.data_ptr<T>();
  const T* v_base = value.data_ptr<T>();
  T* o_base = out.data_ptr<T>();
  const int64_t* blocks = block_index.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t k_head = key.stride(0), k_slot = key.stride(1);
  const int64_t v_head = value.stride(0), v_slot = value.stride(1);
  // AVX-512 where the host has it and both head sizes are whole registers
  const bool wide = ringstream_cpu::host_has_avx512() && head_dim % 16 == 0 && value_dim % 16 == 0;

  at::parallel_for(0, groups * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(per_kv * head_dim), scores, acc(per_kv * value_dim);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads;
      const int64_t length = lens[i], row = row_ids[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t count = length - first;
      const int64_t* table = blocks + i * width;
      for (int64_t g = 0; g < per_kv; ++g) {
        const T* src = q_base + row * q_row + (h * per_kv + g) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]);
      }
      scores.assign(per_kv * count, 0.f);
      const T* k_h = k_base + h * k_head;
      const T* v_h = v_base + h * v_head;
#ifdef RINGSTREAM_DECODE512
      if (wide) {
        slots.resize(count);  // each position's slot, walked block by block (no division per position)
        for (int64_t t = first, b = first / block_size, o = first % block_size; t < length; ++t) {
          slots[t - first] = table[b] * block_size + o;
          if (++o == block_size) o = 0, ++b;
        }
        scores512(scores.data(), q.data(), per_kv, head_dim, k_h, k_slot, v_h, v_slot, value_dim, slots.data(), count,
                  static_cast<float>(scale));
        for (int64_t g = 0; g < per_kv; ++g) softmax(scores.data() + g * count, count);
        values512(acc.data(), scores.data(), per_kv, count, v_h, v_slot, value_dim, slots.data());
      } else
#endif
      {
        auto slot = [&](int64_t t) { return table[t / block_size] * block_size + t % block_size; };
        for (int64_t t = first; t < length; ++t) {
          const T* k = k_h + slot(t) * k_slot;
          if (t + kPrefetchRows < length) {  // this row's key ahead, and its value into L2 for the second pass
            const int64_t ahead = slot(t + kPrefetchRows);
            prefetch_row(k_h + ahead * k_slot, head_dim);
            prefetch_row<T, kToL2>(v_h + ahead * v_slot, value_dim);
          }
          for (int64_t g = 0; g < per_kv; ++g) {
            scores[g * count + (t - first)] = dot(q.data() + g * head_dim, k, head_dim) * static_cast<float>(scale);
          }
        }
        for (int64_t g = 0; g < per_kv; ++g) softmax(scores.data() + g * count, count);
        auto value_row = [&](int64_t t) { return v_h + slot(first + t) * v_slot; };
        // the query heads of this KV head, three at a time (the accumulators of three fill the AVX2 registers)
        for (int64_t g = 0; g < per_kv;) {
          float* o = acc.data() + g * value_dim;
          const float* w = scores.data() + g * count;
          switch (std::min<int64_t>(3, per_kv - g)) {
            case 3: weighted_sum<T, 3>(o, value_dim, w, count, count, value_dim, value_row); g += 3; break;
            case 2: weighted_sum<T, 2>(o, value_dim, w, count, count, value_dim, value_row); g += 2; break;
            default: weighted_sum<T, 1>(o, value_dim, w, count, count, value_dim, value_row); g += 1; break;
          }
        }
      }
      for (int64_t g = 0; g < per_kv; ++g) {
        T* dst = o_base + row * o_row + (h * per_kv + g) * o_head;
        for (int64_t d = 0; d < value_dim; ++d) dst[d] = static_cast<T>(acc[g * value_dim + d]);
      }
    }
  });
}

// out [N, heads, value_dim] (rows `rows` written), query [N, heads, head_dim] (any strides, last dim contiguous),
// key [kv_heads, slots, head_dim], value [kv_heads, slots, value_dim], block_index [g * width] int64 (each row's
// blocks, padded), lengths [g] int64 (each row attends positions [max(0, length - window), length)), rows [g]
// int64 (the rows of query/out), window <= 0: no sliding window.
void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& block_index, const at::Tensor& lengths, const at::Tensor& rows,
                  int64_t block_size, double scale, int64_t window) {
  ringstream_cpu::check_pool_attention("paged_decode", out, query, key, value);
  TORCH_CHECK(block_index.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
              rows.scalar_type() == at::kLong, "paged_decode: int64 indices");
  TORCH_CHECK(block_index.is_contiguous() && lengths.is_contiguous() && rows.is_contiguous(),
              "paged_decode: contiguous indices");
  TORCH_CHECK(block_size > 0, "paged_decode: block_size must be > 0, got ", block_size);
  const int64_t groups = rows.numel();
  TORCH_CHECK(lengths.numel() == groups, "paged_decode: ", lengths.numel(), " lengths for ", groups, " rows");
  TORCH_CHECK(groups == 0 || block_index.numel() % groups == 0, "paged_decode: block_index of ", block_index.numel(),
              " entries is not ", groups, " equal tables");
  if (groups > 0) {  // every index in range: the kernel reads unchecked
    const int64_t width = block_index.numel() / groups, pool_blocks = key.size(1) / block_size;
    const int64_t* lens = lengths.data_ptr<int64_t>();
    const int64_t* row_ids = rows.data_ptr<int64_t>();
    const int64_t* blocks = block_index.data_ptr<int64_t>();
    for (int64_t i = 0; i < groups; ++i) {
      TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < query.size(0), "paged_decode: row ", row_ids[i], " out of range");
      TORCH_CHECK(lens[i] >= 0 && lens[i] <= width * block_size, "paged_decode: length ", lens[i], " exceeds the ",
                  width, " blocks of its table");
      for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
        const int64_t block = blocks[i * width + b];
        TORCH_CHECK(block >= 0 && block < pool_blocks, "paged_decode: block ", block, " outside the pool of ",
                    pool_blocks, " blocks");
      }
    }
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_kernel<float>(out, query, key, value, block_index, lengths, rows, block_size, scale, window);
    case at::kBFloat16:
      return decode_kernel<c10::BFloat16>(out, query, key, value, block_index, lengths, rows, block_size, scale,
                                          window);
    case at::kHalf:
      return decode_kernel<c10::Half>(out, query, key, value, block_index, lengths, rows, block_size, scale, window);
    default:
      TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16, got ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(ringstream, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor block_index, Tensor lengths, "
        "Tensor rows, int block_size, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(ringstream, CPU, m) { m.impl("paged_decode", &paged_decode); }
