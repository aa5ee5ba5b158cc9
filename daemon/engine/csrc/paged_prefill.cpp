// Prefill attention of one prompt chunk, read in place from the paged KV pool (CPU, AVX-512), registered as
// torch.ops.ringstream.paged_prefill.
//
// A chunk's queries (positions context_start ... context_start + num_query - 1 of their sequence) attend the
// sequence's keys causally (and within a sliding window where given), the chunk's own keys already stored in the
// pool. FlashAttention's online softmax (Dao et al., 2022, "FlashAttention: Fast and Memory-Efficient Exact
// Attention with IO-Awareness", algorithm 1): keys are taken kKeyTile at a time; each query row keeps its running
// maximum m, its sum l and its unnormalised output, rescaled by exp(m_old - m_new) when the maximum grows; no
// [queries x keys] score matrix or mask is ever built, and each key and value row is read in place from its block.
//
// The layout is transposed so that query rows are the vector lanes: a task is one KV head and kQueryTile query
// positions of its G query heads (R = G x positions rows, padded to a multiple of 16). Scores are S^T[t][r] =
// K[t] . Q^T[:, r] (a key's element broadcast against sixteen query rows), the softmax statistics are per lane, and
// the output is O^T[e][r] += V[t][e] * P^T[t][r], so every step is a register-blocked multiply-add with no
// horizontal reduction and no transpose of the keys. Scores, softmax and sums in float32 whatever the pool's dtype.
//
// Measured on a 2-core AMD EPYC (AVX512_BF16), 12 query / 4 KV heads of 64, float32, per layer, against PyTorch's
// scaled_dot_product_attention (torch 2.13) over the same context made contiguous: a 256-token chunk at position 0,
// 0.52 ms against 1.43 ms; at position 3,840, 13.5 ms against 25.1 ms (bfloat16: 0.60 / 1.62 and 15.1 / 25.0 ms).
// Results equal float64 attention to ~2e-6 (float32).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "pool_checks.h"
#include "vec512.h"

