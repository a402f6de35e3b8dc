// Vector math shared by the CPU kernels (AVX-512 only).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// exp(x) in float32: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, times
// 2^n; within ~2 ulp. Inputs are clamped to [-87, 88], where e^x stays a normal float.
inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  // n = round(x / ln2) by adding and removing 1.5 * 2^23 (its low mantissa bits hold n)
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), magic);
  const __m512 n = _mm512_sub_ps(t, magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  // 2^n: n (in t's low bits) shifted into the exponent field
  const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(t), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

// tanh(x) in float32 as 1 - 2 / (e^2x + 1): exactly +-1 once |x| passes ~44 (vexp's clamp), and
// near 0 within a few ulp of 1 absolutely, not relatively. That suits the softcap c * tanh(s / c)
// (its only user): the capped scores feed a softmax, to which only their absolute error counts.
inline __m512 vtanh(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = vexp(_mm512_add_ps(x, x));
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
}
#endif
