// The argument checks both paged attention operators make before their unchecked reads: tensors on the CPU, the
// pool layout (keys [kv_heads, slots, head_dim], values [kv_heads, slots, value_dim]), query [N, heads, head_dim]
// and out [N, heads, value_dim] with a contiguous last dimension, one dtype. Errors are RuntimeErrors that start
// with the operator's name.
#pragma once

#include <ATen/core/Tensor.h>

namespace ringstream_cpu {

inline void check_pool_attention(const char* op, const at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(query.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key.dim() == 3 && value.dim() == 3, op, ": shapes");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, op,
              ": the last dimension must be contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
              out.scalar_type() == query.scalar_type(), op, ": one dtype");
  TORCH_CHECK(key.size(0) > 0 && query.size(1) % key.size(0) == 0, op,
              ": heads must be a multiple of kv_heads (> 0)");
  TORCH_CHECK(query.size(2) == key.size(2), op, ": query head_dim ", query.size(2), " != key head_dim ",
              key.size(2));
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1) && out.size(2) == value.size(2), op,
              ": out must be [", query.size(0), ", ", query.size(1), ", ", value.size(2), "], got ", out.sizes());
  TORCH_CHECK(value.size(0) == key.size(0) && value.size(1) == key.size(1), op, ": key and value pools differ: ",
              key.sizes(), " and ", value.sizes());
}

}  // namespace ringstream_cpu
