// Paged attention on CPU, reading K and V in place from the paged cache through the block
// tables (no gather copy). Each query row is a decode token, which attends to its whole
// sequence, or a prompt token, which attends to its request's tokens up to its own position
// (`Rows`); with a sliding window, to the last `window` of those only, which the row then reads
// alone (a contiguous range of positions: no mask). Each task is one (row, KV head) pair: it
// scores the GQA group's query heads against that head's rows and accumulates in float32. A
// softcap bends the scores in a pass of its own before the softmax, taken only when set, so
// that attention without one runs the same code as before it existed. Tasks run on torch's
// intra-op thread pool (at::parallel_for). The cache is of the query's dtype or an 8-bit float
// (fp8_kv.h: rows widened exactly as they are read, K's scale in the scores' scale, V's on the
// output; writes saturate and round as torch's cast). The reference is
// baton_kernels.attention.torch_backend (gather + SDPA); tests compare the two.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "fp8_kv.h"
#include "vec_math.h"

namespace {
// Which requests' block table each query row reads and which tokens it attends to: a decode
// row attends to its whole sequence, the row of a prompt token at position p to tokens [0, p];
// with a sliding window of W, to tokens [max(0, len - W), len) of those.
struct Rows {
  const int64_t* tables;  // [requests, mb] block ids
  int64_t mb;
  int64_t count;         // rows to compute
  const int64_t* req;    // [count] the request of each row
  const int64_t* len;    // [count] its tokens end here (exclusive): 1 + its position
  const int64_t* row;    // [count] its row of the query and the output (null: 0, 1, ...)
  const int64_t* first;  // [count] its first token, the window's start (null: 0, no window)
  const int64_t* table(int64_t r) const { return tables + req[r] * mb; }
  int64_t at(int64_t r) const { return row ? row[r] : r; }
  int64_t from(int64_t r) const { return first ? first[r] : 0; }
};

// The first token a row ending at `len` sees through a window of `window` tokens (0: off).
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Converts a row of `dim` values to float32.
inline void load_row(const float* src, float* dst, int64_t dim) {
  std::memcpy(dst, src, dim * sizeof(float));
}
inline void load_row(const c10::BFloat16* src, float* dst, int64_t dim) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < dim; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}
template <typename T, std::enable_if_t<kIsFp8<T>, int> = 0>
inline void load_row(const T* src, float* dst, int64_t dim) {
  fp8_row_to_f32(src, dst, dim);
}
inline void store_row(const float* src, float* dst, int64_t dim) { std::memcpy(dst, src, dim * 4); }
inline void store_row(const float* src, c10::BFloat16* dst, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) dst[i] = c10::BFloat16(src[i]);
}

// Prefetch the rows of head `h` in the block after `t`'s: the blocks of one layer are a
// block-stride apart in the block-major pool, too far for the hardware prefetcher to follow.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* base, int64_t s1, int64_t bs, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(base);
  for (int64_t i = 0; i < bs; ++i)
    for (int64_t off = 0; off < row_bytes; off += 64)
      __builtin_prefetch(p + i * s1 * sizeof(scalar_t) + off, 0, 1);
}

// Softmax in place of `rows` rows of `len` scores, `stride` floats apart.
inline void softmax_rows_(float* scores, int64_t rows, int64_t stride, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * stride;
    float m = sg[0];
    for (int64_t t = 1; t < len; ++t) m = sg[t] > m ? sg[t] : m;
    float den = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - m);
      den += sg[t];
    }
    const float inv = 1.f / den;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

// The softcap in place over `rows` rows of `len` scores, `stride` floats apart: s becomes
// cap * tanh(s / cap). Vectorised: it runs on every score of a capped layer, and std::tanh per
// score costs as much as the dot products of a 64-dimension head.
inline void cap_rows_(float* scores, int64_t rows, int64_t stride, int64_t len, float cap) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * stride;
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.f / cap);
    for (; t < len; t += 16) {
      const __mmask16 m = len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - t)) - 1u);
      const __m512 x = _mm512_maskz_loadu_ps(m, sg + t);
      _mm512_mask_storeu_ps(sg + t, m, _mm512_mul_ps(c, vtanh(_mm512_mul_ps(x, inv))));
    }
#endif
    for (; t < len; ++t) sg[t] = cap * std::tanh(sg[t] / cap);
  }
}

