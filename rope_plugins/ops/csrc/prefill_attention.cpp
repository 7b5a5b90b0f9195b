// One-pass prefill attention for one request's chunk (float32), the CPU twin of the Triton
// prefill in rope_plugins/ops/gpu.py. On a CPU with AMX, a 16-bit cache's scores and P.V run
// on matrix tiles (csrc/matrix_tiles.h) with the same walk, softmax and accuracy to ~2^-16.
//
// The query at position m scores the key at n <= m as
//   n >= near_from[m] : near_query[m] . near_keys[n]   (both at their plain-RoPE angle)
//   otherwise         : far_query[m]  . far_keys[n]    (far angles; ReRoPE's far keys are the raw ones)
// near_from[m] = m - w + 1 for a window w; in dual-chunk attention the window follows the query.
// Work items are (kv head, tile of queries); each walks the key tiles up to its causal edge.
// A key tile wholly inside the window scores only near, one wholly beyond it only far, a
// straddling tile both and picks per element: no second pass and no log-sum-exp merge.
// Scores and P.V are register-tiled GEMMs (micro_gemm.h); keys come in tiles [kv, tile, d, 32],
// so one tile's 32 keys of one dimension are one contiguous vector and a whole tile one
// contiguous 8 KB (d = 64).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <tuple>
#include <vector>

#include "attention_inputs.h"
#include "matrix_tiles.h"
#include "micro_gemm.h"
#include "vector_math.h"

