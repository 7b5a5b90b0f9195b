// Single-pass decode attention over the pre-rotation paged KV cache (a float32, bfloat16 or
// float16 cache; float32 queries and arithmetic: 16-bit keys and values are widened as they are read).
//
// One query per row at position m = seq_len - 1. A key at position n scores
//   dist = m - n < window[r] : q_near . R(n theta) k_n      (the near band, rotated on the fly)
//   otherwise                : q_far  . R(n omega) k_n      (or q_far . k_n when the row reads old keys raw: ReRoPE)
// The cache is read in place (no gather copy), each key and value once. Keys are split into
// chunks so both cores work on a single request. With AVX-512 a chunk's keys are scored 16 at a
// time and each block goes straight into an online softmax and P.V (flash decoding); elsewhere
// every score, one vectorised exp, then P.V. The chunks' partial softmaxes are merged at the end
// by their maxima.
//
// Far angles without a table as large as the cache: with n = s * step + o,
// q . R(n omega) k = (R(-s step omega) q) . (R(o omega) k), so the query is turned once per
// `step` keys and each key by a small table of offsets that stays in the L1 cache.
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_inputs.h"
#include "decode_vector.h"
#include "vector_math.h"

namespace {

using rope_kernels::DecodeInputs;
using rope_kernels::dot;
using rope_kernels::kDecodeChunk;
using rope_kernels::rotate;
#if defined(__AVX512F__)
namespace avx512 = rope_kernels::avx512;
// AVX-512 scoring takes each block of 16 scores straight into the online softmax and P.V
template <int64_t d>
constexpr bool kOnline = avx512::kScores<d>;
#else
template <int64_t d>
constexpr bool kOnline = false;
#endif

// keys ahead whose key and value rows are fetched into L2 while scoring (measured at 32k in
// bfloat16: 16 keys into L1 left the loop waiting on memory, 64 into L2 read 1.5x faster)
constexpr int64_t kPrefetch = 64;
constexpr int64_t kCacheLine = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One layer's call as raw pointers. Work item (row r, chunk c, kv head h) writes its partial
// softmax at ((r * kv_heads + h) * chunks + c) * queries_per_kv.
struct DecodeView {
  const float *query, *query_scale, *query_cos, *query_sin;
  const void* cache;
  int64_t cache_s0, cache_s1, cache_s2, block_size;
  const int64_t *block_table, *seq_lens, *window, *band_start, *far_table;
  int64_t table_stride;
  const float *near_cos, *near_sin, *far_step_cos, *far_step_sin, *far_offset_cos, *far_offset_sin;
  int64_t band_width, far_steps, step;
  int64_t heads, kv_heads, queries_per_kv, chunks;
  float scale;
  float *partial_max, *partial_sum, *partial_out, *out;
  bool rounded_once = false;  // the far queries rounded once to bfloat16 against raw bfloat16 keys
};

// A work item's buffers, one set per thread.
struct DecodeScratch {
  std::vector<float> rotated, widened, scores, near_q, far_q, far_q_step;
  std::vector<float> partial;  // AVX-512 scoring: each query's unsummed products with 16 keys
  std::vector<float> split;    // AVX512_BF16 scoring: each query as two bfloat16 parts (as many bytes as in float32)
  std::vector<const void*> row_of;  // each key's cache row (its value follows d elements on)
  std::vector<float> maxima, totals, sums;  // the online softmax (kOnline): per query, its max, 16 sums, d sums
  DecodeScratch(int64_t d, int64_t queries_per_kv)
      : rotated(d), widened(d), scores(queries_per_kv * kDecodeChunk), near_q(queries_per_kv * d),
        far_q(queries_per_kv * d), far_q_step(queries_per_kv * d), partial(queries_per_kv * 16 * 16),
        split(queries_per_kv * d), row_of(kDecodeChunk), maxima(queries_per_kv), totals(queries_per_kv * 16),
        sums(queries_per_kv * d) {}

