// Decode attention read in place from the paged KV pool (CPU), registered as torch.ops.ringstream.paged_decode.
//
// One query token per row attends its context, whose keys and values sit in the pool's blocks: no gather copy.
// Each (row, KV head) pair is one task of at::parallel_for; the query heads that share the KV head (grouped-query
// attention) are computed together, so each key and value row is read once for all of them. Scores and softmax
// in float32 (the pool may hold bfloat16 / float16), two passes over the context: scores, then the weighted sum
// of values. The same algorithm as vLLM's CPU paged attention (csrc/cpu/attention.cpp), written for this pool
// layout: per layer, keys [kv_heads, slots, head_dim] and values [kv_heads, slots, value_dim], slot =
// block * block_size + offset.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

// s[t] = exp(s[t] - max) / sum, in place.
inline void softmax(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
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

// out[0:n] = sum over t of w[t] * v_t[0:n], the rows v_t found by row(t); accumulators kept in registers.
template <typename T, typename Row>
inline void weighted_sum(float* out, const float* w, int64_t count, int64_t n, Row row) {
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; ++t) {
      const T* v = row(t) + d;
      const __m256 wv = _mm256_set1_ps(w[t]);
      a0 = _mm256_fmadd_ps(wv, load8(v), a0);
      a1 = _mm256_fmadd_ps(wv, load8(v + 8), a1);
      a2 = _mm256_fmadd_ps(wv, load8(v + 16), a2);
      a3 = _mm256_fmadd_ps(wv, load8(v + 24), a3);
    }
    _mm256_storeu_ps(out + d, a0);
    _mm256_storeu_ps(out + d + 8, a1);
    _mm256_storeu_ps(out + d + 16, a2);
    _mm256_storeu_ps(out + d + 24, a3);
  }
  for (; d < n; ++d) {
    float a = 0;
    for (int64_t t = 0; t < count; ++t) a += w[t] * static_cast<float>(row(t)[d]);
    out[d] = a;
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

template <typename T, typename Row>
inline void weighted_sum(float* out, const float* w, int64_t count, int64_t n, Row row) {
  for (int64_t d = 0; d < n; ++d) out[d] = 0;
  for (int64_t t = 0; t < count; ++t) {
    const T* v = row(t);
    for (int64_t d = 0; d < n; ++d) out[d] += w[t] * static_cast<float>(v[d]);
  }
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

  at::parallel_for(0, groups * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(per_kv * head_dim), scores, acc(per_kv * value_dim);
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
      for (int64_t t = first; t < length; ++t) {
        const T* k = k_h + (table[t / block_size] * block_size + t % block_size) * k_slot;
        for (int64_t g = 0; g < per_kv; ++g) {
          scores[g * count + (t - first)] = dot(q.data() + g * head_dim, k, head_dim) * static_cast<float>(scale);
        }
      }
      for (int64_t g = 0; g < per_kv; ++g) softmax(scores.data() + g * count, count);
      const T* v_h = v_base + h * v_head;
      auto value_row = [&](int64_t t) {
        const int64_t pos = first + t;
        return v_h + (table[pos / block_size] * block_size + pos % block_size) * v_slot;
      };
      for (int64_t g = 0; g < per_kv; ++g) {
        weighted_sum<T>(acc.data() + g * value_dim, scores.data() + g * count, count, value_dim, value_row);
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
  TORCH_CHECK(query.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key.dim() == 3 && value.dim() == 3, "paged_decode: shapes");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "paged_decode: the last dimension must be contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
              out.scalar_type() == query.scalar_type(), "paged_decode: one dtype");
  TORCH_CHECK(query.size(1) % key.size(0) == 0, "paged_decode: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_index.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
              rows.scalar_type() == at::kLong, "paged_decode: int64 indices");
  TORCH_CHECK(block_index.is_contiguous() && lengths.is_contiguous() && rows.is_contiguous(),
              "paged_decode: contiguous indices");
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
