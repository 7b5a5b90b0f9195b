// One sequence's keys and values read out of the paged cache in the layouts the prefill kernel
// wants, in one pass each (instead of a gather, a rotation and a transposing copy in PyTorch),
// as float32 whatever the cache's dtype (float32, bfloat16, float16: widened exactly).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "attention_inputs.h"
#include "vector_math.h"

namespace {

constexpr int64_t kTile = rope_kernels::kKeyTile;

template <typename Element>
inline const Element* cache_row(const Element* cache, const at::Tensor& kv_cache, const int64_t* blocks, int64_t n,
                              int64_t h) {
  const int64_t block_size = kv_cache.size(2);
  return cache + blocks[n / block_size] * kv_cache.stride(0) + h * kv_cache.stride(1) +
         (n % block_size) * kv_cache.stride(2);
}

}  // namespace

// Keys at positions first .. first + count - 1 of the sequence whose blocks are block_ids [nb],
// turned by cos / sin [count, d/2] (none when empty: the raw keys), as tiles [kv, tiles, d, 32]:
// key n at column (n - origin) % 32 of tile (n - origin) / 32; every other column is zero.
at::Tensor cache_key_tiles(const at::Tensor& kv_cache, const at::Tensor& block_ids, int64_t first,
                              int64_t count, const at::Tensor& cos, const at::Tensor& sin, int64_t origin,
                              int64_t tiles) {
  TORCH_CHECK(first >= origin && first + count <= origin + tiles * kTile, "cache_key_tiles: keys outside the tiles");
  const int64_t kv_heads = kv_cache.size(1), d = kv_cache.size(3) / 2, half = d / 2;
  const bool turn = cos.numel() > 0;
  auto blocks = block_ids.to(at::kLong).contiguous();
  auto cos_c = cos.contiguous(), sin_c = sin.contiguous();
  auto out = at::zeros({kv_heads, tiles, d, kTile}, kv_cache.options().dtype(at::kFloat));
  const int64_t* blocks_p = blocks.data_ptr<int64_t>();
  const float* cos_p = turn ? cos_c.data_ptr<float>() : nullptr;
  const float* sin_p = turn ? sin_c.data_ptr<float>() : nullptr;
  float* out_p = out.data_ptr<float>();
  const int64_t first_tile = (first - origin) / kTile, last_tile = (first + count - 1 - origin) / kTile;
  rope_kernels::with_cache_type(kv_cache, "cache_key_tiles", [&](auto element) {
    using Element = decltype(element);
    const Element* cache = static_cast<const Element*>(kv_cache.data_ptr());
    at::parallel_for(0, kv_heads * (last_tile - first_tile + 1), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rotated(d);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item % kv_heads, tile = first_tile + item / kv_heads;
        const int64_t from = std::max(first, origin + tile * kTile);
        const int64_t to = std::min(first + count, origin + (tile + 1) * kTile);
        float* tile_p = out_p + (h * tiles + tile) * d * kTile;
        for (int64_t n = from; n < to; ++n) {
          const Element* row = cache_row(cache, kv_cache, blocks_p, n, h);
          const float* key = rotated.data();  // a turned key is widened as it is turned
          if (turn)
            rope_kernels::rotate(row, cos_p + (n - first) * half, sin_p + (n - first) * half, rotated.data(), half);
          else
            key = rope_kernels::as_floats(row, rotated.data(), d);
          const int64_t column = (n - origin) % kTile;
          for (int64_t i = 0; i < d; ++i) tile_p[i * kTile + column] = key[i];
        }
      }
    });
  });
  return out;
}

// The values of positions 0 .. seq_len - 1 as [kv, seq_len, d], float32.
at::Tensor cache_values(const at::Tensor& kv_cache, const at::Tensor& block_ids, int64_t seq_len) {
  const int64_t kv_heads = kv_cache.size(1), d = kv_cache.size(3) / 2;
  auto blocks = block_ids.to(at::kLong).contiguous();
  auto out = at::empty({kv_heads, seq_len, d}, kv_cache.options().dtype(at::kFloat));
  const int64_t* blocks_p = blocks.data_ptr<int64_t>();
  float* out_p = out.data_ptr<float>();
  rope_kernels::with_cache_type(kv_cache, "cache_values", [&](auto element) {
    using Element = decltype(element);
    const Element* cache = static_cast<const Element*>(kv_cache.data_ptr());
    at::parallel_for(0, kv_heads * seq_len, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / seq_len, n = item % seq_len;
        rope_kernels::widen(cache_row(cache, kv_cache, blocks_p, n, h) + d, out_p + item * d, d);
      }
    });
  });
  return out;
}