// GT: the query heads per KV head when known at compile time (0: read from the shapes); a
// constant lets the group's accumulators stay in registers. cache_t: the cache's type, the
// query's or an 8-bit float; `scale` includes K's scale, `v_scale` multiplies the output.
template <typename scalar_t, typename cache_t, int64_t D, int64_t GT>
void kernel(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
            const Rows& rows, float scale, float softcap, float v_scale, torch::Tensor& out) {
  const int64_t R = rows.count, H = query.size(1), KVH = kc.size(2), BS = kc.size(1);
  const int64_t G = GT ? GT : H / KVH;
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = static_cast<const cache_t*>(kc.data_ptr());
  const auto* v = static_cast<const cache_t*>(vc.data_ptr());
  auto* o = out.data_ptr<scalar_t>();
  const int64_t* ln = rows.len;
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [G, L]: scores, then probabilities
    alignas(64) float qf[16][D];
    alignas(64) float acc[16][D];
    alignas(64) float row[D];
    for (int64_t task = begin; task < end; ++task) {
      {
        const int64_t r = task / KVH, h = task % KVH;
        const int64_t t_lo = rows.from(r), t_hi = ln[r], L = t_hi - t_lo;  // tokens [t_lo, t_hi)
        scores.resize(static_cast<size_t>(G * L));
        for (int64_t g = 0; g < G; ++g) {
          load_row(q + rows.at(r) * qs0 + (h * G + g) * qs1, qf[g], D);
          for (int64_t d = 0; d < D; ++d) { qf[g][d] *= scale; acc[g][d] = 0.f; }
        }
        const int64_t* tab = rows.table(r);
        const int64_t nb = (t_hi + BS - 1) / BS;
        for (int64_t t = t_lo; t < t_hi; ++t) {
          const int64_t b = tab[t / BS];
          if (t % BS == 0 && t / BS + 1 < nb) {
            const int64_t nxt = tab[t / BS + 1];
            prefetch_block(k + nxt * ks0 + h * ks2, ks1, BS, D * sizeof(cache_t));
            prefetch_block(v + nxt * vs0 + h * vs2, vs1, BS, D * sizeof(cache_t));
          }
          load_row(k + b * ks0 + (t % BS) * ks1 + h * ks2, row, D);
          for (int64_t g = 0; g < G; ++g) {
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qf[g][d] * row[d];
            scores[g * L + t - t_lo] = s;
          }
        }
        if (softcap > 0.f) cap_rows_(scores.data(), G, L, L, softcap);
        softmax_rows_(scores.data(), G, L, L);
        for (int64_t t = t_lo; t < t_hi; ++t) {
          const int64_t b = tab[t / BS];
          load_row(v + b * vs0 + (t % BS) * vs1 + h * vs2, row, D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + t - t_lo];
            for (int64_t d = 0; d < D; ++d) acc[g][d] += p * row[d];
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t d = 0; d < D; ++d) acc[g][d] *= v_scale;
          store_row(acc[g], o + rows.at(r) * os0 + (h * G + g) * os1, D);
        }
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 16 vectors of 16 partial sums -> one vector whose lane t is the sum of v[t]'s lanes.
inline __m512 reduce16(__m512 v[16]) {
  __m512 s[8];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 w[2];
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// 16 bf16 values -> float32 (exact: a shift into the high half).
inline __m512 bf16_to_f32(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Reads 32 values of a cache of cache_t as bf16 or float32: a bf16 cache's as they are, an 8-bit
// one's widened (exactly; Fp8ToBf16).
template <typename cache_t>
struct CacheReader {
  using elem_t = std::conditional_t<kIsFp8<cache_t>, uint8_t, uint16_t>;
  std::conditional_t<kIsFp8<cache_t>, Fp8ToBf16<cache_t>, char> widen{};
  __m512i bf16x32(const elem_t* p) const {
    if constexpr (kIsFp8<cache_t>) return widen(p);
    else return _mm512_loadu_si512(p);
  }
  void f32x32(const elem_t* p, __m512* out) const {
    if constexpr (kIsFp8<cache_t>) {
      const __m512i w = widen(p);
      out[0] = bf16_low_f32(w);
      out[1] = bf16_high_f32(w);
    } else {
      out[0] = bf16_to_f32(p);
      out[1] = bf16_to_f32(p + 16);
    }
  }
};

// bf16 with AVX512-BF16 (the same task split and results, up to float evaluation order, as
// `kernel`): q.k as VDPBF16PS on the bf16 rows themselves (no conversion of K; an 8-bit
// cache's rows widened to bf16 in registers), 16 tokens at a time, whose 16-lane partial sums
// one reduction tree turns into 16 scores; p.v in float32. Block table lookups happen once per
// block (row addresses without a division per token, ~10% of the kernel's time in cache); K
// rows are prefetched one and two chunks ahead. cache_t: c10::BFloat16 or an 8-bit float.
template <typename cache_t, int64_t D, int64_t GT>
void kernel_bf16(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
                 const Rows& rows, float scale, float softcap, float v_scale,
                 torch::Tensor& out) {
  using elem_t = typename CacheReader<cache_t>::elem_t;
  constexpr int64_t QV = D / 32;  // zmm of bf16 per row
  constexpr int64_t DV = D / 16;  // zmm of float32 per row
  const int64_t R = rows.count, H = query.size(1), KVH = kc.size(2), BS = kc.size(1);
  const int64_t G = GT ? GT : H / KVH;
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* k = reinterpret_cast<const elem_t*>(kc.data_ptr());
  const auto* v = reinterpret_cast<const elem_t*>(vc.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* ln = rows.len;
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  // Prefetch one head's row into L1 (to_l1) or L2.
  auto prefetch_row = [](const elem_t* row_ptr, bool to_l1) {
    const char* p = reinterpret_cast<const char*>(row_ptr);
    for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(elem_t)); off += 64) {
      if (to_l1) _mm_prefetch(p + off, _MM_HINT_T0);
      else _mm_prefetch(p + off, _MM_HINT_T1);
    }
  };
  auto prefetch_rows = [&](const elem_t* const* rows, int64_t n, bool to_l1) {
    for (int64_t i = 0; i < n; ++i) prefetch_row(rows[i], to_l1);
  };
  // Tasks are (request, KV head) pairs; threads split them by context length, not by count:
  // a thread takes the tasks whose first token falls in its range of all the tasks' tokens.
  std::vector<int64_t> start(static_cast<size_t>(R * KVH + 1), 0);
  for (int64_t task = 0; task < R * KVH; ++task)
    start[task + 1] = start[task] + std::max<int64_t>(ln[task / KVH] - rows.from(task / KVH), 1);
  at::parallel_for(0, start[R * KVH], 1, [&](int64_t lo, int64_t hi) {
    const int64_t begin = std::lower_bound(start.begin(), start.end() - 1, lo) - start.begin();
    const int64_t end = std::lower_bound(start.begin(), start.end() - 1, hi) - start.begin();
    std::vector<float> scores;  // [G, L rounded up to 16]
    std::vector<const elem_t*> krows, vrows;
    const CacheReader<cache_t> cache;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / KVH, h = task % KVH;
      const int64_t t_lo = rows.from(r), L = ln[r] - t_lo, LP = (L + 15) / 16 * 16;
      scores.resize(static_cast<size_t>(G * LP));
      krows.resize(static_cast<size_t>(L));
      vrows.resize(static_cast<size_t>(L));
      const int64_t* tab = rows.table(r);
      // Block by block from the first token (a window may start inside a block): no division
      // per token.
      for (int64_t t = t_lo; t < ln[r];) {
        const int64_t off = t % BS, n = std::min(BS - off, ln[r] - t);
        const int64_t blk = tab[t / BS];
        const elem_t* kb = k + blk * ks0 + off * ks1 + h * ks2;
        const elem_t* vb = v + blk * vs0 + off * vs1 + h * vs2;
        for (int64_t i = 0; i < n; ++i) {
          krows[t - t_lo + i] = kb + i * ks1;
          vrows[t - t_lo + i] = vb + i * vs1;
        }
        t += n;
      }
      prefetch_rows(krows.data(), std::min<int64_t>(L, 32), true);
      if (task + 1 < end) {  // the next task's first K rows, into L2, so it starts warm
        const int64_t r2 = (task + 1) / KVH, h2 = (task + 1) % KVH;
        const int64_t hi2 = std::min<int64_t>(ln[r2], rows.from(r2) + 32);
        for (int64_t t = rows.from(r2); t < hi2;) {
          const int64_t off = t % BS, n = std::min(BS - off, hi2 - t);
          const elem_t* kb = k + rows.table(r2)[t / BS] * ks0 + off * ks1 + h2 * ks2;
          for (int64_t i = 0; i < n; ++i) prefetch_row(kb + i * ks1, false);
          t += n;
        }
      }
      __m512bh qv[16][QV];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < QV; ++i)
          qv[g][i] = (__m512bh)_mm512_loadu_si512(q + rows.at(r) * qs0 + (h * G + g) * qs1 +
                                                  i * 32);
      // QK: 16 tokens at a time, each token's dot products as 16 partial sums, reduced together.
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        // K rows of the next chunk into L1 and of the one after into L2; this chunk's V rows
        // (read after the softmax) into L2.
        for (int64_t ahead = 1; ahead <= 2; ++ahead) {
          const int64_t a0 = t0 + 16 * ahead;
          if (a0 < L) prefetch_rows(krows.data() + a0, std::min<int64_t>(16, L - a0), ahead == 1);
        }
        prefetch_rows(vrows.data() + t0, n, false);
        for (int64_t g = 0; g < G; ++g) {
          __m512 part[16];
          for (int64_t i = 0; i < 16; ++i) {
            if (i < n) {
              __m512 a = _mm512_setzero_ps();
              for (int64_t j = 0; j < QV; ++j) {
                const __m512bh kj = (__m512bh)cache.bf16x32(krows[t0 + i] + j * 32);
                a = _mm512_dpbf16_ps(a, qv[g][j], kj);
              }
              part[i] = a;
            } else {
              part[i] = _mm512_setzero_ps();
            }
          }
          const __m512 sums = reduce16(part);
          _mm512_storeu_ps(scores.data() + g * LP + t0, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
        }
      }
      if (softcap > 0.f) cap_rows_(scores.data(), G, LP, L, softcap);
      softmax_rows_(scores.data(), G, LP, L);
      __m512 acc[16][DV];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < DV; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const elem_t* vrow = vrows[t];
        __m512 vf[DV];
        for (int64_t j = 0; j < DV; j += 2) cache.f32x32(vrow + j * 16, vf + j);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * LP + t]);
          for (int64_t j = 0; j < DV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vf[j], acc[g][j]);
        }
      }
      const __m512 vs = _mm512_set1_ps(v_scale);
      for (int64_t g = 0; g < G; ++g) {
        uint16_t* orow = o + rows.at(r) * os0 + (h * G + g) * os1;
        for (int64_t j = 0; j < DV; ++j) {
          const __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][j], vs));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + j * 16), packed);
        }
      }
    }
  });
}
#endif  // __AVX512BF16__