namespace {

constexpr int64_t kQueryTile = 32;  // query positions of a task
constexpr int64_t kKeyTile = 64;    // key positions per online-softmax step

#ifdef RINGSTREAM_VEC512
using ringstream_cpu::exp_neg16;
using ringstream_cpu::load16;

template <typename T>
inline float scalar(const T& x) { return static_cast<float>(x); }

// c[i][lanes] (+)= sum over k of a(i, k) * b[k][lanes] for RB rows i and NC x 16 lanes: a(i, k) = a[i][k * a_k]
// broadcast (rows `a_row` apart), b rows `ldb` apart, c rows `ldc` apart. The register-blocked core of both passes.
template <typename T, int RB, int NC, bool kAccumulate>
RINGSTREAM_AVX512 inline void tile_fma(float* c, int64_t ldc, const T* const* a_rows, int64_t a_k, const float* b,
                                       int64_t ldb, int64_t depth) {
  __m512 acc[RB][NC];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = kAccumulate ? _mm512_loadu_ps(c + i * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    __m512 bv[NC];
    for (int j = 0; j < NC; ++j) bv[j] = _mm512_loadu_ps(b + k * ldb + 16 * j);
    for (int i = 0; i < RB; ++i) {
      const __m512 av = _mm512_set1_ps(scalar(a_rows[i][k * a_k]));
      for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(c + i * ldc + 16 * j, acc[i][j]);
}

// The same over all `vectors` (x 16 lanes) of b, four at a time.
template <typename T, int RB, bool kAccumulate>
RINGSTREAM_AVX512 void rows_fma(float* c, int64_t ldc, const T* const* a_rows, int64_t a_k, const float* b,
                                int64_t ldb, int64_t depth, int64_t vectors) {
  int64_t j = 0;
  for (; j + 4 <= vectors; j += 4) tile_fma<T, RB, 4, kAccumulate>(c + 16 * j, ldc, a_rows, a_k, b + 16 * j, ldb, depth);
  switch (vectors - j) {
    case 3: tile_fma<T, RB, 3, kAccumulate>(c + 16 * j, ldc, a_rows, a_k, b + 16 * j, ldb, depth); break;
    case 2: tile_fma<T, RB, 2, kAccumulate>(c + 16 * j, ldc, a_rows, a_k, b + 16 * j, ldb, depth); break;
    case 1: tile_fma<T, RB, 1, kAccumulate>(c + 16 * j, ldc, a_rows, a_k, b + 16 * j, ldb, depth); break;
    default: break;
  }
}

// The lanes whose query position p sees key position t: t <= p, and t > p - window where window > 0.
RINGSTREAM_AVX512 inline __mmask16 visible(int64_t t, __m512i pv, __m512i low, int64_t window) {
  const __m512i tv = _mm512_set1_epi32(static_cast<int32_t>(t));
  __mmask16 v = _mm512_cmp_epi32_mask(tv, pv, _MM_CMPINT_LE);
  if (window > 0) v &= _mm512_cmp_epi32_mask(tv, low, _MM_CMPINT_NLE);
  return v;
}

// One task's state and passes. Lanes r = g * positions + i (query head g of the KV head, query position i of the
// tile); lanes past R are padding, at position -1, which no key is visible to.
template <typename T>
struct PrefillTask {
  int64_t D, VD, R16 = 0, vectors = 0;
  std::vector<float> qt, st, ot, m, l;  // Q^T [D][R16] (scaled), S^T / P^T [kKeyTile][R16], O^T [VD][R16], m, l
  std::vector<int32_t> pos;             // each lane's query position
  std::vector<uint16_t> nan;            // lanes that met a NaN score, per vector
  std::vector<const T*> krows, vrows;

  PrefillTask(int64_t head_dim, int64_t value_dim, int64_t max_rows) : D(head_dim), VD(value_dim) {
    const int64_t most = (max_rows + 15) / 16 * 16;
    qt.resize(D * most), st.resize(kKeyTile * most), ot.resize(VD * most), m.resize(most), l.resize(most);
    pos.resize(most), nan.resize(most / 16), krows.resize(kKeyTile), vrows.resize(kKeyTile);
  }

  // A task of `rows` lanes (a short chunk computes as few vectors as it fills): cleared state.
  void start(int64_t rows) {
    R16 = (rows + 15) / 16 * 16, vectors = R16 / 16;
    std::fill_n(qt.begin(), D * R16, 0.f);
    std::fill_n(ot.begin(), VD * R16, 0.f);
    std::fill_n(m.begin(), R16, -std::numeric_limits<float>::infinity());
    std::fill_n(l.begin(), R16, 0.f);
    std::fill_n(pos.begin(), R16, -1);
    std::fill_n(nan.begin(), vectors, 0);
  }

  // The softmax step over key positions [kt, kt + kn): mask, new maxima, rescale of l and O^T, P^T in place of S^T.
  RINGSTREAM_AVX512 void softmax_step(int64_t kt, int64_t kn, int64_t window) {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < vectors; ++j) {
      const __m512i pv = _mm512_loadu_si512(pos.data() + 16 * j);
      const __m512i low = _mm512_sub_epi32(pv, _mm512_set1_epi32(static_cast<int32_t>(window)));  // window > 0
      __m512 top = neg_inf;
      __mmask16 bad = 0;
      for (int64_t t = 0; t < kn; ++t) {
        const __m512 s = _mm512_loadu_ps(st.data() + t * R16 + 16 * j);
        const __mmask16 v = visible(kt + t, pv, low, window);
        bad |= _mm512_mask_cmp_ps_mask(v, s, s, _CMP_UNORD_Q);
        top = _mm512_mask_max_ps(top, v, top, s);
      }
      const __m512 m_old = _mm512_loadu_ps(m.data() + 16 * j);
      const __m512 m_new = _mm512_max_ps(m_old, top);
      // a score of +inf makes the softmax inf - inf: NaN, as PyTorch's attention gives
      nan[j] |= bad | _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
      // lanes with nothing visible yet keep m = -inf; their exponentials are masked to 0 below
      const __mmask16 seen = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ);
      const __m512 base = _mm512_maskz_mov_ps(seen, m_new);
      const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ),
                                               exp_neg16(_mm512_sub_ps(m_old, base)));
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l.data() + 16 * j), alpha);
      for (int64_t t = 0; t < kn; ++t) {
        float* s = st.data() + t * R16 + 16 * j;
        const __m512 p = _mm512_maskz_mov_ps(visible(kt + t, pv, low, window), exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s), base)));
        _mm512_storeu_ps(s, p);
        sum = _mm512_add_ps(sum, p);
      }
      _mm512_storeu_ps(l.data() + 16 * j, sum);
      _mm512_storeu_ps(m.data() + 16 * j, m_new);
      for (int64_t e = 0; e < VD; ++e) {
        float* o = ot.data() + e * R16 + 16 * j;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
      }
    }
  }

  // S^T[t][lanes] = K[kt + t] . Q^T[:, lanes] for the tile's kn keys, four keys at a time.
  RINGSTREAM_AVX512 void scores(int64_t kn) {
    int64_t t = 0;
    for (; t + 4 <= kn; t += 4) rows_fma<T, 4, false>(st.data() + t * R16, R16, krows.data() + t, 1, qt.data(), R16, D, vectors);
    for (; t < kn; ++t) rows_fma<T, 1, false>(st.data() + t * R16, R16, krows.data() + t, 1, qt.data(), R16, D, vectors);
  }

  // O^T[e .. e + 3][lanes] += sum over the tile's keys t of V[t][e + i] * P^T[t][lanes]. The value rows sit in
  // blocks, not one stride apart, so the four broadcast elements of each key are first copied to a small buffer.
  RINGSTREAM_AVX512 void values_block(int64_t e, int64_t kn) {
    float a[4][kKeyTile];
    for (int64_t t = 0; t < kn; ++t)
      for (int i = 0; i < 4; ++i) a[i][t] = scalar(vrows[t][e + i]);
    const float* rows[4] = {a[0], a[1], a[2], a[3]};
    rows_fma<float, 4, true>(ot.data() + e * R16, R16, rows, 1, st.data(), R16, kn, vectors);
  }
};

