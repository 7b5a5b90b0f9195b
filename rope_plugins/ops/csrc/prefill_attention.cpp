// One-pass prefill attention for one request's chunk (float32), the CPU twin of the Triton
// prefill in rope_plugins/ops/gpu.py.
//
// The query at position m scores the key at n <= m as
//   m - n < window : near_query[m] . near_keys[n]   (both at their plain-RoPE angle)
//   otherwise      : far_query[m]  . far_keys[n]    (far angles; ReRoPE's far keys are the raw ones)
// Work items are (kv head, tile of queries); each walks the key tiles up to its causal edge.
// A key tile wholly inside the window scores only near, one wholly beyond it only far, a
// straddling tile both and picks per element: no second pass and no log-sum-exp merge.
// Scores and P.V are register-tiled GEMMs (8 rows x 32 columns of accumulators); keys come in
// tiles [kv, tile, d, 32], so one tile's 32 keys of one dimension are one contiguous vector
// and a whole tile one contiguous 8 KB (d = 64).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vector_math.h"

namespace {

using rope_kernels::exp_nonpositive;
using rope_kernels::exponentiate;
using rope_kernels::max_of;

constexpr int64_t kRows = 8;       // accumulator rows of the micro-kernel
constexpr int64_t kColumns = 32;   // accumulator columns: keys per tile, value dims per step
constexpr int64_t kQueryTile = 64; // queries per work item (times the group's heads)
constexpr int64_t kKeyStep = 256;  // keys per online-softmax update (8 micro-kernel tiles)

// out = factor R(angle) x for the pairs (i, i + half)
inline void rotate_scaled(const float* __restrict x, float factor, const float* __restrict cos,
                          const float* __restrict sin, float* __restrict out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float first = factor * x[i], second = factor * x[i + half];
    out[i] = first * cos[i] - second * sin[i];
    out[i + half] = second * cos[i] + first * sin[i];
  }
}

// c[rows, 32] (+)= a[rows, depth] . b[depth, 32]; rows <= 8; a row-major (lda), b row-major (ldb)
template <int64_t rows>
inline void micro_gemm(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb,
                       float* __restrict c, int64_t ldc, int64_t depth, bool accumulate) {
  float acc[rows][kColumns];
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t j = 0; j < kColumns; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : 0.f;
  }
  for (int64_t k = 0; k < depth; ++k) {
    const float* __restrict b_row = b + k * ldb;
    for (int64_t r = 0; r < rows; ++r) {
      const float a_rk = a[r * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < kColumns; ++j) acc[r][j] += a_rk * b_row[j];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t j = 0; j < kColumns; ++j) c[r * ldc + j] = acc[r][j];
  }
}

#if defined(__AVX512F__)
// The full 8-row block in AVX-512 intrinsics (two 16-float halves per row): on the AVX-512
// EPYC this was developed on, faster than GCC's code for the portable loop above, which
// serves the partial blocks and CPUs without AVX-512.
template <>
inline void micro_gemm<kRows>(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb,
                              float* __restrict c, int64_t ldc, int64_t depth, bool accumulate) {
  __m512 low[kRows], high[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    low[r] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
    high[r] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 b_low = _mm512_loadu_ps(b + k * ldb), b_high = _mm512_loadu_ps(b + k * ldb + 16);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 a_rk = _mm512_set1_ps(a[r * lda + k]);
      low[r] = _mm512_fmadd_ps(a_rk, b_low, low[r]);
      high[r] = _mm512_fmadd_ps(a_rk, b_high, high[r]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(c + r * ldc, low[r]);
    _mm512_storeu_ps(c + r * ldc + 16, high[r]);
  }
}
#endif

// c[m, 32] (+)= a[m, depth] . b[depth, 32] for any m, in blocks of 8 rows
inline void gemm_columns(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                         int64_t depth, bool accumulate) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) micro_gemm<kRows>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, depth, accumulate);
  switch (m - r) {
#define ROPE_TAIL(N) \
  case N:            \
    micro_gemm<N>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, depth, accumulate); break;
    ROPE_TAIL(1) ROPE_TAIL(2) ROPE_TAIL(3) ROPE_TAIL(4) ROPE_TAIL(5) ROPE_TAIL(6) ROPE_TAIL(7)
