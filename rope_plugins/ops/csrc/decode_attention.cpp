// Single-pass decode attention over the pre-rotation paged KV cache (float32).
//
// One query per row at position m = seq_len - 1. A key at position n scores
//   dist = m - n < window[r] : q_near . R(n theta) k_n      (the near band, rotated on the fly)
//   otherwise                : q_far  . R(n omega) k_n      (or q_far . k_n when the row reads old keys raw: ReRoPE)
// The cache is read in place (no gather copy), each key and value once. Keys are split into
// chunks so both cores work on a single request; per chunk: every score, one vectorised exp,
// then P.V; the chunks' partial softmaxes are merged at the end by their maxima.
//
// Far angles without a table as large as the cache: with n = s * step + o,
// q . R(n omega) k = (R(-s step omega) q) . (R(o omega) k), so the query is turned once per
// `step` keys and each key by a small table of offsets that stays in the L1 cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

using rope_kernels::exp_nonpositive;
using rope_kernels::exponentiate;
using rope_kernels::max_of;

constexpr int64_t kChunk = 512;    // keys per work item
constexpr int64_t kPrefetch = 16;  // keys ahead whose key and value rows are fetched while scoring
constexpr int64_t kCacheLine = 64;

// out = R(angle) x for the pairs (i, i + half); sign -1 turns by the negative angle
template <int64_t half>
inline void rotate(const float* __restrict x, const float* __restrict cos, const float* __restrict sin,
                   float* __restrict out, float sign = 1.f) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float first = x[i], second = x[i + half], s = sign * sin[i];
    out[i] = first * cos[i] - second * s;
    out[i + half] = second * cos[i] + first * s;
  }
}

template <int64_t d>
inline float dot(const float* __restrict a, const float* __restrict b) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

}  // namespace

