// The prefill's two GEMMs on AMX tiles (Intel Xeon since Sapphire Rapids), for 16-bit caches:
// one instruction multiplies bfloat16 tiles into a 16 x 16 float32 tile. vLLM's own CPU
// attention takes them in bfloat16, where the float32 micro-kernel (micro_gemm.h) left the
// plugin's prefill 2.8x slower than stock vLLM's at 8k on such a CPU.
//
// A float32 operand x is taken as two bfloat16 parts, high = bf16(x) and low = bf16(x - high):
// each rounding is within 2^-8, so together they hold x to 2^-16 of it. The products
// high.high + low.high + high.low are exact and summed in float32 (low.low, under 2^-16 of the
// product, is left out), so each product is within about 2^-15 of float32's, where one
// bfloat16 rounding of each operand (stock vLLM's) leaves it 2^-7 off. Operands that are whole bfloat16 numbers (raw keys and values of a
// bfloat16 cache) have no low part and skip its product.
// Rounded once (a null low part throughout, `rounded_once` in attention_inputs.h), every operand
// is its high part alone: stock vLLM's arithmetic, one product per tile where two parts take two or three.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ROPE_MATRIX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/util/BFloat16.h>

#include "attention_inputs.h"
#include "decode_vector.h"
#include "vector_math.h"

namespace rope_kernels::tiles {

constexpr int64_t kRows = 16;   // rows of every tile (queries, dimension pairs or key pairs)
constexpr int64_t kDepth = 32;  // bfloat16 elements of one A row: 16 pairs, 64 bytes
constexpr int64_t kTileKeys = kKeyTile;  // keys per key tile, as the float32 tiles hold them

// Linux grants a process the AMX tile state only on request; a process that never asked faults on
// its first tile instruction (vLLM's worker asks at start, a bare interpreter does not).
inline bool granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Every tile is 16 rows of 64 bytes: A 16 x 32 bfloat16, B 16 pairs x 16 columns x 2, C 16 x 16 float32.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// per thread, before its first tile instruction (release() after its last)
inline void configure() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.bytes_per_row[i] = 64, config.rows[i] = kRows;
  _tile_loadconfig(&config);
}
inline void release() { _tile_release(); }

inline __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// 16 floats rounded to bfloat16 (round to nearest even)
inline __m256i round16(__m512 x) {
  const __m256bh rounded = _mm512_cvtneps_pbh(x);
  return reinterpret_cast<const __m256i&>(rounded);
}

// 16 floats as their bfloat16 high parts and low parts; or-ed into `any_low` where a low part is not zero
inline void split16(__m512 x, __m256i& high, __m256i& low, __m512i& any_low) {
  high = round16(x);
  low = round16(_mm512_sub_ps(x, widen(high)));
  any_low = _mm512_or_si512(any_low, _mm512_castsi256_si512(low));
}

// rows of float32 (n a multiple of 16) as high and low bfloat16 rows, in the same order: A
// operands (the high parts alone where `low` is null)
inline void split_rows(const float* x, int64_t n, uint16_t* high, uint16_t* low) {
  __m512i unused = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 value = _mm512_loadu_ps(x + i);
    __m256i h, l;
    if (low == nullptr) {
      h = round16(value);
    } else {
      split16(value, h, l, unused);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + i), l);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + i), h);
  }
}

// 16 elements of `even` and `odd` side by side as 32 bfloat16 (e0 o0 e1 o1 ...), high and low
// parts (the high alone where `low` is null)
inline void interleave16(const float* even, const float* odd, uint16_t* high, uint16_t* low, __m512i& any_low) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const auto pairs = [&](__m256i a, __m256i b) {
    return _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
  };
  if (low == nullptr) {
    _mm512_storeu_si512(high, pairs(round16(_mm512_loadu_ps(even)), round16(_mm512_loadu_ps(odd))));
    return;
  }
  __m256i even_high, even_low, odd_high, odd_low;
  split16(_mm512_loadu_ps(even), even_high, even_low, any_low);
  split16(_mm512_loadu_ps(odd), odd_high, odd_low, any_low);
  _mm512_storeu_si512(high, pairs(even_high, odd_high));
  _mm512_storeu_si512(low, pairs(even_low, odd_low));
}

// exp(x) for x <= 0 in 16 lanes (-inf and x < -87 giving 0): 2^(x log2 e) as 2^n by vscalefps
// times 2^f (|f| <= 1/2) by its degree-6 Taylor polynomial (within 2^-23 of it). x log2 e is
// rounded once, 2^-24 of it: under 2^-20 of the result for x >= -10, the weights that count.
inline __m512 exp_by_scale(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(kept, p, n);
}