  // key j's row (value: at + d) as float32: in place in a float32 cache, else widened into `widened`
  template <typename Element>
  const float* key(int64_t j, int64_t d, int64_t at = 0) {
    return rope_kernels::as_floats(static_cast<const Element*>(row_of[j]) + at, widened.data(), d);
  }
};

// One work item: its row, kv head and keys first .. last - 1.
struct DecodeItem {
  int64_t r, h, chunk, first, last, partial;
};

const float* data_or_null(const at::Tensor& table) { return table.numel() ? table.data_ptr<float>() : nullptr; }

int64_t longest_row(const DecodeInputs& rows) {
  const int64_t* lengths = rows.seq_lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < rows.seq_lens.numel(); ++r) longest = std::max(longest, lengths[r]);
  return longest;
}

void check_inputs(const DecodeInputs& rows, const at::Tensor& query, const at::Tensor& kv_cache) {
  TORCH_CHECK(query.scalar_type() == at::kFloat, "decode_attention: float32 queries");
  for (const auto* tensor : {&rows.query_scale, &rows.query_cos, &rows.query_sin, &rows.block_table, &rows.seq_lens,
                             &rows.window, &rows.band_start, &rows.near_cos, &rows.near_sin, &rows.far_step_cos,
                             &rows.far_step_sin, &rows.far_offset_cos, &rows.far_offset_sin, &rows.far_table})
    TORCH_CHECK(tensor->is_contiguous(), "decode_attention: the row inputs must be contiguous");
  const int64_t step = rows.far_offset_cos.numel() ? rows.far_offset_cos.size(1) : 1;
  TORCH_CHECK(kDecodeChunk % step == 0, "decode_attention: the far step must divide ", kDecodeChunk);
}

DecodeView decode_view(const DecodeInputs& rows, const at::Tensor& query, const at::Tensor& kv_cache,
                       double scale, int64_t chunks, at::Tensor* partials, at::Tensor& output) {
  DecodeView view{};
  view.query = query.data_ptr<float>();
  view.query_scale = rows.query_scale.data_ptr<float>();
  view.query_cos = rows.query_cos.data_ptr<float>();
  view.query_sin = rows.query_sin.data_ptr<float>();
  view.cache = kv_cache.data_ptr();
  view.cache_s0 = kv_cache.stride(0), view.cache_s1 = kv_cache.stride(1), view.cache_s2 = kv_cache.stride(2);
  view.block_size = kv_cache.size(2);
  view.block_table = rows.block_table.data_ptr<int64_t>();
  view.table_stride = rows.block_table.size(1);
  view.seq_lens = rows.seq_lens.data_ptr<int64_t>();
  view.window = rows.window.data_ptr<int64_t>();
  view.band_start = rows.band_start.data_ptr<int64_t>();
  view.far_table = rows.far_table.data_ptr<int64_t>();
  view.near_cos = data_or_null(rows.near_cos), view.near_sin = data_or_null(rows.near_sin);
  view.band_width = rows.near_cos.numel() ? rows.near_cos.size(1) : 0;
  view.far_step_cos = data_or_null(rows.far_step_cos), view.far_step_sin = data_or_null(rows.far_step_sin);
  view.far_offset_cos = data_or_null(rows.far_offset_cos), view.far_offset_sin = data_or_null(rows.far_offset_sin);
  view.far_steps = rows.far_step_cos.numel() ? rows.far_step_cos.size(1) : 0;
  view.step = rows.far_offset_cos.numel() ? rows.far_offset_cos.size(1) : 1;
  view.heads = query.size(1), view.kv_heads = kv_cache.size(1), view.queries_per_kv = view.heads / view.kv_heads;
  view.chunks = chunks;
  view.scale = static_cast<float>(scale);
  view.partial_max = partials[0].data_ptr<float>(), view.partial_sum = partials[1].data_ptr<float>();
  view.partial_out = partials[2].data_ptr<float>(), view.out = output.data_ptr<float>();
  return view;
}

// kv heads vary fastest, so the heads of one chunk share its rotation-table rows in cache
DecodeItem work_item(const DecodeView& view, int64_t item) {
  const int64_t h = item % view.kv_heads, chunk = (item / view.kv_heads) % view.chunks;
  const int64_t r = item / (view.chunks * view.kv_heads), first = chunk * kDecodeChunk;
  const int64_t last = std::min(first + kDecodeChunk, view.seq_lens[r]);
  return {r, h, chunk, first, last, ((r * view.kv_heads + h) * view.chunks + chunk) * view.queries_per_kv};
}

