// The decode in AVX-512 registers: scoring (each key loaded once for all of its kv head's
// queries, the products summed 16 keys at a time; raw bfloat16 keys by vdpbf16ps where the CPU
// has AVX512_BF16), each block of 16 scores then taken by an online softmax and P.V (each value
// row widened in registers once and added into the sums of a group of queries). csrc/decode_attention.cpp takes
// them where the compiler targets AVX-512 and its portable loops elsewhere; both compute in
// float32 and the tests hold both to the oracle.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace rope_kernels::avx512 {

constexpr int64_t kLanes = 16;

template <int64_t d>
constexpr bool kServes = d % kLanes == 0;

// 16 cache elements as float32 (bfloat16: float32's upper half; float16: the hardware conversion)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp8: the 16 bytes as the float16 that holds each (rope_kernels::fp8_half_bits), then the
// hardware conversion. e4m3fn reads as 2^-8 of its value (kFp8Factor): the decode folds the
// factor into the query's scale and its output, exact for a power of two, where a multiply per
// 16 elements cost its time.
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(words, 8));
}
// sign-extended, then shifted into float16's places: the sign lands in bits 15 and 14, and 14 is cleared
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i without_bit_14 = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(words, 7), without_bit_14));
}

// A cache row's d elements as d / 16 float32 vectors (e4m3fn: 2^-8 of their values)
template <int64_t d, typename Element>
inline void load_row(const Element* row, __m512* out) {
  for (int64_t i = 0; i < d / kLanes; ++i) out[i] = load16(row + kLanes * i);
}

// Scoring keys in registers needs each half of a head in whole vectors (the rotation's pairs).
template <int64_t d>
constexpr bool kScores = d % (2 * kLanes) == 0;

// A cache row's key as d / 16 float32 vectors, turned by the angle of the pairs (i, i + d/2)
// whose cos and sin are given (cos null: the key as it is).
template <int64_t d, typename Element>
inline void load_key(const Element* row, const float* cos, const float* sin, __m512* key) {
  constexpr int64_t vectors = d / kLanes, half = vectors / 2;
  if (cos == nullptr) return load_row<d>(row, key);
  __m512 raw[vectors];
  load_row<d>(row, raw);
  for (int64_t i = 0; i < half; ++i) {
    const __m512 first = raw[i], second = raw[i + half];
    const __m512 c = _mm512_loadu_ps(cos + kLanes * i), s = _mm512_loadu_ps(sin + kLanes * i);
    key[i] = _mm512_fmsub_ps(first, c, _mm512_mul_ps(second, s));
    key[i + half] = _mm512_fmadd_ps(second, c, _mm512_mul_ps(first, s));
  }
}

// Where key k of a block of 16 puts its unsummed products so that sum_lanes returns the
// block's sums in key order (sum_lanes' last step leaves vector 4s + t's sum in lane 4t + s).
constexpr int64_t lane_slot(int64_t k) { return (k % 4) * 4 + k / 4; }

// The sums of 16 vectors' lanes, one per lane (lane 4t + s: vector 4s + t's), by halving them
// pairwise: 45 instructions for 16 sums, where one sum alone takes 8 and waits on each.
inline __m512 sum_lanes(const __m512* v) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: vectors 2i, 2i+1 to 8 lanes each
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: 4 vectors, 4 lanes each
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // pairs of lanes within each quarter: 2 lanes each
    const __m512d a = _mm512_castps_pd(quarters[2 * i]), b = _mm512_castps_pd(quarters[2 * i + 1]);
    eighths[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 even = _mm512_shuffle_ps(eighths[0], eighths[1], 0x88);
  const __m512 odd = _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD);
  return _mm512_add_ps(even, odd);
}