template <int64_t d>
torch::Tensor decode_attention_dim(
    const torch::Tensor& query,        // [R, H, d] unrotated, unscaled
    const torch::Tensor& query_scale,  // [R] log-n x YaRN temperature
    const torch::Tensor& query_cos,    // [R, 2, d/2]: angles m theta (near) and (w + (m - w) rho) theta (far)
    const torch::Tensor& query_sin,
    const torch::Tensor& kv_cache,     // [blocks, kv, bs, 2d] (any strides, last dim contiguous)
    const torch::Tensor& block_table,  // [R, max_blocks] int
    const torch::Tensor& seq_lens,     // [R] int64
    const torch::Tensor& window,       // [R] int64
    const torch::Tensor& band_start,   // [R] int64: first key position of the near tables
    const torch::Tensor& near_cos,     // [R, W, d/2]
    const torch::Tensor& near_sin,
    const torch::Tensor& far_step_cos,    // [U, S / step, d/2]: angles s step omega, one table per far rule
    const torch::Tensor& far_step_sin,
    const torch::Tensor& far_offset_cos,  // [U, step, d/2]: angles o omega
    const torch::Tensor& far_offset_sin,
    const torch::Tensor& far_table,    // [R] int64: the row's far rule, -1 = old keys read raw
    int64_t step, double scale) {
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32, "decode_attention: float32 only");
  TORCH_CHECK(kv_cache.stride(3) == 1, "decode_attention: the cache's last dim must be contiguous");
  TORCH_CHECK(step > 0 && kChunk % step == 0, "decode_attention: the far step must divide ", kChunk);
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
  auto step_cos = far_step_cos.contiguous(), step_sin = far_step_sin.contiguous();
  auto offset_cos = far_offset_cos.contiguous(), offset_sin = far_offset_sin.contiguous();
  auto far_index = far_table.to(torch::kInt64).contiguous();
  const int64_t band_width = ncos.numel() ? ncos.size(1) : 0;
  const int64_t far_steps = step_cos.numel() ? step_cos.size(1) : 0;
  const int64_t far_offsets = offset_cos.numel() ? offset_cos.size(1) : 0;

  const int64_t* lens_p = lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) max_len = std::max(max_len, lens_p[r]);
  const int64_t chunks = (max_len + kChunk - 1) / kChunk;

  // partial results per (row, kv head, chunk): max and sum per query head, and the output sum
  auto partial_max = torch::empty({rows, kv_heads, chunks, group});
  auto partial_sum = torch::empty({rows, kv_heads, chunks, group});
  auto partial_out = torch::empty({rows, kv_heads, chunks, group, d});
  auto output = torch::empty({rows, heads, d});

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
  const float* step_cos_p = far_steps ? step_cos.data_ptr<float>() : nullptr;
  const float* step_sin_p = far_steps ? step_sin.data_ptr<float>() : nullptr;
  const float* offset_cos_p = far_offsets ? offset_cos.data_ptr<float>() : nullptr;
  const float* offset_sin_p = far_offsets ? offset_sin.data_ptr<float>() : nullptr;
  const int64_t* far_index_p = far_index.data_ptr<int64_t>();
  float* pmax = partial_max.data_ptr<float>();
  float* psum = partial_sum.data_ptr<float>();
  float* pout = partial_out.data_ptr<float>();
  float* out = output.data_ptr<float>();
  const int64_t table_stride = table.size(1);
  const float fscale = static_cast<float>(scale);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // kv heads vary fastest, so the heads of one chunk share its rotation-table rows in cache
  at::parallel_for(0, rows * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(d), scores(group * kChunk), near_q(group * d), far_q(group * d), far_q_step(group * d),
        scaled(d);
    std::vector<const float*> row_of(kChunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % kv_heads, chunk = (item / kv_heads) % chunks, r = item / (chunks * kv_heads);
      const int64_t length = lens_p[r], first = chunk * kChunk, last = std::min(first + kChunk, length);
      float* chunk_max = pmax + ((r * kv_heads + h) * chunks + chunk) * group;
      float* chunk_sum = psum + ((r * kv_heads + h) * chunks + chunk) * group;
      float* chunk_out = pout + ((r * kv_heads + h) * chunks + chunk) * group * d;
      if (first >= last) {  // past this row's end: contributes nothing to the merge
        std::fill(chunk_max, chunk_max + group, kNegInf);
        continue;
      }
      const int64_t m = length - 1, row_window = win_p[r], rule = far_index_p[r];
      // this row's queries of kv head h, scaled (softmax scale included) and turned to their near and far angle
      for (int64_t g = 0; g < group; ++g) {
        const float* raw = q_p + (r * heads + h * group + g) * d;
        const float factor = qscale_p[r] * fscale;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) scaled[i] = raw[i] * factor;
        rotate<half>(scaled.data(), qcos_p + r * 2 * half, qsin_p + r * 2 * half, near_q.data() + g * d);
        rotate<half>(scaled.data(), qcos_p + (r * 2 + 1) * half, qsin_p + (r * 2 + 1) * half, far_q.data() + g * d);
      }
      // the rows of this chunk's keys, block by block (one division per block, not per key)
      const int64_t keys = last - first;
      for (int64_t n = first; n < last;) {
        const int64_t block = n / block_size, slot = n % block_size, run = std::min(block_size - slot, last - n);
        const float* row = cache + table_p[r * table_stride + block] * cache_s0 + h * cache_s1 + slot * cache_s2;
        for (int64_t i = 0; i < run; ++i, ++n, row += cache_s2) row_of[n - first] = row;
      }
      // keys and values interleave (other heads' rows too, by layout): on that stride the
      // hardware prefetcher alone leaves the loop waiting, so each row is asked for ahead
      auto prefetch = [&](int64_t j) {
        if (j + kPrefetch < keys) {
          const char* ahead = reinterpret_cast<const char*>(row_of[j + kPrefetch]);
          for (int64_t byte = 0; byte < 2 * d * int64_t(sizeof(float)); byte += kCacheLine)
            __builtin_prefetch(ahead + byte, 0, 3);
        }
      };
      const int64_t near_from = std::clamp(m - row_window + 1 - first, int64_t(0), keys);  // m - n < window
      float* score_of = scores.data();
      if (rule < 0) {  // old keys read raw
        for (int64_t j = 0; j < near_from; ++j) {
          prefetch(j);
          for (int64_t g = 0; g < group; ++g) score_of[g * kChunk + j] = dot<d>(far_q.data() + g * d, row_of[j]);
        }
      } else {
        for (int64_t j = 0; j < near_from; ++j) {
          prefetch(j);
          const int64_t n = first + j, offset = n % step;
          if (offset == 0 || j == 0) {  // a new step: turn the far query back by its angle
            const float* cos = step_cos_p + (rule * far_steps + n / step) * half;
            const float* sin = step_sin_p + (rule * far_steps + n / step) * half;
            for (int64_t g = 0; g < group; ++g) rotate<half>(far_q.data() + g * d, cos, sin, far_q_step.data() + g * d, -1.f);
          }
          rotate<half>(row_of[j], offset_cos_p + (rule * far_offsets + offset) * half,
                       offset_sin_p + (rule * far_offsets + offset) * half, rotated.data());
          for (int64_t g = 0; g < group; ++g) score_of[g * kChunk + j] = dot<d>(far_q_step.data() + g * d, rotated.data());
        }
      }
      for (int64_t j = near_from; j < keys; ++j) {
        prefetch(j);
        const int64_t b = first + j - start_p[r];
        rotate<half>(row_of[j], ncos_p + (r * band_width + b) * half, nsin_p + (r * band_width + b) * half, rotated.data());
        for (int64_t g = 0; g < group; ++g) score_of[g * kChunk + j] = dot<d>(near_q.data() + g * d, rotated.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict row_scores = scores.data() + g * kChunk;
        const float maximum = max_of(row_scores, keys, kNegInf);
        const float total = exponentiate(row_scores, keys, maximum);
        chunk_max[g] = maximum;
        chunk_sum[g] = total;
      }
      std::fill(chunk_out, chunk_out + group * d, 0.f);
      for (int64_t j = 0; j < keys; ++j) {
        const float* __restrict value = row_of[j] + d;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * kChunk + j];
          float* __restrict target = chunk_out + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) target[i] += p * value[i];
        }
      }
    }
  });

  // merge the chunks: softmax over all keys = sum_c exp(max_c - M) out_c / sum_c exp(max_c - M) sum_c
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t used = (lens_p[r] + kChunk - 1) / kChunk;
      for (int64_t g = 0; g < group; ++g) {
        const float* maxima = pmax + item * chunks * group + g;  // chunk c at c * group
        float overall = kNegInf;
        for (int64_t c = 0; c < used; ++c) overall = std::max(overall, maxima[c * group]);
        float* target = out + (r * heads + h * group + g) * d;
        std::fill(target, target + d, 0.f);
        float total = 0.f;
        for (int64_t c = 0; c < used; ++c) {
          const float weight = exp_nonpositive(maxima[c * group] - overall);
          total += weight * psum[(item * chunks + c) * group + g];
          const float* __restrict partial = pout + ((item * chunks + c) * group + g) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) target[i] += weight * partial[i];
        }
        const float inverse = 1.f / total;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) target[i] *= inverse;
      }
    }
  });
  return output;
}

