// The vectorisable math of the C++ kernels, each written once: widening a cache row to float32,
// exp, the rotation, the dot product and the online-softmax step.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace rope_kernels {

// exp(x) for x <= 0 (-inf included, giving 0), in a form compilers vectorise: x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by Cephes' degree-5 polynomial (within 2 ulp), times 2^n from its bits.
#pragma omp declare simd
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float exp_r = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : exp_r * two_n;
}

// The largest of scores[0 .. count) and `floor`. A max reduction is not vectorised by GCC
// (NaN order), so 16 running maxima are kept lane by lane, elementwise, and folded at the end.
inline float max_of(const float* __restrict scores, int64_t count, float floor) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, floor);
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], scores[j + l]);
  }
  for (; j < count; ++j) lanes[0] = std::max(lanes[0], scores[j]);
  // folded in halves (4 dependent steps, not 16: the fold is paid once per row and key step)
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < width; ++l) lanes[l] = std::max(lanes[l], lanes[l + width]);
  }
  return lanes[0];
}

// The factor by which what a row has summed under `running_max` is rescaled to `maximum`: 1
// without the exp where the maximum did not move, as it mostly does not once a row has begun.
inline float rescaling(float running_max, float maximum) {
  return maximum == running_max ? 1.f : exp_nonpositive(running_max - maximum);
}

// scores[j] = exp(scores[j] - maximum) for j < count (maximum at least every score); returns their sum.
inline float exponentiate(float* __restrict scores, int64_t count, float maximum) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < count; ++j) {
    const float p = exp_nonpositive(scores[j] - maximum);
    scores[j] = p;
    total += p;
  }
  return total;
}

// An fp8 cache's elements (stored divided by their layer's scale, which the callers fold into
// the query's scale and the output) read through float16, which holds both formats exactly:
// e5m2 is float16's upper byte; e4m3fn's exponent and mantissa moved into float16's places are
// 2^-8 of its value (its bias is 7, float16's 15; subnormals too), which kFp8Factor restores.
// e4m3fn's NaN (0x7F) would read as 480: the cache write saturates and never stores one.
template <typename Element>
constexpr bool kFp8 = std::is_same_v<Element, c10::Float8_e4m3fn> || std::is_same_v<Element, c10::Float8_e5m2>;

template <typename Element>
constexpr float kFp8Factor = std::is_same_v<Element, c10::Float8_e4m3fn> ? 256.f : 1.f;

template <typename Element>
inline uint16_t fp8_half_bits(uint8_t bits) {
  if constexpr (std::is_same_v<Element, c10::Float8_e5m2>) {
    return static_cast<uint16_t>(bits << 8);
  } else {
    return static_cast<uint16_t>((bits & 0x80) << 8 | (bits & 0x7F) << 7);
  }
}

// x in an fp8 format as stock vLLM 0.32's CPU cache writes it (its AVX-512 path): saturated at
// the format's largest finite value and rounded toward zero, which for a float32 is its
// mantissa cut to the format's bits (rope_plugins/ops/cpu.py's `quantized`, its PyTorch twin).
template <typename Element>
inline uint8_t fp8_toward_zero(float x) {
  constexpr bool e4m3 = std::is_same_v<Element, c10::Float8_e4m3fn>;
  constexpr int mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  constexpr float largest = e4m3 ? 448.f : 57344.f, subnormal_step = e4m3 ? 0x1p-9f : 0x1p-16f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float magnitude = std::min(std::fabs(x), largest);  // NaN: `largest` (the cache holds no NaN)
  if (magnitude < subnormal_step * (1 << mantissa))  // below the smallest normal: whole subnormal steps
    return sign | static_cast<uint8_t>(magnitude / subnormal_step);
  const uint32_t bits = __builtin_bit_cast(uint32_t, magnitude);
  const int exponent = static_cast<int>(bits >> 23) - 127 + bias;
  return sign | static_cast<uint8_t>(exponent << mantissa | (bits >> (23 - mantissa) & ((1u << mantissa) - 1)));
}

// one cache element as float32 (exact), in a form `omp simd` loops vectorise
template <typename Element>
inline float to_float(Element x) {
  if constexpr (std::is_same_v<Element, c10::BFloat16>) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
  } else if constexpr (kFp8<Element>) {
    return static_cast<float>(c10::Half(fp8_half_bits<Element>(x.x), c10::Half::from_bits())) * kFp8Factor<Element>;
  } else {
    return static_cast<float>(x);
  }
}

// out[0 .. count) = the cache elements as float32. bfloat16 is float32's upper half, so widening
// is a shift (exact, and vectorised to two instructions per 16 elements); float16 and fp8 go
// through c10's float16 conversion (exact too).
template <typename Element>
inline void widen(const Element* __restrict row, float* __restrict out, int64_t count) {
  if constexpr (std::is_same_v<Element, c10::BFloat16>) {
    const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) out[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) out[i] = to_float(row[i]);
  }
}

// A cache row as float32: a float32 row in place, a 16-bit or fp8 one widened into `buffer`.
template <typename Element>
inline const float* as_floats(const Element* row, float* buffer, int64_t count) {
  if constexpr (std::is_same_v<Element, float>) {
    return row;
  } else {
    widen(row, buffer, count);
    return buffer;
  }
}

// out = factor R(sign angle) x for the pairs (i, i + half), angle given by its cos and sin; x
// float32 or a 16-bit or fp8 cache row, widened as it is read.
template <typename Element>
inline void rotate(const Element* __restrict x, const float* __restrict cos, const float* __restrict sin,
                   float* __restrict out, int64_t half, float factor = 1.f, float sign = 1.f) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float first = factor * to_float(x[i]), second = factor * to_float(x[i + half]), s = sign * sin[i];
    out[i] = first * cos[i] - second * s;
    out[i + half] = second * cos[i] + first * s;
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

// One online-softmax step of a row over scores[0 .. count): they become exp(score - max) under
// the row's new running max, and running_sum takes in their sum. Returns the factor by which
// what the row has already summed must be rescaled (0 on its first step).
inline float softmax_step(float* __restrict scores, int64_t count, float& running_max, float& running_sum) {
  const float maximum = max_of(scores, count, running_max);
  const float correction = rescaling(running_max, maximum);
  running_sum = running_sum * correction + exponentiate(scores, count, maximum);
  running_max = maximum;
  return correction;
}

}  // namespace rope_kernels
