// RoPE of a packed step's queries and keys, and the store of its keys and values into the paged KV pool, in one
// pass (CPU), registered as torch.ops.ringstream.rope_store:
//
//   rope_store(qkv [..., (heads + 2 kv_heads) * D], cos [..., D], sin [..., D], key_pool [kv_heads, slots, D],
//              value_pool [kv_heads, slots, D], slot_mapping [T] int64, heads, kv_heads) -> query [T, heads, D]
//
// qkv holds T rows (every leading dimension folded), each the fused q / k / v projection's output
// [q heads | k heads | v heads] of D values; cos and sin hold T * D values, row t's position embedding. The
// rotated queries are returned; row t's rotated keys and its values are written to slot slot_mapping[t] of each
// KV head of the pools, as the KV cache's index_copy_ writes them.
//
// The rotation is Llama's apply_rotary_pos_emb (rotary position embedding: Su et al., "RoFormer: Enhanced
// Transformer with Rotary Position Embedding", 2021; transformers' models/llama/modeling_llama.py):
// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]). Each product and the sum round as
// transformers' tensor ops round them, so every result that is a number is bit-identical to the module's: float32
// with no fused multiply-add (contraction is off below), bfloat16 with each product rounded to bfloat16 (the
// product of two bfloat16 values is exact in float32) and then the sum. A NaN stays a NaN, its sign and payload
// those of c10's scalar conversion (PyTorch's own vector and scalar paths differ there too). It replaces a layer's
// ~20 small tensor ops (slices, cat, neg, four muls, two adds, two index_copy_) by one call. Every argument is
// checked before anything is written: shapes (their products without overflow), slots, and pools that overlap
// the inputs or require grad (the engine's pools are inference tensors, written in place without autograd).

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

// Bit-identical products and sums: no a * b + c contracted into one rounding (GCC contracts by default, even in
// ISO mode).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

using bf16 = c10::BFloat16;

// a * b as the storage type T holds the product (float32: rounded once; bfloat16: exact in float32, then rounded
// to bfloat16), as a float
template <typename T>
inline float product(float a, float b) { return static_cast<float>(static_cast<T>(a * b)); }

// out[0, D) = x * cos + rotate_half(x) * sin
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = product<T>(static_cast<float>(x[j]), static_cast<float>(c[j]));
    const float b = product<T>(-static_cast<float>(x[j + h]), static_cast<float>(s[j]));
    out[j] = static_cast<T>(a + b);
  }
  for (int64_t j = h; j < D; ++j) {
    const float a = product<T>(static_cast<float>(x[j]), static_cast<float>(c[j]));
    const float b = product<T>(static_cast<float>(x[j - h]), static_cast<float>(s[j]));
    out[j] = static_cast<T>(a + b);
  }
}

template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, T* keys, T* values, const int64_t* slots, T* query,
                     int64_t T_rows, int64_t heads, int64_t kv_heads, int64_t D, int64_t num_slots) {
  const int64_t width = (heads + 2 * kv_heads) * D;
  at::parallel_for(0, T_rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * D, c, s, query + (t * heads + h) * D, D);
      const int64_t slot = slots[t];
      for (int64_t g = 0; g < kv_heads; ++g) {
        rotate(row + (heads + g) * D, c, s, keys + (g * num_slots + slot) * D, D);
        std::memcpy(values + (g * num_slots + slot) * D, row + (heads + kv_heads + g) * D, D * sizeof(T));
      }
    }
  });
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_pool,
                      at::Tensor& value_pool, const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_store: float32 or bfloat16, got ", dtype);
  const at::Tensor* others[] = {&cos, &sin, &key_pool, &value_pool};
  for (const at::Tensor* t : others)
    TORCH_CHECK(t->scalar_type() == dtype, "rope_store: qkv, cos, sin and the pools must have one dtype, got ",
                dtype, " and ", t->scalar_type());
  TORCH_CHECK(heads >= 1 && kv_heads >= 1, "rope_store: heads and kv_heads must be >= 1, got ", heads, " and ",
              kv_heads);
  TORCH_CHECK(key_pool.dim() == 3 && key_pool.is_contiguous() && value_pool.is_contiguous() &&
              value_pool.sizes() == key_pool.sizes() && key_pool.size(0) == kv_heads,
              "rope_store: the pools must be contiguous [kv_heads=", kv_heads, ", slots, head_dim] alike, got ",
              key_pool.sizes(), " and ", value_pool.sizes());
  TORCH_CHECK(!key_pool.requires_grad() && !value_pool.requires_grad(),
              "rope_store: the pools are written in place without autograd; they must not require grad");
  const int64_t D = key_pool.size(2), num_slots = key_pool.size(1);
  TORCH_CHECK(D >= 2 && D % 2 == 0, "rope_store: head_dim must be even, got ", D);
  int64_t width = 0;
  TORCH_CHECK(kv_heads <= INT64_MAX / 2 && !__builtin_add_overflow(heads, 2 * kv_heads, &width) &&
              !__builtin_mul_overflow(width, D, &width), "rope_store: (heads + 2 kv_heads) * head_dim overflows "
              "int64 (heads ", heads, ", kv_heads ", kv_heads, ", head_dim ", D, ")");
  TORCH_CHECK(qkv.dim() >= 1 && qkv.size(-1) == width, "rope_store: qkv's last dimension must be (heads + 2 "
              "kv_heads) * head_dim = ", width, ", got ", qkv.sizes());
  const int64_t T_rows = qkv.numel() / width;
  TORCH_CHECK(cos.numel() == T_rows * D && sin.numel() == T_rows * D && cos.size(-1) == D && sin.size(-1) == D,
              "rope_store: cos and sin must hold [", T_rows, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.numel() == T_rows,
              "rope_store: slot_mapping must be int64 [", T_rows, "], got ", slot_mapping.scalar_type(), " ",
              slot_mapping.sizes());
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_rows; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rope_store: slot ", sp[t], " of row ", t, " is outside the pool's ",
                num_slots, " slots");
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  for (const at::Tensor* pool : {&key_pool, &value_pool}) {  // a write must not change what a later row reads
    at::assert_no_overlap(*pool, x);
    at::assert_no_overlap(*pool, c);
    at::assert_no_overlap(*pool, s);
    at::assert_no_overlap(*pool, slots);
  }
  at::Tensor query = at::empty({T_rows, heads, D}, qkv.options());
  if (dtype == at::kBFloat16) {
    rope_store_rows(x.data_ptr<bf16>(), c.data_ptr<bf16>(), s.data_ptr<bf16>(), key_pool.data_ptr<bf16>(),
                    value_pool.data_ptr<bf16>(), sp, query.data_ptr<bf16>(), T_rows, heads, kv_heads, D, num_slots);
  } else {
    rope_store_rows(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), key_pool.data_ptr<float>(),
                    value_pool.data_ptr<float>(), sp, query.data_ptr<float>(), T_rows, heads, kv_heads, D, num_slots);
  }
  return query;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringstream, m) {
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_pool, Tensor(b!) value_pool, "
        "Tensor slot_mapping, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(ringstream, CPU, m) {
  m.impl("rope_store", &rope_store);
}