// The keys of a run as float32 vectors, each turned by its angle (or raw): key_of(j, vectors)
// loads key j, product(key, g) is query g's unsummed products with it.
template <int64_t d, typename KeyOf>
struct WidenedKeys {
  using Key = std::array<__m512, d / kLanes>;
  const float* queries;
  KeyOf key_of;
  void load(int64_t j, Key& key) const { key_of(j, key.data()); }
  __m512 product(const Key& key, int64_t g) const {
    const float* query = queries + g * d;
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(query), key[0]);
    for (int64_t i = 1; i < d / kLanes; ++i) sum = _mm512_fmadd_ps(_mm512_loadu_ps(query + kLanes * i), key[i], sum);
    return sum;
  }
};

#if defined(__AVX512BF16__)
// Raw bfloat16 keys as they lie in the cache, against each query split in two bfloat16 parts
// (q = high + low, to 2^-16 of q: each part rounds to 2^-8): vdpbf16ps multiplies the 16-bit pairs exactly and sums in
// float32, so a key is used without being widened. prepare() splits the queries once per run.
// Without kTwoParts (attention_precision bfloat16) each query is its high part alone: half the vdpbf16ps.
template <int64_t d, bool kTwoParts = true>
struct RawBfloat16Keys {
  using Key = std::array<__m512i, d / (2 * kLanes)>;
  static constexpr int64_t vectors = d / (2 * kLanes);  // 32 bfloat16 each
  const void* const* rows;
  char* split;  // [queries][2][vectors] 64-byte vectors: the high parts, then the low ones

  char* part(int64_t g, int64_t low, int64_t i) const { return split + ((2 * g + low) * vectors + i) * 64; }
  static __m512bh halve(__m512 first, __m512 second) { return _mm512_cvtne2ps_pbh(second, first); }
  static __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

  void prepare(const float* queries, int64_t queries_per_kv) const {
    for (int64_t g = 0; g < queries_per_kv; ++g)
      for (int64_t i = 0; i < vectors; ++i) {
        const __m512 first = _mm512_loadu_ps(queries + g * d + 2 * kLanes * i);
        const __m512 second = _mm512_loadu_ps(queries + g * d + 2 * kLanes * i + kLanes);
        const __m512bh high = halve(first, second);
        const __m512i bits = reinterpret_cast<const __m512i&>(high);
        const __m512 rest_first = _mm512_sub_ps(first, widen(_mm512_castsi512_si256(bits)));
        const __m512 rest_second = _mm512_sub_ps(second, widen(_mm512_extracti64x4_epi64(bits, 1)));
        const __m512bh low = halve(rest_first, rest_second);
        _mm512_storeu_si512(part(g, 0, i), reinterpret_cast<const __m512i&>(high));
        if constexpr (kTwoParts) _mm512_storeu_si512(part(g, 1, i), reinterpret_cast<const __m512i&>(low));
      }
  }
  void load(int64_t j, Key& key) const {
    for (int64_t i = 0; i < vectors; ++i)
      key[i] = _mm512_loadu_si512(static_cast<const char*>(rows[j]) + 2 * kLanes * sizeof(uint16_t) * i);
  }
  __m512 product(const Key& key, int64_t g) const {
    __m512 high_sum = _mm512_setzero_ps(), low_sum = _mm512_setzero_ps();  // two chains: half the wait
    for (int64_t i = 0; i < vectors; ++i) {
      const __m512bh bits = reinterpret_cast<const __m512bh&>(key[i]);
      const __m512i high = _mm512_loadu_si512(part(g, 0, i));
      high_sum = _mm512_dpbf16_ps(high_sum, reinterpret_cast<const __m512bh&>(high), bits);
      if constexpr (kTwoParts) {
        const __m512i low = _mm512_loadu_si512(part(g, 1, i));
        low_sum = _mm512_dpbf16_ps(low_sum, reinterpret_cast<const __m512bh&>(low), bits);
      }
    }
    return kTwoParts ? _mm512_add_ps(high_sum, low_sum) : high_sum;
  }
};
#endif