// the row's queries of kv head h, scaled (softmax scale included; and, for keys read in AVX-512
// registers, what those reads leave out: kFp8Factor) and turned to their near and far angle
template <typename Element, int64_t d>
void turn_queries(const DecodeView& view, const DecodeItem& item, DecodeScratch& scratch) {
  constexpr int64_t half = d / 2;
  const int64_t r = item.r;
  const float factor = view.query_scale[r] * view.scale * (kOnline<d> ? rope_kernels::kFp8Factor<Element> : 1.f);
  for (int64_t g = 0; g < view.queries_per_kv; ++g) {
    const float* raw = view.query + (r * view.heads + item.h * view.queries_per_kv + g) * d;
    rotate(raw, view.query_cos + r * 2 * half, view.query_sin + r * 2 * half, scratch.near_q.data() + g * d, half,
           factor);
    rotate(raw, view.query_cos + (r * 2 + 1) * half, view.query_sin + (r * 2 + 1) * half,
           scratch.far_q.data() + g * d, half, factor);
  }
}

// the rows of the item's keys, block by block (one division per block, not per key)
template <typename Element>
void find_rows(const DecodeView& view, const DecodeItem& item, DecodeScratch& scratch) {
  for (int64_t n = item.first; n < item.last;) {
    const int64_t block = n / view.block_size, slot = n % view.block_size;
    const int64_t run = std::min(view.block_size - slot, item.last - n);
    const Element* row = static_cast<const Element*>(view.cache) +
                         view.block_table[item.r * view.table_stride + block] * view.cache_s0 +
                         item.h * view.cache_s1 + slot * view.cache_s2;
    for (int64_t i = 0; i < run; ++i, ++n, row += view.cache_s2) scratch.row_of[n - item.first] = row;
  }
}

// keys and values interleave (other heads' rows too, by layout): on that stride the hardware
// prefetcher alone leaves the loop waiting, so each row is asked for ahead
template <typename Element, int64_t d>
inline void prefetch_row(const DecodeScratch& scratch, int64_t j) {
  const char* row = static_cast<const char*>(scratch.row_of[j]);
  for (int64_t byte = 0; byte < 2 * d * int64_t(sizeof(Element)); byte += kCacheLine)
    __builtin_prefetch(row + byte, 0, 1);  // locality 1: into L2
}

template <typename Element, int64_t d>
inline void prefetch(const DecodeScratch& scratch, int64_t j, int64_t keys) {
  if (j + kPrefetch < keys) prefetch_row<Element, d>(scratch, j + kPrefetch);
}

// the rows the scoring loop does not ask for ahead: its first kPrefetch
template <typename Element, int64_t d>
inline void prefetch_first(const DecodeScratch& scratch, int64_t keys) {
  for (int64_t j = 0; j < std::min(kPrefetch, keys); ++j) prefetch_row<Element, d>(scratch, j);
}

#if defined(__AVX512F__)
// a scored block of keys into the item's online softmax and P.V (decode_vector.h)
template <typename Element, int64_t d>
inline void attend_block(DecodeScratch& scratch, int64_t block, int64_t count, int64_t queries_per_kv) {
  if constexpr (kOnline<d>)
    avx512::attend_block<d, Element>(scratch.row_of.data(), block, count, scratch.scores.data(), kDecodeChunk,
                                     queries_per_kv,
                                     {scratch.maxima.data(), scratch.totals.data(), scratch.sums.data()});
}
#endif