// Calls f(std::integral_constant<int64_t, G>{}) with the GQA group size as a constant where it
// is a common model's (SmolLM2 3, Llama-3 4, Qwen2.5 7, ...), else G = 0 (read from the shapes).
template <typename F>
void with_group(int64_t group, F&& f) {
  switch (group) {
    case 1: return f(std::integral_constant<int64_t, 1>{});
    case 2: return f(std::integral_constant<int64_t, 2>{});
    case 3: return f(std::integral_constant<int64_t, 3>{});
    case 4: return f(std::integral_constant<int64_t, 4>{});
    case 7: return f(std::integral_constant<int64_t, 7>{});
    case 8: return f(std::integral_constant<int64_t, 8>{});
    default: return f(std::integral_constant<int64_t, 0>{});
  }
}

// bf16 queries run the AVX512-BF16 kernel where the CPU has it, the others the plain one.
template <typename scalar_t, typename cache_t, int64_t D>
void dispatch_group(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
                    const Rows& rows, float scale, float softcap, float v_scale,
                    torch::Tensor& out) {
  with_group(query.size(1) / kc.size(2), [&](auto group) {
    constexpr int64_t G = decltype(group)::value;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      kernel_bf16<cache_t, D, G>(query, kc, vc, rows, scale, softcap, v_scale, out);
    } else
#endif
    {
      kernel<scalar_t, cache_t, D, G>(query, kc, vc, rows, scale, softcap, v_scale, out);
    }
  });
}
}  // namespace