namespace {

using rope_kernels::gemm_columns;
using rope_kernels::kColumns;
using rope_kernels::PrefillInputs;
#if defined(ROPE_MATRIX_TILES)
namespace tiles = rope_kernels::tiles;
#endif

constexpr int64_t kQueryTile = 64;  // queries per work item (times the kv head's query heads)
constexpr int64_t kKeyStep = 256;   // keys per online-softmax update (8 micro-kernel tiles)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// keys rounded up to whole key tiles: what the matrix tiles compute and the packed operands hold
constexpr int64_t whole_key_tiles(int64_t keys) { return (keys + kColumns - 1) / kColumns * kColumns; }

// One layer's call as raw pointers.
struct PrefillView {
  const float* query;
  int64_t token_stride, head_stride;
  const float *query_scale, *near_cos, *near_sin, *far_cos, *far_sin;
  const int64_t* near_from;
  bool banded;
  const float *near_keys, *far_keys, *values;
  int64_t chunk, heads, kv_heads, queries_per_kv, d, context, near_origin;
  int64_t near_tiles, far_tiles, value_stride;
  float scale;
  float* out;
  // matrix tiles (csrc/matrix_tiles.h): the key tiles and values as bfloat16 B operands, high and
  // low parts, and whether each has any low part
  bool tiles = false, rounded_once = false;  // rounded_once: the operands' high parts alone
  const uint16_t *near_high = nullptr, *near_low = nullptr, *far_high = nullptr, *far_low = nullptr;
  const uint16_t *value_high = nullptr, *value_low = nullptr;
  bool near_has_low = false, far_has_low = false, value_has_low = false;
  int64_t value_tiles_stride = 0;  // a kv head's packed values: keys rounded up to whole tiles, times d
};

// A work item's buffers, one set per thread: row (t, g) is query t of the tile, query head g of its kv head.
struct PrefillScratch {
  std::vector<float> near_tile, far_tile, scores, far_scores, acc, running_max, running_sum;
  // matrix tiles: the turned queries and the step's weights as bfloat16 high and low parts (A operands)
  std::vector<uint16_t> near_high, near_low, far_high, far_low, weight_high, weight_low;
  PrefillScratch(int64_t rows, int64_t d, bool tiles)
      : near_tile(rows * d), far_tile(rows * d), scores(rows * kKeyStep), far_scores(rows * kKeyStep),
        acc(rows * d), running_max(rows), running_sum(rows), near_high(tiles ? rows * d : 0),
        near_low(near_high.size()), far_high(near_high.size()), far_low(near_high.size()),
        weight_high(tiles ? rows * kKeyStep : 0), weight_low(weight_high.size()) {}
};

// One work item: queries first_query .. + queries - 1 of kv head h; its queries' near keys start
// between near_from_min and near_from_max.
struct QueryTile {
  int64_t h, first_query, queries, rows, first_position, last_position, near_from_min, near_from_max;
};

PrefillView prefill_view(const PrefillInputs& row, const at::Tensor& query, const at::Tensor& near_keys,
                         const at::Tensor& far_keys, const at::Tensor& values, double scale,
                         at::Tensor& output) {
  TORCH_CHECK(query.scalar_type() == at::kFloat, "prefill_attention: float32 only");
  TORCH_CHECK(query.stride(2) == 1 && far_keys.is_contiguous() && values.is_contiguous() &&
                  (!row.banded || near_keys.is_contiguous()) && row.near_from.is_contiguous() &&
                  row.query_scale.is_contiguous() &&
                  row.near_cos.is_contiguous() && row.near_sin.is_contiguous() && row.far_cos.is_contiguous() &&
                  row.far_sin.is_contiguous(),
              "prefill_attention: contiguous inputs");
  TORCH_CHECK(row.near_from.scalar_type() == at::kLong && row.near_from.numel() == query.size(0),
              "prefill_attention: near_from is [L] int64");
  TORCH_CHECK(query.size(2) % kColumns == 0, "prefill_attention: head size must be a multiple of ", kColumns);
  PrefillView view;
  view.query = query.data_ptr<float>(), view.token_stride = query.stride(0), view.head_stride = query.stride(1);
  view.query_scale = row.query_scale.data_ptr<float>();
  view.near_cos = row.near_cos.data_ptr<float>(), view.near_sin = row.near_sin.data_ptr<float>();
  view.far_cos = row.far_cos.data_ptr<float>(), view.far_sin = row.far_sin.data_ptr<float>();
  view.near_from = row.near_from.data_ptr<int64_t>(), view.banded = row.banded;
  view.near_keys = row.banded ? near_keys.data_ptr<float>() : nullptr;
  view.far_keys = far_keys.data_ptr<float>(), view.values = values.data_ptr<float>();
  view.chunk = query.size(0), view.heads = query.size(1), view.d = query.size(2);
  view.kv_heads = values.size(0), view.queries_per_kv = view.heads / view.kv_heads;
  view.context = row.context, view.near_origin = row.near_origin;
  view.near_tiles = row.banded ? near_keys.size(1) : 0, view.far_tiles = far_keys.size(1);
  view.value_stride = values.size(1);
  view.scale = static_cast<float>(scale);
  view.out = output.data_ptr<float>();
  return view;
}

// the longest tiles (last queries) first: dynamic scheduling then balances the cores
QueryTile query_tile(const PrefillView& view, int64_t item) {
  const int64_t tiles = (view.chunk + kQueryTile - 1) / kQueryTile;
  const int64_t first_query = (tiles - 1 - item / view.kv_heads) * kQueryTile;
  const int64_t queries = std::min(kQueryTile, view.chunk - first_query);
  const int64_t first_position = view.context + first_query;
  const auto [near_from_min, near_from_max] =
      std::minmax_element(view.near_from + first_query, view.near_from + first_query + queries);
  return {item % view.kv_heads, first_query, queries, queries * view.queries_per_kv, first_position,
          first_position + queries - 1, *near_from_min, *near_from_max};
}

#if defined(ROPE_MATRIX_TILES)
// an A operand's low parts, or none where the operands are rounded once
uint16_t* low_part(const PrefillView& view, std::vector<uint16_t>& low) { return view.rounded_once ? nullptr : low.data(); }
const uint16_t* low_rows(const PrefillView& view, const std::vector<uint16_t>& low, int64_t at) {
  return view.rounded_once ? nullptr : low.data() + at;
}
#endif

// the tile's queries scaled and turned to their near and far angle; the running softmax emptied
void load_queries(const PrefillView& view, const QueryTile& tile, PrefillScratch& scratch) {
  const int64_t d = view.d, half = d / 2;
  for (int64_t t = 0; t < tile.queries; ++t) {
    const int64_t token = tile.first_query + t;
    const float factor = view.query_scale[token] * view.scale;
    for (int64_t g = 0; g < view.queries_per_kv; ++g) {
      const float* raw = view.query + token * view.token_stride + (tile.h * view.queries_per_kv + g) * view.head_stride;
      const int64_t r = t * view.queries_per_kv + g;
      if (view.banded)
        rope_kernels::rotate(raw, view.near_cos + token * half, view.near_sin + token * half,
                             scratch.near_tile.data() + r * d, half, factor);
      rope_kernels::rotate(raw, view.far_cos + token * half, view.far_sin + token * half,
                           scratch.far_tile.data() + r * d, half, factor);
    }
  }
#if defined(ROPE_MATRIX_TILES)
  if (view.tiles) {  // whole tiles of rows: the rows past the tile's own are left over, finite, and unused
    const int64_t elements = (tile.rows + tiles::kRows - 1) / tiles::kRows * tiles::kRows * d;
    if (view.banded)
      tiles::split_rows(scratch.near_tile.data(), elements, scratch.near_high.data(), low_part(view, scratch.near_low));
    tiles::split_rows(scratch.far_tile.data(), elements, scratch.far_high.data(), low_part(view, scratch.far_low));
  }
#endif
  std::fill(scratch.acc.begin(), scratch.acc.begin() + tile.rows * d, 0.f);
  std::fill(scratch.running_max.begin(), scratch.running_max.begin() + tile.rows, kNegInf);
  std::fill(scratch.running_sum.begin(), scratch.running_sum.begin() + tile.rows, 0.f);
}

#if defined(ROPE_MATRIX_TILES)
// score_keys on matrix tiles: every 16 rows of the query tile against the step's key tiles
void score_keys_on_tiles(const PrefillView& view, const QueryTile& tile, int64_t first_key, int64_t keys,
                         bool any_near, bool any_far, PrefillScratch& scratch) {
  const int64_t d = view.d, tile_size = d * kColumns;
  const int64_t far_at = tile.h * view.far_tiles * tile_size, near_at = tile.h * view.near_tiles * tile_size;
  float* far_scores = any_near ? scratch.far_scores.data() : scratch.scores.data();
  const int64_t padded = whole_key_tiles(keys);
  for (int64_t row = 0; row < tile.rows; row += tiles::kRows) {
    if (any_near) {
      const int64_t at = near_at + (first_key - view.near_origin) * d;
      tiles::score_run(scratch.near_high.data() + row * d, low_rows(view, scratch.near_low, row * d), d, view.near_high + at,
                       view.near_low + at, view.near_has_low, padded, scratch.scores.data() + row * kKeyStep,
                       kKeyStep);
    }
    if (any_far)
      tiles::score_run(scratch.far_high.data() + row * d, low_rows(view, scratch.far_low, row * d), d,
                       view.far_high + far_at + first_key * d, view.far_low + far_at + first_key * d,
                       view.far_has_low, padded, far_scores + row * kKeyStep, kKeyStep);
  }
}

// sum_values on matrix tiles, 16 rows at a time: the weights softmax_step left in bfloat16
// parts (rows past the tile's own are left over, finite, and unused)
void sum_values_on_tiles(const PrefillView& view, const QueryTile& tile, int64_t first_key, int64_t keys,
                         PrefillScratch& scratch) {
  const int64_t d = view.d, padded = whole_key_tiles(keys);
  const int64_t values_at = tile.h * view.value_tiles_stride + first_key * d;
  for (int64_t row = 0; row < tile.rows; row += tiles::kRows) {
    tiles::add_values(scratch.weight_high.data() + row * kKeyStep, low_rows(view, scratch.weight_low, row * kKeyStep),
                      kKeyStep, padded, view.value_high + values_at, view.value_low + values_at,
                      view.value_has_low, d, scratch.acc.data() + row * d);
  }
}
#endif

// scores of keys first_key .. + keys - 1, 32 at a time: near into scores, far into far_scores
// when both are needed; keys past the sequence's end are read from the tiles' zero padding
void score_keys(const PrefillView& view, const QueryTile& tile, int64_t first_key, int64_t keys, bool any_near,
                bool any_far, PrefillScratch& scratch) {
#if defined(ROPE_MATRIX_TILES)
  if (view.tiles) return score_keys_on_tiles(view, tile, first_key, keys, any_near, any_far, scratch);
#endif
  const int64_t d = view.d, tile_size = d * kColumns;
  const float* far_keys = view.far_keys + tile.h * view.far_tiles * tile_size;
  const float* near_keys = view.banded ? view.near_keys + tile.h * view.near_tiles * tile_size : nullptr;
  float* far_scores = any_near ? scratch.far_scores.data() : scratch.scores.data();
  for (int64_t tile_key = 0; tile_key < keys; tile_key += kColumns) {
    const int64_t key = first_key + tile_key;
    if (any_near)
      gemm_columns(scratch.near_tile.data(), d, near_keys + (key - view.near_origin) * d, kColumns,
                   scratch.scores.data() + tile_key, kKeyStep, tile.rows, d, false);
    if (any_far)
      gemm_columns(scratch.far_tile.data(), d, far_keys + key * d, kColumns, far_scores + tile_key, kKeyStep,
                   tile.rows, d, false);
  }
}

// one row's online-softmax step (rope_kernels::softmax_step); on matrix tiles its weights go
// straight into their bfloat16 parts, zero to the end of the last 32-key tile
inline float softmax_step(const PrefillView& view, float* row_scores, int64_t keys, int64_t r,
                          PrefillScratch& scratch) {
#if defined(ROPE_MATRIX_TILES)
  if (view.tiles) {
    const auto step = view.rounded_once ? tiles::softmax_step_to_parts<false> : tiles::softmax_step_to_parts<true>;
    return step(row_scores, keys, whole_key_tiles(keys), scratch.running_max[r], scratch.running_sum[r],
                scratch.weight_high.data() + r * kKeyStep, scratch.weight_low.data() + r * kKeyStep);
  }
#endif
  return rope_kernels::softmax_step(row_scores, keys, scratch.running_max[r], scratch.running_sum[r]);
}

// each row's scores of these keys: far ones picked before its first near key, the causal edge masked,
// then one online-softmax step (what the row has summed rescaled when its maximum moved)
void softmax_keys(const PrefillView& view, const QueryTile& tile, int64_t first_key, int64_t keys, bool straddles,
                  PrefillScratch& scratch) {
  const bool masked = first_key + keys - 1 > tile.first_position;  // the causal edge
  for (int64_t t = 0; t < tile.queries; ++t) {
    const int64_t first_distance = tile.first_position + t - first_key;  // m - n at j = 0
    const int64_t far_keys = view.near_from[tile.first_query + t] - first_key;  // j below it: far
    for (int64_t g = 0; g < view.queries_per_kv; ++g) {
      const int64_t r = t * view.queries_per_kv + g;
      float* __restrict row_scores = scratch.scores.data() + r * kKeyStep;
      const float* __restrict row_far = scratch.far_scores.data() + r * kKeyStep;
      if (straddles) {
#pragma omp simd
        for (int64_t j = 0; j < keys; ++j) row_scores[j] = j < far_keys ? row_far[j] : row_scores[j];
      }
      if (masked) {
#pragma omp simd
        for (int64_t j = 0; j < keys; ++j) row_scores[j] = first_distance - j >= 0 ? row_scores[j] : kNegInf;
      }
      const float correction = softmax_step(view, row_scores, keys, r, scratch);
      if (correction != 1.f) {
        float* row_acc = scratch.acc.data() + r * view.d;
#pragma omp simd
        for (int64_t i = 0; i < view.d; ++i) row_acc[i] *= correction;
      }
    }
  }
}

// acc[rows, d] += P[rows, keys] . V[keys, d], 32 value dims at a time
void sum_values(const PrefillView& view, const QueryTile& tile, int64_t first_key, int64_t keys,
                PrefillScratch& scratch) {
#if defined(ROPE_MATRIX_TILES)
  if (view.tiles) return sum_values_on_tiles(view, tile, first_key, keys, scratch);
#endif
  const float* values = view.values + tile.h * view.value_stride * view.d;
  for (int64_t column = 0; column < view.d; column += kColumns)
    gemm_columns(scratch.scores.data(), kKeyStep, values + first_key * view.d + column, view.d,
                 scratch.acc.data() + column, view.d, tile.rows, keys, true);
}

void write_output(const PrefillView& view, const QueryTile& tile, const PrefillScratch& scratch) {
  for (int64_t t = 0; t < tile.queries; ++t)
    for (int64_t g = 0; g < view.queries_per_kv; ++g) {
      const int64_t r = t * view.queries_per_kv + g;
      const float inverse = 1.f / scratch.running_sum[r];
      const float* acc = scratch.acc.data() + r * view.d;
      float* target = view.out + ((tile.first_query + t) * view.heads + tile.h * view.queries_per_kv + g) * view.d;
#pragma omp simd
      for (int64_t i = 0; i < view.d; ++i) target[i] = acc[i] * inverse;
    }
}

void attend_query_tile(const PrefillView& view, int64_t item, PrefillScratch& scratch) {
  const QueryTile tile = query_tile(view, item);
  load_queries(view, tile, scratch);
  for (int64_t first_key = 0; first_key <= tile.last_position; first_key += kKeyStep) {
    const int64_t keys = std::min(kKeyStep, tile.last_position + 1 - first_key);
    const bool any_near = view.banded && first_key + keys - 1 >= tile.near_from_min;
    const bool any_far = first_key < tile.near_from_max;
    score_keys(view, tile, first_key, keys, any_near, any_far, scratch);
    softmax_keys(view, tile, first_key, keys, any_near && any_far, scratch);
    sum_values(view, tile, first_key, keys, scratch);
  }
  write_output(view, tile, scratch);
}

#if defined(ROPE_MATRIX_TILES)
// An operand as bfloat16 high and low parts (no low parts where the operands are rounded once),
// and whether any low part is non-zero.
struct PackedOperand {
  at::Tensor high, low;
  bool has_low = false;
  PackedOperand() = default;
  PackedOperand(int64_t elements, bool rounded_once)
      : high(at::empty({elements}, at::kShort)), low(at::empty({rounded_once ? 0 : elements}, at::kShort)) {}
  // its low parts from element `at`, or null where it has none
  uint16_t* low_at(int64_t at) { return low.numel() ? reinterpret_cast<uint16_t*>(low.data_ptr()) + at : nullptr; }
};

const uint16_t* bits(const at::Tensor& packed) { return reinterpret_cast<const uint16_t*>(packed.data_ptr()); }
uint16_t* bits(at::Tensor& packed) { return reinterpret_cast<uint16_t*>(packed.data_ptr()); }

// key tiles [kv, tiles, d, 32] as B operands, tile by tile in parallel
PackedOperand pack_key_operand(const at::Tensor& key_tiles, bool rounded_once) {
  const int64_t d = key_tiles.size(2), tile_size = d * kColumns;
  PackedOperand packed(key_tiles.numel(), rounded_once);
  std::atomic<bool> has_low{false};
  at::parallel_for(0, key_tiles.size(0) * key_tiles.size(1), 16, [&](int64_t begin, int64_t end) {
    if (tiles::pack_key_tiles(key_tiles.data_ptr<float>() + begin * tile_size, end - begin, d,
                              bits(packed.high) + begin * tile_size, packed.low_at(begin * tile_size)))
      has_low = true;
  });
  packed.has_low = has_low;
  return packed;
}

// values [kv, S, d] as B operands [kv, S rounded up to whole tiles / 2, d, 2], head by head in parallel
PackedOperand pack_value_operand(const at::Tensor& values, int64_t padded, bool rounded_once) {
  const int64_t kv = values.size(0), keys = values.size(1), d = values.size(2);
  PackedOperand packed(kv * padded * d, rounded_once);
  std::atomic<bool> has_low{false};
  at::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      if (tiles::pack_values(values.data_ptr<float>() + h * keys * d, keys, padded, d,
                             bits(packed.high) + h * padded * d, packed.low_at(h * padded * d)))
        has_low = true;
  });
  packed.has_low = has_low;
  return packed;
}

