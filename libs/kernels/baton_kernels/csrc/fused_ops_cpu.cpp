// Fused elementwise ops for the Llama decoder on CPU, the counterparts of
// baton_kernels/triton/fused_ops.py: one pass per row instead of a chain of torch kernels (in a
// bf16 decode step of 16 requests, torch's RMSNorm alone took ~110 us per call, ~20% of the
// step). Each op rounds where the torch ops it replaces round (torch 2.13 on CPU), so the results
// equal them up to float evaluation order:
//   fused_add_rms_norm: residual = dtype(x + residual); out = dtype(r * rstd * w)
//   rotary_embedding_:  x = dtype(dtype(x * c) + dtype(rot(x) * s)), c and s rounded to dtype
//   silu_and_mul:       out = dtype(dtype(silu(gate)) * up)
//   gelu_tanh_and_mul:  out = dtype(dtype(gelu_tanh(gate)) * up) (Gemma's GeGLU)
// Rows run on torch's intra-op thread pool (at::parallel_for) once a tensor is large enough to
// pay for a parallel region; with AVX512-BF16 the rows are processed 16 lanes at a time.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace {
// Rounds a float to the storage type and back (a no-op for float32).
template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Rows per task: about this many elements, so that a decode step's small tensors (16 x 576)
// run on the calling thread. A parallel region costs more than they do once vectorized, and
// it waits for every thread of the pool, so a pool thread preempted by another process (a
// server's network threads) would stall the step at each one.
constexpr int64_t kSerialElems = 32768;
inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, kSerialElems / std::max<int64_t>(1, elems_per_row));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 16 lanes of float32 at a time; bf16 converts on load (exact) and on store (round to nearest
// even, as c10::BFloat16). Masked loads read zeros past the end of a row.
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}
inline __m512 vload(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 vload(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void vstore(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
template <typename T>
inline __m512 vrnd(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#define BATON_VECTOR_OPS 1
#endif

template <typename T>
void add_rms_norm_kernel(const torch::Tensor& x, torch::Tensor* residual, const torch::Tensor& w,
                         torch::Tensor& out, float eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sx = x.stride(0), sr = residual ? residual->stride(0) : 0, so = out.stride(0);
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
#ifdef BATON_VECTOR_OPS
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * sx;
      T* rr = rp ? rp + r * sr : nullptr;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < h; i += 16) {
        const __mmask16 m = lanes(h - i);
        __m512 v = vload(xr + i, m);
        if (rr) {
          v = vrnd<T>(_mm512_add_ps(v, vload(rr + i, m)));
          vstore(rr + i, v, m);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const T* src = rr ? rr : xr;  // the rounded sum, as stored
      const __m512 rstd = _mm512_set1_ps(
          1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(h) + eps));
      T* orow = op + r * so;
      for (int64_t i = 0; i < h; i += 16) {
        const __mmask16 m = lanes(h - i);
        const __m512 v = _mm512_mul_ps(vload(src + i, m), rstd);
        vstore(orow + i, _mm512_mul_ps(v, vload(wp + i, m)), m);
      }
    }
#else
    std::vector<float> buf(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * sx;
      float ss = 0.f;
      if (rp) {
        T* rr = rp + r * sr;
        for (int64_t i = 0; i < h; ++i) {
          const T sum = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          rr[i] = sum;
          buf[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < h; ++i) buf[i] = static_cast<float>(xr[i]);
      }
      for (int64_t i = 0; i < h; ++i) ss += buf[i] * buf[i];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      T* orow = op + r * so;
      for (int64_t i = 0; i < h; ++i)
        orow[i] = static_cast<T>(buf[i] * rstd * static_cast<float>(wp[i]));
    }
#endif
  });
}

template <typename T>
void rotary_kernel(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& pos,
                   const torch::Tensor& cos_sin) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), half = d / 2;
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t cs0 = cos_sin.stride(0), cs1 = cos_sin.stride(1);
  auto rotate = [&](T* base, int64_t heads, int64_t s0, int64_t s1, int64_t t, const float* c,
                    const float* s) {
    for (int64_t hh = 0; hh < heads; ++hh) {
      T* x = base + t * s0 + hh * s1;
#ifdef BATON_VECTOR_OPS
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = lanes(half - i);
        const __m512 x1 = vload(x + i, m), x2 = vload(x + i + half, m);
        const __m512 c1 = vrnd<T>(vload(c + i, m)), c2 = vrnd<T>(vload(c + i + half, m));
        const __m512 s1_ = vrnd<T>(vload(s + i, m)), s2 = vrnd<T>(vload(s + i + half, m));
        // rotate_half(x) = (-x2, x1); rounding is symmetric, so rnd(-a) = -rnd(a)
        vstore(x + i, _mm512_sub_ps(vrnd<T>(_mm512_mul_ps(x1, c1)), vrnd<T>(_mm512_mul_ps(x2, s1_))),
               m);
        vstore(x + i + half,
               _mm512_add_ps(vrnd<T>(_mm512_mul_ps(x2, c2)), vrnd<T>(_mm512_mul_ps(x1, s2))), m);
      }
#else
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
        const float c1 = rnd<T>(c[i]), c2 = rnd<T>(c[i + half]);
        const float s1_ = rnd<T>(s[i]), s2 = rnd<T>(s[i + half]);
        // rotate_half(x) = (-x2, x1)
        x[i] = static_cast<T>(rnd<T>(x1 * c1) + rnd<T>(-x2 * s1_));
        x[i + half] = static_cast<T>(rnd<T>(x2 * c2) + rnd<T>(x1 * s2));
      }
#endif
    }
  };
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows((hq + hk) * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pp[t] * cs0;
      const float* s = c + cs1;
      rotate(qp, hq, q.stride(0), q.stride(1), t, c, s);
      rotate(kp, hk, k.stride(0), k.stride(1), t, c, s);
    }
  });
}