#undef ROPE_TAIL
    default: break;
  }
}

}  // namespace

// query [L, H, d]: the chunk's queries as the model made them (unrotated, unscaled; any
// token and head strides); query_scale [L] (log-n x the method's factor); near_cos / near_sin
// and far_cos / far_sin [L, d/2]: each query's near and far angle. The kernel scales and turns
// each query as it copies it into its tile. near_keys_t [kv, tiles, d, 32]: key n in tile
// (n - near_origin) / 32 (near_origin a multiple of 32 at or before the first key any near query
// sees); far_keys_t [kv, tiles, d, 32] from key 0; values [kv, >= seq_len, d]. Returns [L, H, d].
torch::Tensor prefill_attention(const torch::Tensor& query, const torch::Tensor& query_scale,
                                const torch::Tensor& near_cos, const torch::Tensor& near_sin,
                                const torch::Tensor& far_cos, const torch::Tensor& far_sin,
                                const torch::Tensor& near_keys_t, const torch::Tensor& far_keys_t,
                                const torch::Tensor& values, int64_t context, int64_t window, int64_t near_origin,
                                double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "prefill_attention: float32 only");
  TORCH_CHECK(query.stride(2) == 1 && far_keys_t.is_contiguous() && values.is_contiguous() &&
                  (window == 0 || near_keys_t.is_contiguous()),
              "prefill_attention: contiguous inputs");
  const int64_t chunk = query.size(0), heads = query.size(1), d = query.size(2), half = d / 2;
  const int64_t token_stride = query.stride(0), head_stride = query.stride(1);
  auto factor_of = query_scale.to(torch::kFloat32).contiguous();
  auto ncos = near_cos.contiguous(), nsin = near_sin.contiguous(), fcos = far_cos.contiguous(), fsin = far_sin.contiguous();
  const int64_t kv_heads = values.size(0), group = heads / kv_heads;
  TORCH_CHECK(d % kColumns == 0, "prefill_attention: head size must be a multiple of ", kColumns);
  const int64_t seq_len = context + chunk;
  const int64_t tile_size = d * kColumns, value_stride = values.size(1);
  const int64_t far_tiles = far_keys_t.size(1), near_tiles = window ? near_keys_t.size(1) : 0;
  auto output = torch::empty({chunk, heads, d}, query.options());

  const float* q = query.data_ptr<float>();
  const float* factor_p = factor_of.data_ptr<float>();
  const float *ncos_p = ncos.data_ptr<float>(), *nsin_p = nsin.data_ptr<float>();
  const float *fcos_p = fcos.data_ptr<float>(), *fsin_p = fsin.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);
  const float* near_k = window ? near_keys_t.data_ptr<float>() : nullptr;
  const float* far_k = far_keys_t.data_ptr<float>();
  const float* value = values.data_ptr<float>();
  float* out = output.data_ptr<float>();

  const int64_t tiles = (chunk + kQueryTile - 1) / kQueryTile;
  const int64_t items = tiles * kv_heads;
  const int64_t rows_max = kQueryTile * group;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> near_tile(rows_max * d), far_tile(rows_max * d), scores(rows_max * kKeyStep),
        far_scores(rows_max * kKeyStep), acc(rows_max * d), running_max(rows_max), running_sum(rows_max);
    // the longest tiles (last queries) first: dynamic scheduling then balances the cores
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t tile = tiles - 1 - item / kv_heads, h = item % kv_heads;
      const int64_t first_query = tile * kQueryTile, queries = std::min(kQueryTile, chunk - first_query);
      const int64_t rows = queries * group;  // row (t, g): query first_query + t, head h * group + g
      for (int64_t t = 0; t < queries; ++t) {  // the tile's queries scaled and turned to their near and far angle
        const int64_t token = first_query + t;
        const float factor = factor_p[token] * softmax_scale;
        for (int64_t g = 0; g < group; ++g) {
          const float* raw = q + token * token_stride + (h * group + g) * head_stride;
          const int64_t r = t * group + g;
          if (window > 0)
            rotate_scaled(raw, factor, ncos_p + token * half, nsin_p + token * half, near_tile.data() + r * d, half);
          rotate_scaled(raw, factor, fcos_p + token * half, fsin_p + token * half, far_tile.data() + r * d, half);
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(running_max.begin(), running_max.begin() + rows, kNegInf);
      std::fill(running_sum.begin(), running_sum.begin() + rows, 0.f);

      const int64_t first_position = context + first_query, last_position = first_position + queries - 1;
      const float* far_k_head = far_k + h * far_tiles * tile_size;
      const float* near_k_head = window ? near_k + h * near_tiles * tile_size : nullptr;
      const float* value_head = value + h * value_stride * d;
      for (int64_t first_key = 0; first_key <= last_position; first_key += kKeyStep) {
        const int64_t keys = std::min(kKeyStep, last_position + 1 - first_key);
        // distances m - n in this tile range over [first_position - last_key, last_position - first_key]
        const bool any_near = window > 0 && first_position - (first_key + keys - 1) < window;
        const bool any_far = last_position - first_key >= window;
        // keys past the tile's end (keys < 32) are read from the padding columns and masked below
        for (int64_t tile_key = 0; tile_key < keys; tile_key += kColumns) {  // one 32-key tile at a time
          const int64_t key = first_key + tile_key;
          if (any_near)
            gemm_columns(near_tile.data(), d, near_k_head + (key - near_origin) * d, kColumns, scores.data() + tile_key,
                         kKeyStep, rows, d, false);
          if (any_far)
            gemm_columns(far_tile.data(), d, far_k_head + key * d, kColumns,
                         (any_near ? far_scores.data() : scores.data()) + tile_key, kKeyStep, rows, d, false);
        }
        const bool straddles = any_near && any_far;
        const bool masked = first_key + keys - 1 > first_position;  // the causal edge
        for (int64_t t = 0; t < queries; ++t) {
          const int64_t first_distance = first_position + t - first_key;  // m - n at j = 0
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = t * group + g;
            float* __restrict row_scores = scores.data() + r * kKeyStep;
            const float* __restrict row_far = far_scores.data() + r * kKeyStep;
            if (straddles) {
#pragma omp simd
              for (int64_t j = 0; j < keys; ++j) row_scores[j] = first_distance - j >= window ? row_far[j] : row_scores[j];
            }
            if (masked) {
#pragma omp simd
              for (int64_t j = 0; j < keys; ++j) row_scores[j] = first_distance - j >= 0 ? row_scores[j] : kNegInf;
            }
            const float tile_max = max_of(row_scores, keys, running_max[r]);
            const float correction = exp_nonpositive(running_max[r] - tile_max);  // 0 on the first tile
            const float total = exponentiate(row_scores, keys, tile_max);
            running_sum[r] = running_sum[r] * correction + total;
            running_max[r] = tile_max;
            if (correction != 1.f) {  // the row's maximum moved: rescale what it has summed
              float* row_acc = acc.data() + r * d;
#pragma omp simd
              for (int64_t i = 0; i < d; ++i) row_acc[i] *= correction;
            }
          }
        }
        // acc[rows, d] += P[rows, keys] . V[keys, d], 32 value dims at a time
        for (int64_t column = 0; column < d; column += kColumns)
          gemm_columns(scores.data(), kKeyStep, value_head + first_key * d + column, d, acc.data() + column, d, rows,
                       keys, true);
      }
      for (int64_t t = 0; t < queries; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = t * group + g;
          const float inverse = 1.f / running_sum[r];
          float* target = out + ((first_query + t) * heads + h * group + g) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) target[i] = acc[r * d + i] * inverse;
        }
    }
  }
  return output;
}