template <typename T>
void prefill_kernel(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& block_index, int64_t row_start, int64_t num_query, int64_t context_start,
                    int64_t block_size, double scale, int64_t window) {
  const int64_t heads = query.size(1), D = query.size(2);
  const int64_t kv_heads = key.size(0), VD = value.size(2);
  const int64_t G = heads / kv_heads;
  const int64_t tiles = (num_query + kQueryTile - 1) / kQueryTile;
  const T* q_base = query.data_ptr<T>();
  const T* k_base = key.data_ptr<T>();
  const T* v_base = value.data_ptr<T>();
  T* o_base = out.data_ptr<T>();
  const int64_t* table = block_index.data_ptr<int64_t>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t k_head = key.stride(0), k_slot = key.stride(1);
  const int64_t v_head = value.stride(0), v_slot = value.stride(1);
  // Tasks in pairs of equal work (tile j with tile tiles - 1 - j: a causal tile's keys grow with j), so that the
  // contiguous ranges at::parallel_for hands each thread carry about the same work.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  tasks.reserve(kv_heads * tiles);
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t a = 0, b = tiles - 1; a <= b; ++a, --b) {
      tasks.emplace_back(h, a);
      if (b != a) tasks.emplace_back(h, b);
    }

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    PrefillTask<T> task(D, VD, G * kQueryTile);
    for (int64_t n = begin; n < end; ++n) {
      const auto [h, tile] = tasks[n];
      const int64_t i0 = tile * kQueryTile, positions = std::min(kQueryTile, num_query - i0);
      task.start(G * positions);
      const float sc = static_cast<float>(scale);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < positions; ++i) {
          const int64_t r = g * positions + i;
          const T* src = q_base + (row_start + i0 + i) * q_row + (h * G + g) * q_head;
          for (int64_t d = 0; d < D; ++d) task.qt[d * task.R16 + r] = scalar(src[d]) * sc;
          task.pos[r] = static_cast<int32_t>(context_start + i0 + i);
        }
      const int64_t last = context_start + i0 + positions - 1;  // the tile's last query position
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_start + i0 - window + 1) : 0;
      const T* k_h = k_base + h * k_head;
      const T* v_h = v_base + h * v_head;
      for (int64_t kt = first; kt <= last; kt += kKeyTile) {
        const int64_t kn = std::min(kKeyTile, last + 1 - kt);
        for (int64_t t = 0, b = kt / block_size, o = kt % block_size; t < kn; ++t) {  // block by block, no division
          const int64_t slot = table[b] * block_size + o;
          task.krows[t] = k_h + slot * k_slot;
          task.vrows[t] = v_h + slot * v_slot;
          if (++o == block_size) o = 0, ++b;
        }
        task.scores(kn);
        task.softmax_step(kt, kn, window);
        for (int64_t e = 0; e < VD; e += 4) task.values_block(e, kn);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < positions; ++i) {
          const int64_t r = g * positions + i;
          const bool bad = (task.nan[r / 16] >> (r % 16)) & 1;
          const float inv = bad ? std::numeric_limits<float>::quiet_NaN() : 1.f / task.l[r];
          T* dst = o_base + (row_start + i0 + i) * o_row + (h * G + g) * o_head;
          for (int64_t e = 0; e < VD; ++e) dst[e] = static_cast<T>(task.ot[e * task.R16 + r] * inv);
        }
    }
  });
}
#endif