// GELU's tanh form as a sigmoid: 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)) with
// y = sqrt(2 / pi) (x + 0.044715 x^3), the same pass as SiLU's x / (1 + e^(-x)) but for the
// exponent's argument (and, unlike 1 - 2 / (e^2y + 1), accurate relatively near 0).
constexpr float kGeluScale = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

template <typename T, bool Gelu>
void act_and_mul_kernel(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  // ~25 vector operations per 16 elements (the exponential): worth two threads from ~8 rows
  at::parallel_for(0, rows, grain_rows(4 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * sx;
      const T* u = g + n;
      T* o = op + r * so;
#ifdef BATON_VECTOR_OPS
      const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        const __m512 gv = vload(g + i, m);
        __m512 arg = gv;
        if constexpr (Gelu) {
          const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
          arg = _mm512_mul_ps(_mm512_set1_ps(kGeluScale),
                              _mm512_fmadd_ps(_mm512_set1_ps(kGeluCubic), cube, gv));
        }
        const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), arg));
        // 1 / (1 + e): the 14-bit reciprocal estimate and one Newton step (~1 ulp)
        const __m512 den = _mm512_add_ps(one, e);
        __m512 inv = _mm512_rcp14_ps(den);
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, two));
        const __m512 act = vrnd<T>(_mm512_mul_ps(gv, inv));
        vstore(o + i, _mm512_mul_ps(act, vload(u + i, m)), m);
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        const float gv = static_cast<float>(g[i]);
        const float arg = Gelu ? kGeluScale * (gv + kGeluCubic * gv * gv * gv) : gv;
        const float act = rnd<T>(gv / (1.f + std::exp(-arg)));
        o[i] = static_cast<T>(act * static_cast<float>(u[i]));
      }
#endif
    }
  });
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be 2-D with contiguous rows");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat, what,
              " must be float32 or bfloat16");
}
}  // namespace

// Returns (normed, residual); `residual` (if defined) is updated in place to x + residual.
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x,
                                              c10::optional<torch::Tensor> residual,
                                              torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  torch::Tensor* r = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    r = &residual.value();
  }
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == torch::kBFloat16)
    add_rms_norm_kernel<c10::BFloat16>(x, r, weight, out, static_cast<float>(eps));
  else
    add_rms_norm_kernel<float>(x, r, weight, out, static_cast<float>(eps));
  return {out, r ? *r : x};
}