torch::Tensor decode_attention(
    const torch::Tensor& query, const torch::Tensor& query_scale, const torch::Tensor& query_cos,
    const torch::Tensor& query_sin, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
    const torch::Tensor& seq_lens, const torch::Tensor& window, const torch::Tensor& band_start,
    const torch::Tensor& near_cos, const torch::Tensor& near_sin, const torch::Tensor& far_step_cos,
    const torch::Tensor& far_step_sin, const torch::Tensor& far_offset_cos, const torch::Tensor& far_offset_sin,
    const torch::Tensor& far_table, int64_t step, double scale) {
  switch (query.size(2)) {
#define ROPE_HEAD_DIM(D)                                                                                          \
  case D:                                                                                                         \
    return decode_attention_dim<D>(query, query_scale, query_cos, query_sin, kv_cache, block_table, seq_lens,    \
                                   window, band_start, near_cos, near_sin, far_step_cos, far_step_sin,           \
                                   far_offset_cos, far_offset_sin, far_table, step, scale);
    ROPE_HEAD_DIM(32) ROPE_HEAD_DIM(64) ROPE_HEAD_DIM(80) ROPE_HEAD_DIM(96) ROPE_HEAD_DIM(128) ROPE_HEAD_DIM(256)
#undef ROPE_HEAD_DIM
    default:
      TORCH_CHECK(false, "decode_attention: unsupported head dim ", query.size(2));
  }
}
