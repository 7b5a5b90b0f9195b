// The step's new keys (unrotated) and values into their slots of the paged cache, in one call.
#include <ATen/Parallel.h>

#include <algorithm>

#include "attention_inputs.h"

// key, value [T, kv, d]; kv_cache [blocks, kv, bs, 2d] (any strides, last dim contiguous);
// slots [T] (block * bs + offset; negative: a padding token, skipped).
void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "write_cache: one dtype for keys, values and cache");
  TORCH_CHECK(kv_cache.stride(3) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "write_cache: last dims must be contiguous");
  const int64_t tokens = key.size(0), kv_heads = key.size(1), d = key.size(2), block_size = kv_cache.size(2);
  const int64_t bytes = d * key.element_size();
  auto slot = slots.to(at::kLong).contiguous();
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  const char* key_p = static_cast<const char*>(key.data_ptr());
  const char* value_p = static_cast<const char*>(value.data_ptr());
  char* cache_p = static_cast<char*>(kv_cache.data_ptr());
  const int64_t size = key.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot_p[t] < 0) continue;
      const int64_t block = slot_p[t] / block_size, offset = slot_p[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        char* row = cache_p + (block * kv_cache.stride(0) + h * kv_cache.stride(1) + offset * kv_cache.stride(2)) * size;
        std::copy(key_p + (t * key.stride(0) + h * key.stride(1)) * size,
                  key_p + (t * key.stride(0) + h * key.stride(1)) * size + bytes, row);
        std::copy(value_p + (t * value.stride(0) + h * value.stride(1)) * size,
                  value_p + (t * value.stride(0) + h * value.stride(1)) * size + bytes, row + bytes);
      }
    }
  });
}
