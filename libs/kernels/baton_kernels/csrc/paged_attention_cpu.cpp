// Paged attention on CPU, reading K and V in place from the paged cache through the block
// tables (no gather copy). Each query row is a decode token, which attends to its whole
// sequence, or a prompt token, which attends to its request's tokens up to its own position
// (`Rows`); with a sliding window, to the last `window` of those only, which the row then reads
// alone (a contiguous range of positions: no mask). Each task is one (row, KV head) pair: it
// scores the GQA group's query heads against that head's rows and accumulates in float32. A
// softcap bends the scores in a pass of its own before the softmax, taken only when set, so
// that attention without one runs the same code as before it existed. Tasks run on torch's
// intra-op thread pool (at::parallel_for). The reference is
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
// constant lets the group's accumulators stay in registers.
template <typename scalar_t, int64_t D, int64_t GT>
void kernel(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
            const Rows& rows, float scale, float softcap, torch::Tensor& out) {
  const int64_t R = rows.count, H = query.size(1), KVH = kc.size(2), BS = kc.size(1);
  const int64_t G = GT ? GT : H / KVH;
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = kc.data_ptr<scalar_t>();
  const auto* v = vc.data_ptr<scalar_t>();
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
            prefetch_block(k + nxt * ks0 + h * ks2, ks1, BS, D * sizeof(scalar_t));
            prefetch_block(v + nxt * vs0 + h * vs2, vs1, BS, D * sizeof(scalar_t));
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
        for (int64_t g = 0; g < G; ++g)
          store_row(acc[g], o + rows.at(r) * os0 + (h * G + g) * os1, D);
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

// bf16 with AVX512-BF16 (the same task split and results, up to float evaluation order, as
// `kernel`): q.k as VDPBF16PS on the bf16 rows themselves (no conversion of K), 16 tokens at a
// time, whose 16-lane partial sums one reduction tree turns into 16 scores; p.v in float32.
// Block table lookups happen once per block (row addresses without a division per token, ~10%
// of the kernel's time in cache); K rows are prefetched one and two chunks ahead.
template <int64_t D, int64_t GT>
void kernel_bf16(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
                 const Rows& rows, float scale, float softcap, torch::Tensor& out) {
  constexpr int64_t QV = D / 32;  // zmm of bf16 per row
  constexpr int64_t DV = D / 16;  // zmm of float32 per row
  const int64_t R = rows.count, H = query.size(1), KVH = kc.size(2), BS = kc.size(1);
  const int64_t G = GT ? GT : H / KVH;
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* k = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* v = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* ln = rows.len;
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  // Prefetch one head's row into L1 (to_l1) or L2.
  auto prefetch_row = [](const uint16_t* row_ptr, bool to_l1) {
    const char* p = reinterpret_cast<const char*>(row_ptr);
    for (int64_t off = 0; off < D * 2; off += 64) {
      if (to_l1) _mm_prefetch(p + off, _MM_HINT_T0);
      else _mm_prefetch(p + off, _MM_HINT_T1);
    }
  };
  auto prefetch_rows = [&](const uint16_t* const* rows, int64_t n, bool to_l1) {
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
    std::vector<const uint16_t*> krows, vrows;
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
        const uint16_t* kb = k + blk * ks0 + off * ks1 + h * ks2;
        const uint16_t* vb = v + blk * vs0 + off * vs1 + h * vs2;
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
          const uint16_t* kb = k + rows.table(r2)[t / BS] * ks0 + off * ks1 + h2 * ks2;
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
                const __m512bh kj = (__m512bh)_mm512_loadu_si512(krows[t0 + i] + j * 32);
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
        const uint16_t* vrow = vrows[t];
        __m512 vf[DV];
        for (int64_t j = 0; j < DV; ++j) vf[j] = bf16_to_f32(vrow + j * 16);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * LP + t]);
          for (int64_t j = 0; j < DV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vf[j], acc[g][j]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        uint16_t* orow = o + rows.at(r) * os0 + (h * G + g) * os1;
        for (int64_t j = 0; j < DV; ++j) {
          const __m256i packed = (__m256i)_mm512_cvtneps_pbh(acc[g][j]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + j * 16), packed);
        }
      }
    }
  });
}
#endif  // __AVX512BF16__