namespace {
// Checks the shapes and that every row's tokens and blocks lie inside the cache.
void check(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
           const torch::Tensor& tables, const Rows& rows) {
  TORCH_CHECK(query.dim() == 3 && kc.dim() == 4 && vc.dim() == 4, "bad ranks");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128 || query.size(2) == 256,
              "head_dim must be 64, 128 or 256");
  TORCH_CHECK(query.size(1) % kc.size(2) == 0 && query.size(1) / kc.size(2) <= 16,
              "query heads must be a multiple (at most 16x) of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && kc.stride(3) == 1 && vc.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() &&
                  (query.scalar_type() == kc.scalar_type() || is_fp8(kc.scalar_type())),
              "the caches must be of the query's dtype or both of an 8-bit float");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 || query.scalar_type() == torch::kFloat,
              "float32 or bfloat16 only");
  // Every block a row reads must be in the cache: the tokens each request's rows reach (from
  // the earliest window start: the blocks before a window are never read, so their entries
  // need not be valid), then those requests' table entries.
  const int64_t bs = kc.size(1), capacity = rows.mb * bs, nblocks = kc.size(0);
  std::vector<int64_t> reach(static_cast<size_t>(tables.size(0)), 0);
  std::vector<int64_t> low(static_cast<size_t>(tables.size(0)), capacity);
  for (int64_t r = 0; r < rows.count; ++r) {
    TORCH_CHECK(rows.len[r] >= 1 && rows.len[r] <= capacity, "row ", r, " attends to ",
                rows.len[r], " tokens; its block table holds ", capacity);
    reach[rows.req[r]] = std::max(reach[rows.req[r]], rows.len[r]);
    low[rows.req[r]] = std::min(low[rows.req[r]], rows.from(r));
  }
  for (size_t i = 0; i < reach.size(); ++i) {
    const int64_t* tab = rows.tables + static_cast<int64_t>(i) * rows.mb;
    for (int64_t b = low[i] / bs; b < (reach[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tab[b] >= 0 && tab[b] < nblocks, "block id ", tab[b], " outside the cache of ",
                  nblocks, " blocks");
  }
}

// The per-row kernel for `rows` into `out`.
// `s` includes K's scale; `v_scale` multiplies the output (both 1 but for an 8-bit cache).
void attend(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
            const Rows& rows, float s, float cap, float v_scale, torch::Tensor& out) {
  // (256: Gemma 2 and 3's heads but Gemma 3 27B's)
  const int64_t d = query.size(2);
  auto by_dim = [&](auto scalar, auto cache) {
    using S = decltype(scalar);
    using C = decltype(cache);
    if (d == 64) dispatch_group<S, C, 64>(query, kc, vc, rows, s, cap, v_scale, out);
    else if (d == 128) dispatch_group<S, C, 128>(query, kc, vc, rows, s, cap, v_scale, out);
    else dispatch_group<S, C, 256>(query, kc, vc, rows, s, cap, v_scale, out);
  };
  if (query.scalar_type() == torch::kBFloat16)
    visit_cache<c10::BFloat16>(kc.scalar_type(), [&](auto c) { by_dim(c10::BFloat16{}, c); });
  else
    visit_cache<float>(kc.scalar_type(), [&](auto c) { by_dim(float{}, c); });
}

// The scores' scale and the output's: K's and V's scales apply to an 8-bit cache only (the
// reference's reading, attention.base.from_cache).
std::pair<float, float> scales(const torch::Tensor& kc, double scale, double k_scale,
                               double v_scale) {
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "the KV cache's scales must be > 0, got ",
              k_scale, " and ", v_scale);
  if (!is_fp8(kc.scalar_type())) return {static_cast<float>(scale), 1.f};
  return {static_cast<float>(scale * k_scale), static_cast<float>(v_scale)};
}

