// The step's new keys (unrotated) and values into their slots of the paged cache, in one call:
// copied, or into an fp8 cache divided by the layer's scales and rounded as stock vLLM's is.
#include <ATen/Parallel.h>

#include <algorithm>

#include "attention_inputs.h"
#include "vector_math.h"

namespace {

// key, value [T, kv, d] of the model's dtype into an fp8 cache, each element x / scale
template <typename Source, typename Format>
void write_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slot_p,
                     float key_scale, float value_scale) {
  const int64_t tokens = key.size(0), kv_heads = key.size(1), d = key.size(2), block_size = kv_cache.size(2);
  const Source* key_p = key.data_ptr<Source>();
  const Source* value_p = value.data_ptr<Source>();
  uint8_t* cache_p = static_cast<uint8_t*>(kv_cache.data_ptr());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot_p[t] < 0) continue;
      const int64_t block = slot_p[t] / block_size, offset = slot_p[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        uint8_t* row = cache_p + block * kv_cache.stride(0) + h * kv_cache.stride(1) + offset * kv_cache.stride(2);
        const Source* k = key_p + t * key.stride(0) + h * key.stride(1);
        const Source* v = value_p + t * value.stride(0) + h * value.stride(1);
        for (int64_t i = 0; i < d; ++i) {
          row[i] = rope_kernels::fp8_toward_zero<Format>(rope_kernels::to_float(k[i]) / key_scale);
          row[d + i] = rope_kernels::fp8_toward_zero<Format>(rope_kernels::to_float(v[i]) / value_scale);
        }
      }
    }
  });
}

}  // namespace

// key, value [T, kv, d]; kv_cache [blocks, kv, bs, 2d] (any strides, last dim contiguous);
// slots [T] (block * bs + offset; negative: a padding token, skipped).
// An fp8 cache's keys and values are divided by key_scale and value_scale (others' are copied).
void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const at::Tensor& slots, double key_scale, double value_scale) {
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK((fp8 || kv_cache.scalar_type() == key.scalar_type()) && key.scalar_type() == value.scalar_type(),
              "write_cache: one dtype for keys, values and cache (or an fp8 cache)");
  TORCH_CHECK(kv_cache.stride(3) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "write_cache: last dims must be contiguous");
  const int64_t tokens = key.size(0), kv_heads = key.size(1), d = key.size(2), block_size = kv_cache.size(2);
  const int64_t bytes = d * key.element_size();
  auto slot = slots.to(at::kLong).contiguous();
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  if (fp8) {
    const auto quantize = [&](auto source) {
      using Source = decltype(source);
      if (kv_cache.scalar_type() == at::kFloat8_e4m3fn)
        write_quantized<Source, c10::Float8_e4m3fn>(key, value, kv_cache, slot_p, key_scale, value_scale);
      else
        write_quantized<Source, c10::Float8_e5m2>(key, value, kv_cache, slot_p, key_scale, value_scale);
    };
    switch (key.scalar_type()) {
      case at::kFloat: return quantize(float{});
      case at::kBFloat16: return quantize(c10::BFloat16{});
      case at::kHalf: return quantize(c10::Half{});
      default: TORCH_CHECK(false, "write_cache: float32, bfloat16 or float16 keys, not ", key.scalar_type());
    }
  }
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