// scores[g][j] = queries[g] . (key j turned by angle(j)) for keys from <= j < to; angle(j) is a
// {cos, sin} pair of [d/2] tables ({null, null}: the raw key). With AVX-512, a key is widened and
// turned in registers and its products summed 16 keys at a time (decode_vector.h); elsewhere one
// key at a time: a turned key is widened as it is turned, a raw 16-bit one widened into scratch.
template <typename Element, int64_t d, typename Angle>
void score_run(DecodeScratch& scratch, int64_t from, int64_t to, int64_t keys, const float* queries,
               int64_t queries_per_kv, Angle angle) {
  float* scores = scratch.scores.data();
#if defined(__AVX512F__)
  if constexpr (avx512::kScores<d>) {
    const auto key_of = [&](int64_t j, __m512* key) {
      const auto [cos, sin] = angle(j);
      avx512::load_key<d>(static_cast<const Element*>(scratch.row_of[j]), cos, sin, key);
    };
    const avx512::WidenedKeys<d, decltype(key_of)> widened{queries, key_of};
    avx512::score_keys(widened, from, to, queries_per_kv, scores, kDecodeChunk, scratch.partial.data(),
                       [&](int64_t j) { prefetch<Element, d>(scratch, j, keys); },
                       [&](int64_t block, int64_t count) {
                         attend_block<Element, d>(scratch, block, count, queries_per_kv);
                       });
    return;
  }
#endif
  for (int64_t j = from; j < to; ++j) {
    prefetch<Element, d>(scratch, j, keys);
    const auto [cos, sin] = angle(j);
    const float* key;
    if (cos != nullptr) {
      rotate(static_cast<const Element*>(scratch.row_of[j]), cos, sin, scratch.rotated.data(), d / 2);
      key = scratch.rotated.data();
    } else {
      key = scratch.key<Element>(j, d);
    }
    for (int64_t g = 0; g < queries_per_kv; ++g) scores[g * kDecodeChunk + j] = dot(queries + g * d, key, d);
  }
}

using Angle = std::pair<const float*, const float*>;

// keys j < near_from under ReRoPE's far rule: the far query against the raw keys
template <typename Element, int64_t d>
void score_raw(const DecodeView& view, int64_t near_from, int64_t keys, DecodeScratch& scratch) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Element, c10::BFloat16> && avx512::kScores<d>) {
    const auto score = [&](const auto& raw) {
      raw.prepare(scratch.far_q.data(), view.queries_per_kv);
      avx512::score_keys(raw, 0, near_from, view.queries_per_kv, scratch.scores.data(), kDecodeChunk,
                         scratch.partial.data(), [&](int64_t j) { prefetch<Element, d>(scratch, j, keys); },
                         [&](int64_t block, int64_t count) {
                           attend_block<Element, d>(scratch, block, count, view.queries_per_kv);
                         });
    };
    char* split = reinterpret_cast<char*>(scratch.split.data());
    if (view.rounded_once) return score(avx512::RawBfloat16Keys<d, false>{scratch.row_of.data(), split});
    return score(avx512::RawBfloat16Keys<d>{scratch.row_of.data(), split});
  }
#endif
  score_run<Element, d>(scratch, 0, near_from, keys, scratch.far_q.data(), view.queries_per_kv,
                        [](int64_t) { return Angle{nullptr, nullptr}; });
}

// keys j < near_from at their far angle: the query turned back once per step, each key by its offset
template <typename Element, int64_t d>
void score_far(const DecodeView& view, const DecodeItem& item, int64_t near_from, int64_t keys,
               DecodeScratch& scratch) {
  constexpr int64_t half = d / 2;
  const int64_t rule = view.far_table[item.r], step = view.step;
  const float* offset_cos = view.far_offset_cos + rule * step * half;
  const float* offset_sin = view.far_offset_sin + rule * step * half;
  float* far_q_step = scratch.far_q_step.data();
  for (int64_t j = 0; j < near_from;) {
    const int64_t n = item.first + j, end = std::min(near_from, j + step - n % step);
    const int64_t at = (rule * view.far_steps + n / step) * half;  // a new step: turn the far query back by its angle
    for (int64_t g = 0; g < view.queries_per_kv; ++g)
      rotate(scratch.far_q.data() + g * d, view.far_step_cos + at, view.far_step_sin + at, far_q_step + g * d, half,
             1.f, -1.f);
    const int64_t offset_of_j = n % step - j;  // key j's offset in its step
    score_run<Element, d>(scratch, j, end, keys, far_q_step, view.queries_per_kv, [&](int64_t key) {
      const int64_t offset = key + offset_of_j;
      return Angle{offset_cos + offset * half, offset_sin + offset * half};
    });
    j = end;
  }
}

// keys near_from .. keys - 1, inside the window: the near query against the keys at n theta
template <typename Element, int64_t d>
void score_near(const DecodeView& view, const DecodeItem& item, int64_t near_from, int64_t keys,
                DecodeScratch& scratch) {
  constexpr int64_t half = d / 2;
  const int64_t first_column = item.r * view.band_width + item.first - view.band_start[item.r];  // key j's at + j
  score_run<Element, d>(scratch, near_from, keys, keys, scratch.near_q.data(), view.queries_per_kv, [&](int64_t j) {
    const int64_t at = (first_column + j) * half;
    return Angle{view.near_cos + at, view.near_sin + at};
  });
}