// scores[g * stride + j] = queries[g] . key_j for from <= j < to and g < queries_per_kv. Each key
// is loaded once for all the queries (before(j) runs first: the prefetch); their products wait
// unsummed in `partial` (queries_per_kv * 16 vectors) until 16 keys are summed at once, and
// after(block, count) takes each block's scores as soon as they are summed.
template <typename Keys, typename Before, typename After>
inline void score_keys(const Keys& keys, int64_t from, int64_t to, int64_t queries_per_kv, float* scores,
                       int64_t stride, float* partial, Before before, After after) {
  for (int64_t block = from; block < to; block += kLanes) {
    const int64_t count = std::min(kLanes, to - block);
    for (int64_t k = 0; k < count; ++k) {
      before(block + k);
      typename Keys::Key key;
      keys.load(block + k, key);
      for (int64_t g = 0; g < queries_per_kv; ++g)
        _mm512_storeu_ps(partial + (g * kLanes + lane_slot(k)) * kLanes, keys.product(key, g));
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t g = 0; g < queries_per_kv; ++g) {
      __m512 products[kLanes];
      for (int64_t slot = 0; slot < kLanes; ++slot)
        products[slot] = _mm512_loadu_ps(partial + (g * kLanes + slot) * kLanes);
      _mm512_mask_storeu_ps(scores + g * stride + block, mask, sum_lanes(products));
    }
    after(block, count);
  }
}

// queries whose P.V sums stay in registers together: 16 of the 32 vector registers
template <int64_t d>
constexpr int64_t kValueGroup = std::clamp<int64_t>(kLanes * kLanes / d, 1, 8);

// A value row as d / 16 float32 vectors. bfloat16 rows of whole 32-element vectors are widened
// two instructions per 32 elements, their even elements (shifted up) and odd ones (masked) in
// separate vectors; store_value puts the sums back in order.
template <int64_t d, typename Element>
inline void load_value(const Element* value, __m512* row) {
  if constexpr (std::is_same_v<Element, c10::BFloat16> && kScores<d>) {
    const __m512i odd_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t i = 0; i < d / (2 * kLanes); ++i) {
      const __m512i pairs = _mm512_loadu_si512(value + 2 * kLanes * i);
      row[2 * i] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      row[2 * i + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, odd_mask));
    }
  } else {
    load_row<d>(value, row);
  }
}

template <int64_t d, typename Element>
inline void store_value(const __m512* sums, float* out) {
  if constexpr (std::is_same_v<Element, c10::BFloat16> && kScores<d>) {
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t i = 0; i < d / (2 * kLanes); ++i) {
      _mm512_storeu_ps(out + 2 * kLanes * i, _mm512_permutex2var_ps(sums[2 * i], first, sums[2 * i + 1]));
      _mm512_storeu_ps(out + 2 * kLanes * i + kLanes, _mm512_permutex2var_ps(sums[2 * i], second, sums[2 * i + 1]));
    }
  } else {
    for (int64_t i = 0; i < d / kLanes; ++i) _mm512_storeu_ps(out + kLanes * i, sums[i]);
  }
}

// exp(x) for x <= 0 in 16 lanes (-inf giving 0): rope_kernels::exp_nonpositive's reduction and
// polynomial in registers. Its twin in the online softmax, rope_kernels::softmax_step (lane maxima
// folded in scalar code, a horizontal sum per block), cost 7-11% more arithmetic per 16-key block.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 exp_r = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), exp_r, _mm512_castsi512_ps(bits));
}

// A work item's softmax and P.V as its keys are scored, block by block (flash decoding): per
// query the running max, the running sums of exp(score - max) (16 lanes) and the running sum
// of weighted values (d floats, in load_value's order). Each value row is used just after its
// key, so the memory is asked for rows through the whole item, where a softmax and P.V after
// all of its scores asked for none while they ran (against that order at 32k, float32 decoded
// faster this way and bfloat16, whose arithmetic takes about as long as its reads, the same).
struct OnlineSoftmax {
  float* maxima;  // [queries]
  float* totals;  // [queries][16]
  float* sums;    // [queries][d]
};