void check_options(int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: off), got ", window);
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: off), got ", softcap);
}

torch::Tensor int64_list(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.device().is_cpu(), what,
              " must be an int64 CPU tensor");
  return t.contiguous();
}

// Prompt chunks of at least this many tokens go to prefill_attention; shorter ones (and
// decodes) to the per-row kernel.
constexpr int64_t kMinPromptTile = 8;
}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                                     torch::Tensor tables, torch::Tensor lens, double scale,
                                     int64_t window, double softcap, double k_scale,
                                     double v_scale) {
  check_options(window, softcap);
  const auto [s, vs] = scales(kc, scale, k_scale, v_scale);
  auto t = int64_list(tables, "tables");
  auto l = int64_list(lens, "seq_lens");
  const int64_t R = query.size(0);
  TORCH_CHECK(t.dim() == 2 && t.size(0) >= R && l.numel() == R,
              "one block table row and one length per query row");
  std::vector<int64_t> req(static_cast<size_t>(R)), first;
  for (int64_t r = 0; r < R; ++r) req[r] = r;
  const int64_t* len = l.data_ptr<int64_t>();
  // A window no shorter than every sequence hides no token: the path without one.
  if (window > 0 && R > 0 && window >= *std::max_element(len, len + R)) window = 0;
  if (window > 0) {  // each row reads the last `window` tokens only
    first.resize(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) first[r] = window_start(len[r], window);
  }
  const Rows rows{t.data_ptr<int64_t>(), t.size(1), R, req.data(), len, nullptr,
                  first.empty() ? nullptr : first.data()};
  check(query, kc, vc, t, rows);
  auto out = torch::empty_like(query);
  attend(query, kc, vc, rows, s, static_cast<float>(softcap), vs, out);
  return out;
}

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                              torch::Tensor tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale, int64_t window,
                              double softcap, double k_scale, double v_scale) {
  check_options(window, softcap);
  const auto [s, vs] = scales(kc, scale, k_scale, v_scale);
  auto t = int64_list(tables, "tables");
  auto sl = int64_list(seq_lens, "seq_lens");
  auto qs = int64_list(query_start_loc, "query_start_loc");
  const int64_t n = sl.numel(), T = query.size(0);
  TORCH_CHECK(t.dim() == 2 && t.size(0) >= n && qs.numel() == n + 1,
              "one block table row and length per request, and requests + 1 query starts");
  const int64_t* seq = sl.data_ptr<int64_t>();
  const int64_t* start = qs.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[n] == T, "query_start_loc must run from 0 to ", T);
  std::vector<int64_t> req(static_cast<size_t>(T)), len(static_cast<size_t>(T));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q_len = start[i + 1] - start[i];
    TORCH_CHECK(q_len >= 0 && seq[i] >= q_len, "request ", i, ": ", q_len,
                " query tokens in a sequence of ", seq[i]);
    for (int64_t j = 0; j < q_len; ++j) {
      req[start[i] + j] = i;
      len[start[i] + j] = seq[i] - q_len + j + 1;  // causal: up to its own position
    }
  }
  // A window no shorter than every sequence hides no token (Mistral's 4,096 over shorter
  // sequences): the path without one, tiles and all.
  if (window > 0 && n > 0 && window >= *std::max_element(seq, seq + n)) window = 0;
  std::vector<int64_t> first;  // each row's window start (none without a window)
  if (window > 0) {
    first.resize(static_cast<size_t>(T));
    for (int64_t r = 0; r < T; ++r) first[r] = window_start(len[r], window);
  }
  const int64_t* tab = t.data_ptr<int64_t>();
  check(query, kc, vc, t,
        Rows{tab, t.size(1), T, req.data(), len.data(), nullptr,
             first.empty() ? nullptr : first.data()});
  auto out = torch::empty_like(query);
  const float cap = static_cast<float>(softcap);
  // Prompt chunks in tiles where the CPU can; the other rows one at a time.
  std::vector<PromptChunk> chunks;
  std::vector<int64_t> rest;
  const bool tiles = prefill_attention_available(query, kc);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q_len = start[i + 1] - start[i];
    if (tiles && q_len >= kMinPromptTile) {
      chunks.push_back({start[i], q_len, seq[i], i});
    } else {
      for (int64_t r = start[i]; r < start[i + 1]; ++r) rest.push_back(r);
    }
  }
  if (!chunks.empty())
    prefill_attention(query, kc, vc, tab, t.size(1), chunks, s, window, cap, vs, out);
  if (!rest.empty()) {
    std::vector<int64_t> rest_req, rest_len, rest_first;
    for (int64_t r : rest) {
      rest_req.push_back(req[r]);
      rest_len.push_back(len[r]);
      if (!first.empty()) rest_first.push_back(first[r]);
    }
    const auto count = static_cast<int64_t>(rest.size());
    const Rows rest_rows{tab, t.size(1), count, rest_req.data(), rest_len.data(), rest.data(),
                         rest_first.empty() ? nullptr : rest_first.data()};
    attend(query, kc, vc, rest_rows, s, cap, vs, out);
  }
  return out;
}