void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                       torch::Tensor cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [T, Hq, D] and k [T, Hk, D] expected");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "the head dimension must be contiguous and even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat),
              "q and k must both be float32 or bfloat16");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) &&
                  positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "positions must be [T] int64");
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(1) == 2 && cos_sin.size(2) == q.size(2) &&
                  cos_sin.scalar_type() == torch::kFloat && cos_sin.stride(2) == 1,
              "cos_sin must be [max_positions, 2, D] float32");
  if (q.scalar_type() == torch::kBFloat16)
    rotary_kernel<c10::BFloat16>(q, k, positions, cos_sin);
  else
    rotary_kernel<float>(q, k, positions, cos_sin);
}

namespace {
template <bool Gelu>
torch::Tensor act_and_mul(const torch::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [T, 2 * I]");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kBFloat16)
    act_and_mul_kernel<c10::BFloat16, Gelu>(x, out);
  else
    act_and_mul_kernel<float, Gelu>(x, out);
  return out;
}
}  // namespace

torch::Tensor silu_and_mul(torch::Tensor x) { return act_and_mul<false>(x); }

torch::Tensor gelu_tanh_and_mul(torch::Tensor x) { return act_and_mul<true>(x); }

// Index of each row's largest value, as torch.argmax: the first one on ties, the first NaN in
// a row that has one. Compares integer keys of the float bits (monotonic in the float order),
// so the file's -ffast-math cannot fold away the NaN and infinity cases. One pass for the
// largest key (and whether a NaN occurred), one to find it; rows run in parallel. Replaces the
// greedy path's torch argmax (~360 us for 16 x 49152 float32 logits on 2 cores).
namespace {
inline uint32_t bits_at(const float* p, int64_t i) {
  uint32_t b;
  std::memcpy(&b, p + i, 4);
  return b;
}
inline uint32_t bits_at(const c10::BFloat16* p, int64_t i) {
  return static_cast<uint32_t>(p[i].x) << 16;
}
inline bool is_nan(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }
// Signed integers ordered as the floats are: negative floats have their magnitude bits flipped.
inline int32_t key_of(uint32_t b) {
  const auto i = static_cast<int32_t>(b);
  return i >= 0 ? i : i ^ 0x7fffffff;
}

template <typename T>
int64_t argmax_row(const T* p, int64_t n) {
  int32_t best = key_of(0xff800000u);  // -inf
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    __m512i vbest = _mm512_set1_epi32(best);
    __mmask16 nans = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512i b = _mm512_loadu_si512(p + i);
      nans |= _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, magnitude), inf);
      const __m512i flip = _mm512_and_si512(_mm512_srai_epi32(b, 31), magnitude);
      vbest = _mm512_max_epi32(vbest, _mm512_xor_si512(b, flip));
    }
    best = _mm512_reduce_max_epi32(vbest);
    nan = nans != 0;
  }
#endif
  for (; i < n; ++i) {
    const uint32_t b = bits_at(p, i);
    nan = nan || is_nan(b);
    best = std::max(best, key_of(b));
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (!nan) {
      const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
      const __m512i target = _mm512_set1_epi32(best);
      for (; j + 16 <= n; j += 16) {
        const __m512i b = _mm512_loadu_si512(p + j);
        const __m512i flip = _mm512_and_si512(_mm512_srai_epi32(b, 31), magnitude);
        const __mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_xor_si512(b, flip), target);
        if (hit) return j + __builtin_ctz(hit);
      }
    }
  }
#endif
  for (; j < n; ++j) {
    const uint32_t b = bits_at(p, j);
    if (nan ? is_nan(b) : key_of(b) == best) return j;
  }
  return 0;
}
}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "x must have at least one column");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  auto* o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = bf16 ? argmax_row(x.data_ptr<c10::BFloat16>() + r * stride, n)
                  : argmax_row(x.data_ptr<float>() + r * stride, n);
  });
  return out;
}