// weighted values of keys block .. block + count - 1 into the sums of `group` queries
template <int64_t d, typename Element, int64_t group>
inline void add_values(const void* const* rows, int64_t block, int64_t count, const float* weights, int64_t stride,
                       float* sums) {
  __m512 acc[group][d / kLanes];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d / kLanes; ++i) acc[g][i] = _mm512_loadu_ps(sums + g * d + kLanes * i);
  for (int64_t k = 0; k < count; ++k) {
    __m512 row[d / kLanes];
    load_value<d>(static_cast<const Element*>(rows[block + k]) + d, row);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 weight = _mm512_set1_ps(weights[g * stride + block + k]);
      for (int64_t i = 0; i < d / kLanes; ++i) acc[g][i] = _mm512_fmadd_ps(weight, row[i], acc[g][i]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d / kLanes; ++i) _mm512_storeu_ps(sums + g * d + kLanes * i, acc[g][i]);
}

// add_values for queries_per_kv queries, kValueGroup<d> at a time (query g's weights at g * stride, sums at g * d)
template <int64_t d, typename Element>
inline void add_all_values(const void* const* rows, int64_t block, int64_t count, const float* weights,
                           int64_t stride, int64_t queries_per_kv, float* sums) {
  for (int64_t g = 0; g < queries_per_kv; g += kValueGroup<d>) {
    const float* group_weights = weights + g * stride;
    float* group_sums = sums + g * d;
    switch (std::min(kValueGroup<d>, queries_per_kv - g)) {
#define ROPE_VALUE_GROUP(N)                                                                          \
  case N:                                                                                            \
    if constexpr (N <= kValueGroup<d>)                                                               \
      add_values<d, Element, N>(rows, block, count, group_weights, stride, group_sums);              \
    break;
      ROPE_VALUE_GROUP(1) ROPE_VALUE_GROUP(2) ROPE_VALUE_GROUP(3) ROPE_VALUE_GROUP(4)
      ROPE_VALUE_GROUP(5) ROPE_VALUE_GROUP(6) ROPE_VALUE_GROUP(7) ROPE_VALUE_GROUP(8)
#undef ROPE_VALUE_GROUP
      default: break;
    }
  }
}

// the scores of keys block .. block + count - 1 (count <= 16) into the online softmax: each
// query's max moves up (what it has summed is rescaled), the scores become weights, and the
// weighted values are added
template <int64_t d, typename Element>
inline void attend_block(const void* const* rows, int64_t block, int64_t count, float* scores, int64_t stride,
                         int64_t queries_per_kv, const OnlineSoftmax& state) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < queries_per_kv; ++g) {
    const __m512 score = _mm512_mask_loadu_ps(none, mask, scores + g * stride + block);
    const float maximum = _mm512_reduce_max_ps(score);
    float* total = state.totals + g * kLanes;
    if (maximum > state.maxima[g]) {
      const __m512 correction = exp_nonpositive16(_mm512_set1_ps(state.maxima[g] - maximum));
      _mm512_storeu_ps(total, _mm512_mul_ps(correction, _mm512_loadu_ps(total)));
      for (int64_t i = 0; i < d; i += kLanes)
        _mm512_storeu_ps(state.sums + g * d + i, _mm512_mul_ps(correction, _mm512_loadu_ps(state.sums + g * d + i)));
      state.maxima[g] = maximum;
    }
    const __m512 weight = exp_nonpositive16(_mm512_sub_ps(score, _mm512_set1_ps(state.maxima[g])));
    _mm512_storeu_ps(total, _mm512_add_ps(weight, _mm512_loadu_ps(total)));
    _mm512_mask_storeu_ps(scores + g * stride + block, mask, weight);
  }
  add_all_values<d, Element>(rows, block, count, scores, stride, queries_per_kv, state.sums);
}

}  // namespace rope_kernels::avx512
#endif