namespace {
// `n` values into an 8-bit cache: divided by the scale (times `inv`), saturated, rounded.
template <typename src_t, typename cache_t>
void store_fp8(const src_t* src, cache_t* dst, int64_t n, float inv) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_fp8<cache_t>(static_cast<float>(src[i]), inv);
}
}  // namespace

// Writes each new token's K and V rows into the paged cache at (slot_block, slot_offset): one
// row copy each, where the reference's two index_put calls cost ~16 us apiece in a decode step;
// into an 8-bit cache, each value divided by its scale (k_scale, v_scale), saturated at the
// format's largest value and rounded to nearest even. The reference is
// baton_kernels.attention.torch_backend.write_kv_cache.
void write_kv_cache_(torch::Tensor key, torch::Tensor value, torch::Tensor kv,
                     torch::Tensor slot_block, torch::Tensor slot_offset, double k_scale,
                     double v_scale) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && kv.dim() == 5, "bad ranks");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value differ in shape");
  TORCH_CHECK(kv.size(1) == 2 && kv.size(3) == key.size(1) && kv.size(4) == key.size(2),
              "the cache's heads or head size differ from the new rows'");
  const bool fp8 = is_fp8(kv.scalar_type());
  const auto src = key.scalar_type();
  TORCH_CHECK(value.scalar_type() == src &&
                  (src == kv.scalar_type() ||
                   (fp8 && (src == torch::kFloat || src == torch::kBFloat16))),
              "the new rows' dtype differs from the cache's");
  TORCH_CHECK(!fp8 || (k_scale > 0.0 && v_scale > 0.0), "the KV cache's scales must be > 0, got ",
              k_scale, " and ", v_scale);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2) && kv.stride(4) == 1 &&
                  kv.stride(3) == kv.size(4),
              "each token's heads must be contiguous");
  TORCH_CHECK(slot_block.scalar_type() == torch::kInt64 &&
                  slot_offset.scalar_type() == torch::kInt64 &&
                  slot_block.numel() == key.size(0) && slot_offset.numel() == key.size(0),
              "one int64 slot per new token");
  const int64_t T = key.size(0), nblocks = kv.size(0), bs = kv.size(2);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  auto blocks = slot_block.contiguous();
  auto offsets = slot_offset.contiguous();
  const int64_t* sb = blocks.data_ptr<int64_t>();
  const int64_t* so = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sb[t] >= 0 && sb[t] < nblocks && so[t] >= 0 && so[t] < bs, "slot (", sb[t],
                ", ", so[t], ") outside the cache of ", nblocks, " blocks of ", bs);
  const int64_t es = kv.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* cp = static_cast<char*>(kv.data_ptr());
  const int64_t c0 = kv.stride(0) * es, c1 = kv.stride(1) * es, c2 = kv.stride(2) * es;
  if (fp8) {
    const int64_t n = key.size(1) * key.size(2), ses = key.element_size();
    const int64_t ks0 = key.stride(0) * ses, vs0 = value.stride(0) * ses;
    // (the float32 of 1 / scale, as the reference multiplies)
    const float ik = static_cast<float>(1.0 / k_scale), iv = static_cast<float>(1.0 / v_scale);
    auto rows = [&](auto in, auto cache) {
      using S = decltype(in);
      using C = decltype(cache);
      for (int64_t t = 0; t < T; ++t) {
        char* dst = cp + sb[t] * c0 + so[t] * c2;
        store_fp8(reinterpret_cast<const S*>(kp + t * ks0), reinterpret_cast<C*>(dst), n, ik);
        store_fp8(reinterpret_cast<const S*>(vp + t * vs0), reinterpret_cast<C*>(dst + c1), n,
                  iv);
      }
    };
    auto by_src = [&](auto cache) {
      if (src == torch::kBFloat16) rows(c10::BFloat16{}, cache);
      else rows(float{}, cache);
    };
    if (kv.scalar_type() == torch::kFloat8_e4m3fn) by_src(c10::Float8_e4m3fn{});
    else by_src(c10::Float8_e5m2{});
    return;
  }
  const int64_t ks0 = key.stride(0) * es, vs0 = value.stride(0) * es;
  for (int64_t t = 0; t < T; ++t) {
    char* dst = cp + sb[t] * c0 + so[t] * c2;
    std::memcpy(dst, kp + t * ks0, row_bytes);
    std::memcpy(dst + c1, vp + t * vs0, row_bytes);
  }
}
