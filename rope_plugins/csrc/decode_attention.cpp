// Single-pass decode attention over the pre-rotation paged KV cache (float32).
//
// One query per row at position m = seq_len - 1. A key at position n scores
//   dist = m - n < window[r] : q_near . R(n theta) k_n      (the near band, rotated on the fly)
//   otherwise                : q_far  . R(n rho theta) k_n  (or q_far . k_n when rho = 0: ReRoPE)
// The cache is read once, in place (no gather copy); keys are split into chunks so both
// cores work on a single request, and the chunks' partial softmaxes are merged at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 512;  // keys per work item

template <int64_t half>
inline void rotate_key(const float* __restrict key, const float* __restrict cos, const float* __restrict sin,
                       float* __restrict out) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float first = key[i], second = key[i + half];
    out[i] = first * cos[i] - second * sin[i];
    out[i + half] = second * cos[i] + first * sin[i];
  }
}

template <int64_t d>
inline float dot(const float* __restrict a, const float* __restrict b) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

template <int64_t d>
inline void add_scaled(float* __restrict out, const float* __restrict value, float p) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] += p * value[i];
}

}  // namespace

template <int64_t d>
torch::Tensor decode_attention_dim(
    const torch::Tensor& query,       // [R, H, d] unrotated, unscaled
    const torch::Tensor& query_scale, // [R] log-n x YaRN temperature
    const torch::Tensor& query_cos,   // [R, 2, d/2]: angles m theta (near) and (w + (m - w) rho) theta (far)
    const torch::Tensor& query_sin,
    const torch::Tensor& kv_cache,    // [blocks, kv, bs, 2d] (any strides, last dim contiguous)
    const torch::Tensor& block_table, // [R, max_blocks] int
    const torch::Tensor& seq_lens,    // [R] int64
    const torch::Tensor& window,      // [R] int64
    const torch::Tensor& band_start,  // [R] int64: first key position of the near tables
    const torch::Tensor& near_cos,    // [R, W, d/2]
    const torch::Tensor& near_sin,
    const torch::Tensor& far_cos,     // [U, S, d/2]: one table per distinct far rule, or empty
    const torch::Tensor& far_sin,
    const torch::Tensor& far_table,   // [R] int64: the row's far table, -1 = old keys read raw (rho = 0)
    double scale) {
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32, "decode_attention: float32 only");
  TORCH_CHECK(kv_cache.stride(3) == 1, "decode_attention: the cache's last dim must be contiguous");
  constexpr int64_t half = d / 2;
  const int64_t rows = query.size(0), heads = query.size(1);
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(2), group = heads / kv_heads;
  const int64_t cache_s0 = kv_cache.stride(0), cache_s1 = kv_cache.stride(1), cache_s2 = kv_cache.stride(2);

  auto q_all = query.contiguous();
  auto qscale = query_scale.to(torch::kFloat32).contiguous();
  auto qcos = query_cos.contiguous(), qsin = query_sin.contiguous();
  auto table = block_table.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous(), win = window.to(torch::kInt64).contiguous();
  auto start = band_start.to(torch::kInt64).contiguous();
  auto ncos = near_cos.contiguous(), nsin = near_sin.contiguous();
  auto fcos = far_cos.contiguous(), fsin = far_sin.contiguous();
  auto far_index = far_table.to(torch::kInt64).contiguous();
  const int64_t band_width = ncos.numel() ? ncos.size(1) : 0;
  const int64_t far_len = fcos.numel() ? fcos.size(1) : 0;

  const int64_t* lens_p = lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) max_len = std::max(max_len, lens_p[r]);
  const int64_t chunks = (max_len + kChunk - 1) / kChunk;

  // partial results per (row, kv head, chunk): max and sum per query head, and the output sum
  auto partial_max = torch::full({rows, kv_heads, chunks, group}, -std::numeric_limits<float>::infinity());
  auto partial_sum = torch::zeros({rows, kv_heads, chunks, group});
  auto partial_out = torch::zeros({rows, kv_heads, chunks, group, d});

  const float* cache = kv_cache.data_ptr<float>();
  const float* q_p = q_all.data_ptr<float>();
  const float* qscale_p = qscale.data_ptr<float>();
  const float* qcos_p = qcos.data_ptr<float>();
  const float* qsin_p = qsin.data_ptr<float>();
  const int64_t* table_p = table.data_ptr<int64_t>();
  const int64_t* win_p = win.data_ptr<int64_t>();
  const int64_t* start_p = start.data_ptr<int64_t>();
  const float* ncos_p = band_width ? ncos.data_ptr<float>() : nullptr;
  const float* nsin_p = band_width ? nsin.data_ptr<float>() : nullptr;
  const float* fcos_p = far_len ? fcos.data_ptr<float>() : nullptr;
  const float* fsin_p = far_len ? fsin.data_ptr<float>() : nullptr;
  const int64_t* far_index_p = far_index.data_ptr<int64_t>();
  float* pmax = partial_max.data_ptr<float>();
  float* psum = partial_sum.data_ptr<float>();
  float* pout = partial_out.data_ptr<float>();
  const int64_t table_stride = table.size(1);
  const float fscale = static_cast<float>(scale);

  // kv heads vary fastest, so the heads of one chunk share its rotation-table rows in cache
  at::parallel_for(0, rows * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(d), scores(kChunk * group), near_buffer(group * d), far_buffer(group * d), scaled(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % kv_heads, chunk = (item / kv_heads) % chunks, r = item / (chunks * kv_heads);
      const int64_t length = lens_p[r], first = chunk * kChunk, last = std::min(first + kChunk, length);
      if (first >= last) continue;
      const int64_t m = length - 1;
      // this row's queries of kv head h, scaled and rotated by the near and the far rule
      for (int64_t g = 0; g < group; ++g) {
        const float* raw = q_p + (r * heads + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) scaled[i] = raw[i] * qscale_p[r];
        rotate_key<half>(scaled.data(), qcos_p + r * 2 * half, qsin_p + r * 2 * half, near_buffer.data() + g * d);
        rotate_key<half>(scaled.data(), qcos_p + (r * 2 + 1) * half, qsin_p + (r * 2 + 1) * half, far_buffer.data() + g * d);
      }
      const float* near_q = near_buffer.data();
      const float* far_q = far_buffer.data();
      float* chunk_max = pmax + ((r * kv_heads + h) * chunks + chunk) * group;
      float* chunk_sum = psum + ((r * kv_heads + h) * chunks + chunk) * group;
      float* chunk_out = pout + ((r * kv_heads + h) * chunks + chunk) * group * d;

      for (int64_t n = first; n < last; ++n) {
        const float* key = cache + table_p[r * table_stride + n / block_size] * cache_s0 + h * cache_s1 +
                           (n % block_size) * cache_s2;
        const float* scored = key;
        const float* q = far_q;
        if (m - n < win_p[r]) {
          const int64_t j = n - start_p[r];
          rotate_key<half>(key, ncos_p + (r * band_width + j) * half, nsin_p + (r * band_width + j) * half, rotated.data());
          scored = rotated.data();
          q = near_q;
        } else if (far_index_p[r] >= 0) {
          const int64_t t = far_index_p[r];
          rotate_key<half>(key, fcos_p + (t * far_len + n) * half, fsin_p + (t * far_len + n) * half, rotated.data());
          scored = rotated.data();
        }
        for (int64_t g = 0; g < group; ++g) {
          const float s = dot<d>(q + g * d, scored) * fscale;
          scores[(n - first) * group + g] = s;
          chunk_max[g] = std::max(chunk_max[g], s);
        }
      }
      for (int64_t n = first; n < last; ++n) {
        const float* value = cache + table_p[r * table_stride + n / block_size] * cache_s0 + h * cache_s1 +
                             (n % block_size) * cache_s2 + d;
        for (int64_t g = 0; g < group; ++g) {
          const float p = std::exp(scores[(n - first) * group + g] - chunk_max[g]);
          chunk_sum[g] += p;
          add_scaled<d>(chunk_out + g * d, value, p);
        }
      }
    }
  });

  // merge the chunks: softmax over all keys = sum_c exp(max_c - M) out_c / sum_c exp(max_c - M) sum_c
  auto global_max = std::get<0>(partial_max.max(2, /*keepdim=*/true));
  auto weight = (partial_max - global_max).exp();  // empty chunks: exp(-inf) = 0
  auto numerator = (partial_out * weight.unsqueeze(-1)).sum(2);
  auto denominator = (partial_sum * weight).sum(2).unsqueeze(-1);
  return (numerator / denominator).reshape({rows, heads, d});
}

torch::Tensor decode_attention(
    const torch::Tensor& query, const torch::Tensor& query_scale, const torch::Tensor& query_cos,
    const torch::Tensor& query_sin, const torch::Tensor& kv_cache,
    const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& window,
    const torch::Tensor& band_start, const torch::Tensor& near_cos, const torch::Tensor& near_sin,
    const torch::Tensor& far_cos, const torch::Tensor& far_sin, const torch::Tensor& far_table, double scale) {
  switch (query.size(2)) {
#define ROPE_HEAD_DIM(D) \
  case D:                \
    return decode_attention_dim<D>(query, query_scale, query_cos, query_sin, kv_cache, block_table, seq_lens, window, band_start, near_cos, \
                                   near_sin, far_cos, far_sin, far_table, scale);
    ROPE_HEAD_DIM(32) ROPE_HEAD_DIM(64) ROPE_HEAD_DIM(80) ROPE_HEAD_DIM(96) ROPE_HEAD_DIM(128) ROPE_HEAD_DIM(256)
#undef ROPE_HEAD_DIM
    default:
      TORCH_CHECK(false, "decode_attention: unsupported head dim ", query.size(2));
  }
}
