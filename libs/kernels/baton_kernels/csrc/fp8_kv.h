// 8-bit float KV caches (vLLM's --kv-cache-dtype fp8 / fp8_e4m3 and fp8_e5m2) in the CPU
// attention kernels. Every e4m3fn and e5m2 value is exactly a bfloat16 and a float32, so the
// kernels widen what they read without rounding; writes round to nearest even by c10's
// conversions, which are torch's own cast (bit for bit the reference's,
// baton_kernels.attention.base.to_cache_dtype). A cache holds K / k_scale and V / v_scale: the
// kernels fold k_scale into the scores' scale and v_scale into the output.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <array>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

template <typename T>
inline constexpr bool kIsFp8 =
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// The largest finite value of an 8-bit format: what writes saturate at.
template <typename T>
inline constexpr float kFp8Max = std::is_same_v<T, c10::Float8_e4m3fn> ? 448.f : 57344.f;

// Calls f(T{}) with T the element type of a cache of dtype `t`: an 8-bit float, or else `Same`
// (the query's type: a cache of the model's dtype).
template <typename Same, typename F>
inline void visit_cache(c10::ScalarType t, F&& f) {
  if (t == c10::ScalarType::Float8_e4m3fn) f(c10::Float8_e4m3fn{});
  else if (t == c10::ScalarType::Float8_e5m2) f(c10::Float8_e5m2{});
  else f(Same{});
}

inline bool is_fp8(c10::ScalarType t) {
  return t == c10::ScalarType::Float8_e4m3fn || t == c10::ScalarType::Float8_e5m2;
}

// x / scale (as x times `inv_scale`, the float32 of 1 / scale) saturated and rounded to T.
template <typename T>
inline T to_fp8(float x, float inv_scale) {
  x *= inv_scale;
  x = x > kFp8Max<T> ? kFp8Max<T> : (x < -kFp8Max<T> ? -kFp8Max<T> : x);
  return T(x);
}

// The bf16 bits of each of an 8-bit format's 128 magnitudes (its sign is bit 7, bf16's bit 15).
template <typename T>
inline const uint16_t* bf16_magnitudes() {
  alignas(64) static const std::array<uint16_t, 128> table = [] {
    std::array<uint16_t, 128> t{};
    for (int i = 0; i < 128; ++i)
      t[i] = c10::BFloat16(static_cast<float>(T(static_cast<uint8_t>(i), T::from_bits()))).x;
    return t;
  }();
  return table.data();
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define BATON_FP8_SIMD 1
// 32 values of an 8-bit cache as bf16 (exactly; NaN and e5m2's infinities too): each byte's
// magnitude looked up in the format's table of 128 bf16 values (two VPERMT2W of 64 each and a
// blend on bit 6), its sign moved to bit 15. ~8 instructions for 32 values. Construct once
// per kernel call (it holds the table in 4 registers), then call per 32 values.
template <typename T>
struct Fp8ToBf16 {
  __m512i t0, t1, t2, t3;
  Fp8ToBf16() {
    const uint16_t* t = bf16_magnitudes<T>();
    t0 = _mm512_loadu_si512(t);
    t1 = _mm512_loadu_si512(t + 32);
    t2 = _mm512_loadu_si512(t + 64);
    t3 = _mm512_loadu_si512(t + 96);
  }
  __m512i operator()(const void* p) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    const __m512i low = _mm512_permutex2var_epi16(t0, b, t1);   // magnitudes 0-63
    const __m512i high = _mm512_permutex2var_epi16(t2, b, t3);  // 64-127
    const __m512i mag = _mm512_mask_blend_epi16(
        _mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), low, high);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(mag, sign);
  }
};

// 16 bf16 values (a half of a zmm of 32) as float32: a shift into the high half.
inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 bf16_low_f32(__m512i w) { return bf16x16_to_f32(_mm512_castsi512_si256(w)); }
inline __m512 bf16_high_f32(__m512i w) { return bf16x16_to_f32(_mm512_extracti64x4_epi64(w, 1)); }
#endif

// A row of `dim` values of an 8-bit cache as float32.
template <typename T>
inline void fp8_row_to_f32(const T* src, float* dst, int64_t dim) {
  int64_t i = 0;
#if defined(BATON_FP8_SIMD)
  const Fp8ToBf16<T> widen;
  for (; i + 32 <= dim; i += 32) {
    const __m512i w = widen(src + i);
    _mm512_storeu_ps(dst + i, bf16_low_f32(w));
    _mm512_storeu_ps(dst + i + 16, bf16_high_f32(w));
  }
#endif
  for (; i < dim; ++i) dst[i] = static_cast<float>(src[i]);
}

// A row of `dim` values of an 8-bit cache as bfloat16 bits (exact).
template <typename T>
inline void fp8_row_to_bf16(const T* src, uint16_t* dst, int64_t dim) {
  int64_t i = 0;
#if defined(BATON_FP8_SIMD)
  const Fp8ToBf16<T> widen;
  for (; i + 32 <= dim; i += 32) _mm512_storeu_si512(dst + i, widen(src + i));
#endif
  const uint16_t* table = bf16_magnitudes<T>();
  for (; i < dim; ++i) {
    const uint8_t b = src[i].x;
    dst[i] = static_cast<uint16_t>(table[b & 0x7F] | ((b & 0x80) << 8));
  }
}