bool prefill_supported(int64_t head_dim, int64_t value_dim) {
#ifdef RINGSTREAM_VEC512
  return ringstream_cpu::host_has_avx512() && head_dim % 16 == 0 && value_dim % 16 == 0 && head_dim > 0 &&
         value_dim > 0;
#else
  (void)head_dim, (void)value_dim;
  return false;
#endif
}

// out [N, heads, value_dim] (rows [row_start, row_start + num_query) written), query [N, heads, head_dim] (any
// strides, last dim contiguous), key [kv_heads, slots, head_dim], value [kv_heads, slots, value_dim], block_index
// [nb] int64 (the sequence's blocks up to its position context_start + num_query - 1); query row row_start + i is
// position context_start + i and attends positions max(0, p - window + 1) .. p (window <= 0: 0 .. p).
void paged_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& block_index, int64_t row_start, int64_t num_query, int64_t context_start,
                   int64_t block_size, double scale, int64_t window) {
  ringstream_cpu::check_pool_attention("paged_prefill", out, query, key, value);
  TORCH_CHECK(prefill_supported(query.size(2), value.size(2)),
              "paged_prefill: needs AVX-512 and head sizes that are multiples of 16 (see paged_prefill_supported)");
  TORCH_CHECK(block_size > 0, "paged_prefill: block_size must be > 0, got ", block_size);
  // positions are int32 lanes: each bound first, so that no sum below can overflow
  constexpr int64_t kMaxPosition = std::numeric_limits<int32_t>::max() / 2;
  TORCH_CHECK(num_query >= 0 && row_start >= 0 && row_start <= query.size(0) &&
              num_query <= query.size(0) - row_start, "paged_prefill: rows [", row_start, ", +", num_query,
              ") outside the ", query.size(0), " query rows");
  TORCH_CHECK(context_start >= 0 && context_start < kMaxPosition && num_query < kMaxPosition,
              "paged_prefill: context_start ", context_start, " outside [0, ", kMaxPosition, ")");
  TORCH_CHECK(block_index.scalar_type() == at::kLong && block_index.is_contiguous(),
              "paged_prefill: block_index must be contiguous int64");
  const int64_t length = context_start + num_query, pool_blocks = key.size(1) / block_size;
  TORCH_CHECK(block_index.numel() * block_size >= length, "paged_prefill: ", block_index.numel(),
              " blocks cannot hold ", length, " positions");
  const int64_t* table = block_index.data_ptr<int64_t>();
  for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b)  // every index in range: reads are unchecked
    TORCH_CHECK(table[b] >= 0 && table[b] < pool_blocks, "paged_prefill: block ", table[b], " outside the pool of ",
                pool_blocks, " blocks");
  if (num_query == 0) return;
  if (window >= length) window = 0;  // no position reaches past it: full causal attention (no int32 overflow)
#ifdef RINGSTREAM_VEC512
  switch (query.scalar_type()) {
    case at::kFloat:
      return prefill_kernel<float>(out, query, key, value, block_index, row_start, num_query, context_start,
                                   block_size, scale, window);
    case at::kBFloat16:
      return prefill_kernel<c10::BFloat16>(out, query, key, value, block_index, row_start, num_query, context_start,
                                           block_size, scale, window);
    case at::kHalf:
      return prefill_kernel<c10::Half>(out, query, key, value, block_index, row_start, num_query, context_start,
                                       block_size, scale, window);
    default:
      TORCH_CHECK(false, "paged_prefill: float32, bfloat16 or float16, got ", query.scalar_type());
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringstream, m) {
  m.def("paged_prefill(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor block_index, int row_start, "
        "int num_query, int context_start, int block_size, float scale, int window) -> ()");
  m.def("paged_prefill_supported(int head_dim, int value_dim) -> bool", &prefill_supported);
}

TORCH_LIBRARY_IMPL(ringstream, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