// rope_kernels::softmax_step with its weights written as A operands: exp(score - max) of
// scores[0 .. count) as bfloat16 high and low parts (high alone where `kLow` is false), zero up to
// `padded` (whole 32-key tiles), in one pass. Returns the rescaling factor of what the row has summed.
template <bool kLow>
inline float softmax_step_to_parts(const float* scores, int64_t count, int64_t padded, float& running_max,
                                   float& running_sum, uint16_t* high, uint16_t* low) {
  const float maximum = max_of(scores, count, running_max);
  const float correction = rescaling(running_max, maximum);
  const __m512 shift = _mm512_set1_ps(maximum);
  __m512 total = _mm512_setzero_ps();
  __m512i unused = _mm512_setzero_si512();
  const auto put = [&](int64_t j, __m512 weight) {
    total = _mm512_add_ps(total, weight);
    if constexpr (kLow) {
      __m256i h, l;
      split16(weight, h, l, unused);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + j), h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + j), l);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + j), round16(weight));
    }
  };
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) put(j, exp_by_scale(_mm512_sub_ps(_mm512_loadu_ps(scores + j), shift)));
  for (; j < padded; j += 16) {  // the last scores, then zeros
    const __mmask16 inside = static_cast<__mmask16>(count > j ? (1u << (count - j)) - 1 : 0);
    put(j, _mm512_maskz_mov_ps(inside, exp_by_scale(_mm512_sub_ps(_mm512_maskz_loadu_ps(inside, scores + j), shift))));
  }
  running_sum = running_sum * correction + _mm512_reduce_add_ps(total);
  running_max = maximum;
  return correction;
}

inline bool nonzero(__m512i any) { return _mm512_test_epi32_mask(any, any) != 0; }

// Key tiles [tiles][d][32] (a dimension's 32 keys contiguous, micro_gemm.h's B) as B operands
// [tiles][d/2][32][2]: dimensions 2p and 2p + 1 of a key side by side (no low parts where `low`
// is null). Returns whether any low part is non-zero.
inline bool pack_key_tiles(const float* key_tiles, int64_t count, int64_t d, uint16_t* high, uint16_t* low) {
  __m512i any_low = _mm512_setzero_si512();
  for (int64_t t = 0; t < count; ++t)
    for (int64_t p = 0; p < d / 2; ++p)
      for (int64_t key = 0; key < kTileKeys; key += 16) {
        const float* even = key_tiles + (t * d + 2 * p) * kTileKeys + key;
        const int64_t at = ((t * d / 2 + p) * kTileKeys + key) * 2;
        interleave16(even, even + kTileKeys, high + at, low ? low + at : nullptr, any_low);
      }
  return nonzero(any_low);
}

// Values [keys][d] as B operands [keys_padded / 2][d][2] (keys 2q and 2q + 1 side by side, zero past
// `keys`; no low parts where `low` is null). Returns whether any low part is non-zero.
inline bool pack_values(const float* values, int64_t keys, int64_t keys_padded, int64_t d, uint16_t* high,
                        uint16_t* low) {
  __m512i any_low = _mm512_setzero_si512();
  const std::vector<float> zeros(d, 0.f);  // the partner of an odd count's last key
  for (int64_t q = 0; q < keys; q += 2) {
    const float* odd = q + 1 < keys ? values + (q + 1) * d : zeros.data();
    for (int64_t c = 0; c < d; c += 16)
      interleave16(values + q * d + c, odd + c, high + (q * d + 2 * c), low ? low + (q * d + 2 * c) : nullptr,
                   any_low);
  }
  const int64_t written = (keys + 1) / 2 * 2 * d;
  std::fill(high + written, high + keys_padded * d, uint16_t{0});
  if (low != nullptr) std::fill(low + written, low + keys_padded * d, uint16_t{0});
  return nonzero(any_low);
}

// scores[16 rows][32 keys] (row stride `ld` floats) of one key tile: queries [16][d] as high and
// low rows (stride d; no low rows where `query_low` is null), the tile's keys as pack_key_tiles' B operands
inline void score_tile(const uint16_t* query_high, const uint16_t* query_low, int64_t d, const uint16_t* key_high,
                       const uint16_t* key_low, bool key_has_low, float* scores, int64_t ld) {
  constexpr int64_t pair_row = kTileKeys * 2 * sizeof(uint16_t);  // one dimension pair of 32 keys: 128 bytes
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t depth = 0; depth < d; depth += kDepth) {
    _tile_loadd(2, query_high + depth, d * sizeof(uint16_t));
    const int64_t at = depth / 2 * kTileKeys * 2;  // its first dimension pair
    _tile_loadd(4, key_high + at, pair_row);
    _tile_loadd(5, key_high + at + 32, pair_row);  // keys 16..31
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    if (query_low != nullptr) {
      _tile_loadd(3, query_low + depth, d * sizeof(uint16_t));
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (key_has_low) {
      _tile_loadd(4, key_low + at, pair_row);
      _tile_loadd(5, key_low + at + 32, pair_row);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 2, 5);
    }
  }
  _tile_stored(0, scores, ld * sizeof(float));
  _tile_stored(1, scores + 16, ld * sizeof(float));
}