// the item's softmax: its max and sum per query head, and P.V
template <typename Element, int64_t d>
void sum_values(const DecodeView& view, const DecodeItem& item, DecodeScratch& scratch) {
  const int64_t keys = item.last - item.first, partial = item.partial;
  for (int64_t g = 0; g < view.queries_per_kv; ++g) {
    view.partial_max[partial + g] = kNegInf, view.partial_sum[partial + g] = 0.f;
    rope_kernels::softmax_step(scratch.scores.data() + g * kDecodeChunk, keys, view.partial_max[partial + g],
                               view.partial_sum[partial + g]);
  }
  const int64_t queries_per_kv = view.queries_per_kv;
  const float* scores = scratch.scores.data();
  float* out = view.partial_out + partial * d;
#if defined(__AVX512F__)
  if constexpr (avx512::kServes<d>) {
    std::fill(out, out + queries_per_kv * d, 0.f);
    avx512::add_all_values<d, Element>(scratch.row_of.data(), 0, keys, scores, kDecodeChunk, queries_per_kv, out);
    if constexpr (rope_kernels::kFp8Factor<Element> != 1.f)  // what the values' AVX-512 reads leave out
      for (int64_t i = 0; i < queries_per_kv * d; ++i) out[i] *= rope_kernels::kFp8Factor<Element>;
    return;
  }
#endif
  std::fill(out, out + queries_per_kv * d, 0.f);
  for (int64_t j = 0; j < keys; ++j) {
    const float* __restrict value = scratch.key<Element>(j, d, d);
    for (int64_t g = 0; g < queries_per_kv; ++g) {
      const float p = scores[g * kDecodeChunk + j];
      float* __restrict target = out + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) target[i] += p * value[i];
    }
  }
}

// the item's partial softmax from its online one: max, sum and the weighted values in order
template <typename Element, int64_t d>
void finish_online(const DecodeView& view, const DecodeItem& item, DecodeScratch& scratch) {
#if defined(__AVX512F__)
  for (int64_t g = 0; g < view.queries_per_kv; ++g) {
    view.partial_max[item.partial + g] = scratch.maxima[g];
    view.partial_sum[item.partial + g] = _mm512_reduce_add_ps(_mm512_loadu_ps(scratch.totals.data() + g * 16));
    __m512 sums[d / 16];  // times what the values' AVX-512 reads leave out
    const __m512 factor = _mm512_set1_ps(rope_kernels::kFp8Factor<Element>);
    for (int64_t i = 0; i < d / 16; ++i)
      sums[i] = _mm512_mul_ps(factor, _mm512_loadu_ps(scratch.sums.data() + g * d + 16 * i));
    avx512::store_value<d, Element>(sums, view.partial_out + (item.partial + g) * d);
  }
#endif
}

template <typename Element, int64_t d>
void attend_chunk(const DecodeView& view, int64_t index, DecodeScratch& scratch) {
  const DecodeItem item = work_item(view, index);
  if (item.first >= item.last) {  // past this row's end: contributes nothing to the merge
    std::fill(view.partial_max + item.partial, view.partial_max + item.partial + view.queries_per_kv, kNegInf);
    return;
  }
  turn_queries<Element, d>(view, item, scratch);
  find_rows<Element>(view, item, scratch);
  prefetch_first<Element, d>(scratch, item.last - item.first);
  const int64_t keys = item.last - item.first, m = view.seq_lens[item.r] - 1;
  const int64_t near_from = std::clamp(m - view.window[item.r] + 1 - item.first, int64_t(0), keys);  // m - n < w
  if constexpr (kOnline<d>) {
    std::fill(scratch.maxima.begin(), scratch.maxima.end(), kNegInf);
    std::fill(scratch.totals.begin(), scratch.totals.end(), 0.f);
    std::fill(scratch.sums.begin(), scratch.sums.end(), 0.f);
  }
  if (view.far_table[item.r] < 0)
    score_raw<Element, d>(view, near_from, keys, scratch);
  else
    score_far<Element, d>(view, item, near_from, keys, scratch);
  score_near<Element, d>(view, item, near_from, keys, scratch);
  if constexpr (kOnline<d>)
    finish_online<Element, d>(view, item, scratch);
  else
    sum_values<Element, d>(view, item, scratch);
}