// The group sizes of common models (SmolLM2 3, Llama-3 4, Qwen2.5 7, ...) as constants.
template <typename scalar_t, int64_t D>
void dispatch_group(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
                    const Rows& rows, float scale, float softcap, torch::Tensor& out) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (query.size(1) / kc.size(2)) {
      case 1: return kernel_bf16<D, 1>(query, kc, vc, rows, scale, softcap, out);
      case 2: return kernel_bf16<D, 2>(query, kc, vc, rows, scale, softcap, out);
      case 3: return kernel_bf16<D, 3>(query, kc, vc, rows, scale, softcap, out);
      case 4: return kernel_bf16<D, 4>(query, kc, vc, rows, scale, softcap, out);
      case 7: return kernel_bf16<D, 7>(query, kc, vc, rows, scale, softcap, out);
      case 8: return kernel_bf16<D, 8>(query, kc, vc, rows, scale, softcap, out);
      default: return kernel_bf16<D, 0>(query, kc, vc, rows, scale, softcap, out);
    }
  }
#endif
  switch (query.size(1) / kc.size(2)) {
    case 1: return kernel<scalar_t, D, 1>(query, kc, vc, rows, scale, softcap, out);
    case 2: return kernel<scalar_t, D, 2>(query, kc, vc, rows, scale, softcap, out);
    case 3: return kernel<scalar_t, D, 3>(query, kc, vc, rows, scale, softcap, out);
    case 4: return kernel<scalar_t, D, 4>(query, kc, vc, rows, scale, softcap, out);
    case 7: return kernel<scalar_t, D, 7>(query, kc, vc, rows, scale, softcap, out);
    case 8: return kernel<scalar_t, D, 8>(query, kc, vc, rows, scale, softcap, out);
    default: return kernel<scalar_t, D, 0>(query, kc, vc, rows, scale, softcap, out);
  }
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
  TORCH_CHECK(query.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type());
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
void attend(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
            const Rows& rows, float s, float cap, torch::Tensor& out) {
  // (256: Gemma 2 and 3's heads but Gemma 3 27B's)
  const int64_t d = query.size(2);
  if (query.scalar_type() == torch::kBFloat16) {
    if (d == 64) dispatch_group<c10::BFloat16, 64>(query, kc, vc, rows, s, cap, out);
    else if (d == 128) dispatch_group<c10::BFloat16, 128>(query, kc, vc, rows, s, cap, out);
    else dispatch_group<c10::BFloat16, 256>(query, kc, vc, rows, s, cap, out);
  } else {
    if (d == 64) dispatch_group<float, 64>(query, kc, vc, rows, s, cap, out);
    else if (d == 128) dispatch_group<float, 128>(query, kc, vc, rows, s, cap, out);
    else dispatch_group<float, 256>(query, kc, vc, rows, s, cap, out);
  }
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
                                     int64_t window, double softcap) {
  check_options(window, softcap);
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
  attend(query, kc, vc, rows, static_cast<float>(scale), static_cast<float>(softcap), out);
  return out;
}

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                              torch::Tensor tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale, int64_t window,
                              double softcap) {
  check_options(window, softcap);
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
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
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
    prefill_attention(query, kc, vc, tab, t.size(1), chunks, s, window, cap, out);
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
    attend(query, kc, vc, rest_rows, s, cap, out);
  }
  return out;
}

// Writes each new token's K and V rows into the paged cache at (slot_block, slot_offset): one
// row copy each, where the reference's two index_put calls cost ~16 us apiece in a decode step.
// The reference is baton_kernels.attention.torch_backend.write_kv_cache.
void write_kv_cache_(torch::Tensor key, torch::Tensor value, torch::Tensor kv,
                     torch::Tensor slot_block, torch::Tensor slot_offset) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && kv.dim() == 5, "bad ranks");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value differ in shape");
  TORCH_CHECK(kv.size(1) == 2 && kv.size(3) == key.size(1) && kv.size(4) == key.size(2),
              "the cache's heads or head size differ from the new rows'");
  TORCH_CHECK(key.scalar_type() == kv.scalar_type() && value.scalar_type() == kv.scalar_type(),
              "the new rows' dtype differs from the cache's");
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
  const int64_t ks0 = key.stride(0) * es, vs0 = value.stride(0) * es;
  const int64_t c0 = kv.stride(0) * es, c1 = kv.stride(1) * es, c2 = kv.stride(2) * es;
  for (int64_t t = 0; t < T; ++t) {
    char* dst = cp + sb[t] * c0 + so[t] * c2;
    std::memcpy(dst, kp + t * ks0, row_bytes);
    std::memcpy(dst + c1, vp + t * vs0, row_bytes);
  }
}