// scores[16 rows][keys] of consecutive key tiles (keys a multiple of 32, row stride `ld` floats).
// For d <= 64 the query's parts stay in tiles 4-7 across the key tiles (fewer loads than one
// score_tile per key tile, which larger heads take).
inline void score_run(const uint16_t* query_high, const uint16_t* query_low, int64_t d, const uint16_t* key_high,
                      const uint16_t* key_low, bool key_has_low, int64_t keys, float* scores, int64_t ld) {
  const int64_t tile_size = d * kTileKeys;
  if (d > 2 * kDepth) {
    for (int64_t key = 0; key < keys; key += kTileKeys)
      score_tile(query_high, query_low, d, key_high + key / kTileKeys * tile_size,
                 key_has_low ? key_low + key / kTileKeys * tile_size : nullptr, key_has_low, scores + key, ld);
    return;
  }
  constexpr int64_t pair_row = kTileKeys * 2 * sizeof(uint16_t);
  const int64_t stride = d * sizeof(uint16_t), second = kTileKeys * kTileKeys;  // the second 32 dims' pairs
  const bool two = d == 2 * kDepth;
  const bool query_has_low = query_low != nullptr;
  _tile_loadd(4, query_high, stride);
  if (query_has_low) _tile_loadd(5, query_low, stride);
  if (two) {
    _tile_loadd(6, query_high + kDepth, stride);
    if (query_has_low) _tile_loadd(7, query_low + kDepth, stride);
  }
  for (int64_t key = 0; key < keys; key += kTileKeys) {
    const uint16_t* high = key_high + key / kTileKeys * tile_size;
    const uint16_t* low = key_has_low ? key_low + key / kTileKeys * tile_size : nullptr;
    _tile_zero(0);
    _tile_zero(1);
#define ROPE_SCORE_DEPTH(QH, QL, AT)                \
  {                                                 \
    _tile_loadd(2, high + (AT), pair_row);          \
    _tile_loadd(3, high + (AT) + 32, pair_row);     \
    _tile_dpbf16ps(0, QH, 2);                       \
    _tile_dpbf16ps(1, QH, 3);                       \
    if (query_has_low) {                            \
      _tile_dpbf16ps(0, QL, 2);                     \
      _tile_dpbf16ps(1, QL, 3);                     \
    }                                               \
    if (key_has_low) {                              \
      _tile_loadd(2, low + (AT), pair_row);         \
      _tile_loadd(3, low + (AT) + 32, pair_row);    \
      _tile_dpbf16ps(0, QH, 2);                     \
      _tile_dpbf16ps(1, QH, 3);                     \
    }                                               \
  }
    ROPE_SCORE_DEPTH(4, 5, 0)
    if (two) {
      ROPE_SCORE_DEPTH(6, 7, second)
    }
#undef ROPE_SCORE_DEPTH
    _tile_stored(0, scores + key, ld * sizeof(float));
    _tile_stored(1, scores + key + 16, ld * sizeof(float));
  }
}

// acc[16 rows][d] += P[16 rows][keys] . V[keys][d] (keys a multiple of 32): P as high and low rows
// (stride ld_p; high alone where `p_low` is null), V as pack_values' B operands from the first of these keys. 64 columns of acc at
// a time stay in tiles 0-3 while the keys go by.
inline void add_values(const uint16_t* p_high, const uint16_t* p_low, int64_t ld_p, int64_t keys,
                       const uint16_t* value_high, const uint16_t* value_low, bool value_has_low, int64_t d,
                       float* acc) {
  const int64_t pair_row = d * 2 * sizeof(uint16_t), acc_row = d * sizeof(float);
  const bool p_has_low = p_low != nullptr;
  for (int64_t group = 0; group < d; group += 64) {
    const int64_t columns = std::min<int64_t>(4, (d - group) / 16);
#define ROPE_VALUE_TILES(ACTION) \
  ACTION(0) if (columns > 1) ACTION(1) if (columns > 2) ACTION(2) if (columns > 3) ACTION(3)
#define ROPE_LOAD_ACC(C) { _tile_loadd(C, acc + group + 16 * (C), acc_row); }
#define ROPE_STORE_ACC(C) { _tile_stored(C, acc + group + 16 * (C), acc_row); }
#define ROPE_ADD_VALUES(C)                                                                   \
  {                                                                                          \
    const int64_t at = key / 2 * d * 2 + (group + 16 * (C)) * 2;                             \
    _tile_loadd(6, value_high + at, pair_row);                                               \
    _tile_dpbf16ps(C, 4, 6);                                                                 \
    if (p_has_low) _tile_dpbf16ps(C, 5, 6);                                                  \
    if (value_has_low) {                                                                     \
      _tile_loadd(7, value_low + at, pair_row);                                              \
      _tile_dpbf16ps(C, 4, 7);                                                               \
    }                                                                                        \
  }
    ROPE_VALUE_TILES(ROPE_LOAD_ACC)
    for (int64_t key = 0; key < keys; key += kDepth) {
      _tile_loadd(4, p_high + key, ld_p * sizeof(uint16_t));
      if (p_has_low) _tile_loadd(5, p_low + key, ld_p * sizeof(uint16_t));
      ROPE_VALUE_TILES(ROPE_ADD_VALUES)
    }
    ROPE_VALUE_TILES(ROPE_STORE_ACC)
#undef ROPE_ADD_VALUES
#undef ROPE_STORE_ACC
#undef ROPE_LOAD_ACC
#undef ROPE_VALUE_TILES
  }
}

}  // namespace rope_kernels::tiles
#endif