// softmax over all keys = sum_c exp(max_c - M) out_c / sum_c exp(max_c - M) sum_c, for row r's kv head h
template <int64_t d>
void merge_chunks(const DecodeView& view, int64_t item) {
  const int64_t r = item / view.kv_heads, h = item % view.kv_heads, queries_per_kv = view.queries_per_kv;
  const int64_t used = (view.seq_lens[r] + kDecodeChunk - 1) / kDecodeChunk;
  for (int64_t g = 0; g < queries_per_kv; ++g) {
    // chunk c at c * queries_per_kv
    const float* maxima = view.partial_max + item * view.chunks * queries_per_kv + g;
    float overall = kNegInf;
    for (int64_t c = 0; c < used; ++c) overall = std::max(overall, maxima[c * queries_per_kv]);
    float* target = view.out + (r * view.heads + h * queries_per_kv + g) * d;
    std::fill(target, target + d, 0.f);
    float total = 0.f;
    for (int64_t c = 0; c < used; ++c) {
      const float weight = rope_kernels::exp_nonpositive(maxima[c * queries_per_kv] - overall);
      total += weight * view.partial_sum[(item * view.chunks + c) * queries_per_kv + g];
      const float* __restrict partial = view.partial_out + ((item * view.chunks + c) * queries_per_kv + g) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) target[i] += weight * partial[i];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) target[i] *= inverse;
  }
}

template <typename Element, int64_t d>
at::Tensor decode_attention_typed(const DecodeInputs& rows, const at::Tensor& query,
                                     const at::Tensor& kv_cache, double scale, bool rounded_once) {
  check_inputs(rows, query, kv_cache);
  const auto contiguous_query = query.contiguous();
  const int64_t count = query.size(0), heads = query.size(1), kv_heads = kv_cache.size(1);
  const int64_t chunks = (longest_row(rows) + kDecodeChunk - 1) / kDecodeChunk, queries_per_kv = heads / kv_heads;
  // partial results per (row, kv head, chunk): max and sum per query head, and the output sum
  at::Tensor partials[] = {at::empty({count, kv_heads, chunks, queries_per_kv}),
                              at::empty({count, kv_heads, chunks, queries_per_kv}),
                              at::empty({count, kv_heads, chunks, queries_per_kv, d})};
  auto output = at::empty({count, heads, d});
  DecodeView view = decode_view(rows, contiguous_query, kv_cache, scale, chunks, partials, output);
  view.rounded_once = rounded_once;
  at::parallel_for(0, count * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    DecodeScratch scratch(d, queries_per_kv);
    for (int64_t item = begin; item < end; ++item) attend_chunk<Element, d>(view, item, scratch);
  });
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) merge_chunks<d>(view, item);
  });
  return output;
}

template <int64_t d>
at::Tensor decode_attention_dim(const DecodeInputs& rows, const at::Tensor& query,
                                   const at::Tensor& kv_cache, double scale, bool rounded_once) {
  return rope_kernels::with_cache_type(kv_cache, "decode_attention", [&](auto element) {
    return decode_attention_typed<decltype(element), d>(rows, query, kv_cache, scale, rounded_once);
  });
}

}  // namespace

at::Tensor decode_attention(const DecodeInputs& rows, const at::Tensor& query, const at::Tensor& kv_cache,
                               double scale, bool rounded_once) {
  switch (query.size(2)) {
#define ROPE_HEAD_DIM(D) \
  case D:                \
    return decode_attention_dim<D>(rows, query, kv_cache, scale, rounded_once);
    ROPE_HEAD_DIM(32) ROPE_HEAD_DIM(64) ROPE_HEAD_DIM(80) ROPE_HEAD_DIM(96) ROPE_HEAD_DIM(128) ROPE_HEAD_DIM(256)
#undef ROPE_HEAD_DIM
    default:
      TORCH_CHECK(false, "decode_attention: unsupported head dim ", query.size(2));
  }
}