// the view's operands on matrix tiles; `kept` holds them for the call
void use_matrix_tiles(PrefillView& view, const at::Tensor& near_keys, const at::Tensor& far_keys,
                      const at::Tensor& values, std::vector<PackedOperand>& kept) {
  const int64_t padded = whole_key_tiles(values.size(1));
  kept.push_back(pack_key_operand(far_keys, view.rounded_once));
  kept.push_back(pack_value_operand(values, padded, view.rounded_once));
  kept.push_back(view.banded ? pack_key_operand(near_keys, view.rounded_once) : PackedOperand{});
  auto [far, value, near] = std::tie(kept[0], kept[1], kept[2]);  // references into `kept`
  view.tiles = true;
  view.far_high = bits(far.high), view.far_low = far.low_at(0), view.far_has_low = far.has_low;
  view.value_high = bits(value.high), view.value_low = value.low_at(0), view.value_has_low = value.has_low;
  view.value_tiles_stride = padded * view.d;
  if (view.banded) view.near_high = bits(near.high), view.near_low = near.low_at(0), view.near_has_low = near.has_low;
}
#endif

}  // namespace

bool matrix_tiles_ready() {
#if defined(ROPE_MATRIX_TILES)
  return rope_kernels::tiles::granted();
#else
  return false;
#endif
}

at::Tensor prefill_attention(const PrefillInputs& row, const at::Tensor& query, const at::Tensor& near_keys,
                                const at::Tensor& far_keys, const at::Tensor& values, double scale) {
  auto output = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  PrefillView view = prefill_view(row, query, near_keys, far_keys, values, scale, output);
  TORCH_CHECK(!row.matrix_tiles || matrix_tiles_ready(), "prefill_attention: matrix tiles asked for, but this "
              "build or CPU has no AMX (matrix_tiles_ready() is false)");
#if defined(ROPE_MATRIX_TILES)
  std::vector<PackedOperand> kept;
  view.rounded_once = row.rounded_once;
  if (row.matrix_tiles) use_matrix_tiles(view, near_keys, far_keys, values, kept);
#endif
  const int64_t items = (view.chunk + kQueryTile - 1) / kQueryTile * view.kv_heads;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    PrefillScratch scratch(kQueryTile * view.queries_per_kv, view.d, view.tiles);
#if defined(ROPE_MATRIX_TILES)
    if (view.tiles) tiles::configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) attend_query_tile(view, item, scratch);
#if defined(ROPE_MATRIX_TILES)
    if (view.tiles) tiles::release();
#endif
  }
  return output;
}
