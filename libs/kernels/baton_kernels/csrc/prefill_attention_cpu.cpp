// Causal attention of prompt chunks on CPU in bf16 with AVX512-BF16, FlashAttention-style: a
// tile of up to 16 query rows (consecutive tokens x the GQA group's heads of one KV head) runs
// over the chunk's keys 64 at a time with an online softmax, so no row's scores are kept
// whole. Both products are VDPBF16PS: q.k against K packed as pairs of head dimensions x 16
// keys (one zmm per pair, scores of 16 keys per row), and p.v with the probabilities rounded
// to bf16 (as FlashAttention does on GPUs) against V packed as pairs of keys x 16 dimensions.
// K and V are read in place from the paged cache and packed once per work unit (a KV head and
// up to kUnitTokens query tokens), which then reuses them for each of its query tiles.
// Accumulation is float32. With a sliding window a unit packs, and a query tile visits, only
// the key tiles from the one holding its first row's window start (every other key tile is
// wholly outside every row's window); each row's mask then drops the keys before its own
// window as well as those past its position. Whether either option is on is a template
// argument: without them, the window is a constant 0 that folds away, and attention compiles to
// the code it was before they existed. An 8-bit cache's rows are widened to bf16 (exactly) as
// they are packed, its K scale is in `scale` and its V scale multiplies the output.
// paged_attention (paged_attention_cpu.cpp)
// sends it the prompt chunks of a batch; the reference is baton_kernels.attention.torch_backend.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "fp8_kv.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"

namespace {
constexpr int64_t kKeys = 16;         // keys per tile: one zmm of float32 scores per row
constexpr int kMaxRows = 16;          // query rows per tile
constexpr int64_t kUnitTokens = 128;  // query tokens per work unit
constexpr float kNoScore = -1e30f;    // the running max before any key (finite: no inf - inf)
constexpr int64_t kStepTiles = 4;     // key tiles per online-softmax update
constexpr int64_t kStepKeys = kStepTiles * kKeys;

// Scores of rows [0, M) against one packed key tile: s[m * 16 + key].
template <int M, int64_t D>
void qk_tile(const int32_t* const* q, const int32_t* kp, float* s) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512bh b = (__m512bh)_mm512_loadu_si512(kp + p * kKeys);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(q[m][p]), b);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(s + m * kKeys, acc[m]);
}

using QkTile = void (*)(const int32_t* const*, const int32_t*, float*);
template <int64_t D, int... Ms>
constexpr std::array<QkTile, kMaxRows> qk_entries(std::integer_sequence<int, Ms...>) {
  return {&qk_tile<Ms + 1, D>...};
}

// Rows [0, MB) of the output (MB x 64 floats from `o`, `ldo` apart), scaled by their `alpha`,
// plus their probabilities `p` (`pairs` bf16 pairs a row, kStepKeys / 2 apart) times as many
// packed pairs of V rows (`v`: 64 dimensions of each pair's row of `ldv` int32).
constexpr int kPvRows = 6;
template <int MB>
void pv_tile(const int32_t* p, int64_t pairs, const float* alpha, const int32_t* v,
             int64_t ldv, float* o, int64_t ldo) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_mul_ps(_mm512_loadu_ps(o + m * ldo + 16 * c), a);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + j * ldv + 16 * c);
    for (int m = 0; m < MB; ++m) {
      const __m512bh pm = (__m512bh)_mm512_set1_epi32(p[m * (kStepKeys / 2) + j]);
      for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], pm, vv[c]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + m * ldo + 16 * c, acc[m][c]);
}

using PvTile = void (*)(const int32_t*, int64_t, const float*, const int32_t*, int64_t, float*,
                        int64_t);
constexpr std::array<PvTile, kPvRows> kPv = {&pv_tile<1>, &pv_tile<2>, &pv_tile<3>,
                                             &pv_tile<4>, &pv_tile<5>, &pv_tile<6>};

struct Unit {
  int64_t chunk, head, t0, t1;  // query tokens [t0, t1) of the chunk, one KV head
};

// The first key a query token at position `pos` sees through a window of `window` (0: off).
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Options: a window or a softcap is on (false: neither, whatever `window` and `softcap` say).
// cache_t: c10::BFloat16 or an 8-bit float.
template <typename cache_t, int64_t D, bool Options>
void run(const torch::Tensor& query, const torch::Tensor& kc, const torch::Tensor& vc,
         const int64_t* tables, int64_t mb, const std::vector<PromptChunk>& chunks, float scale,
         int64_t window_arg, float softcap, float v_scale, torch::Tensor& out) {
  using elem_t = std::conditional_t<kIsFp8<cache_t>, cache_t, uint16_t>;
  const int64_t window = Options ? window_arg : 0;
  const bool cap = Options && softcap > 0.f;
  static const std::array<QkTile, kMaxRows> qk =
      qk_entries<D>(std::make_integer_sequence<int, kMaxRows>{});
  const auto& pv = kPv;
  const int64_t H = query.size(1), KVH = kc.size(2), BS = kc.size(1), G = H / KVH;
  const int64_t QT = std::max<int64_t>(1, kMaxRows / G);  // query tokens per tile
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* k = reinterpret_cast<const elem_t*>(kc.data_ptr());
  const auto* v = reinterpret_cast<const elem_t*>(vc.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);

  // Units, and their cost (query tokens x keys they see) to split them evenly between threads.
  std::vector<Unit> units;
  std::vector<int64_t> start{0};
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t ctx = chunks[c].seq_len - chunks[c].len;
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t t0 = 0; t0 < chunks[c].len; t0 += kUnitTokens) {
        const int64_t t1 = std::min(chunks[c].len, t0 + kUnitTokens);
        units.push_back({static_cast<int64_t>(c), h, t0, t1});
        start.push_back(start.back() + (t1 - t0) * (ctx + t1 - first_key(ctx + t0, window)));
      }
  }
  const int64_t n_units = static_cast<int64_t>(units.size());
  at::parallel_for(0, start.back(), 1, [&](int64_t lo, int64_t hi) {
    const int64_t begin = std::lower_bound(start.begin(), start.end() - 1, lo) - start.begin();
    const int64_t end = std::lower_bound(start.begin(), start.end() - 1, hi) - start.begin();
    std::vector<int32_t> kp, vp;  // packed K tiles [tile][D / 2][16], V pairs [pair][D]
    alignas(64) float s[kStepTiles * kMaxRows * kKeys];  // [tile][row][key]
    alignas(64) float acc[kMaxRows][D];
    alignas(64) uint16_t p16[kMaxRows][kStepKeys];
    alignas(64) float run_max[kMaxRows], run_sum[kMaxRows], tile_max[kMaxRows];
    alignas(64) uint16_t wide[4][D];  // an 8-bit cache's K and V rows of a pair, as bf16
    const int32_t* qrow[kMaxRows];
    for (int64_t u = begin; u < std::min(end, n_units); ++u) {
      const Unit& unit = units[u];
      const PromptChunk& c = chunks[unit.chunk];
      const int64_t h = unit.head, ctx = c.seq_len - c.len;
      const int64_t* tab = tables + c.req * mb;
      // Key tiles [kt0, tiles) hold the keys the unit needs: kt0 = 0 without a window.
      const int64_t kt0 = first_key(ctx + unit.t0, window) / kKeys;
      const int64_t tiles = (ctx + unit.t1 - 1) / kKeys + 1;
      kp.resize(static_cast<size_t>((tiles - kt0) * (D / 2) * kKeys));
      vp.resize(static_cast<size_t>((tiles - kt0) * (kKeys / 2) * D));
      for (int64_t kt = kt0; kt < tiles; ++kt) {
        int32_t* kt_p = kp.data() + (kt - kt0) * (D / 2) * kKeys;
        int32_t* vt_p = vp.data() + (kt - kt0) * (kKeys / 2) * D;
        for (int64_t i = 0; i < kKeys; i += 2) {
          const uint16_t* kr[2];
          const uint16_t* vr[2];
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t t = kt * kKeys + i + j;
            kr[j] = vr[j] = nullptr;
            if (t >= c.seq_len) continue;
            const elem_t* kt_row = k + tab[t / BS] * ks0 + (t % BS) * ks1 + h * ks2;
            const elem_t* vt_row = v + tab[t / BS] * vs0 + (t % BS) * vs1 + h * vs2;
            if constexpr (kIsFp8<cache_t>) {
              fp8_row_to_bf16(kt_row, wide[2 * j], D);
              fp8_row_to_bf16(vt_row, wide[2 * j + 1], D);
              kr[j] = wide[2 * j];
              vr[j] = wide[2 * j + 1];
            } else {
              kr[j] = kt_row;
              vr[j] = vt_row;
            }
          }
          for (int64_t j = 0; j < 2; ++j)
            for (int64_t p = 0; p < D / 2; ++p) {
              int32_t pair = 0;
              if (kr[j] != nullptr) std::memcpy(&pair, kr[j] + 2 * p, 4);
              kt_p[p * kKeys + i + j] = pair;
            }
          int32_t* vpair = vt_p + (i / 2) * D;
          for (int64_t d = 0; d < D; ++d) {
            const uint32_t a = vr[0] != nullptr ? vr[0][d] : 0, b = vr[1] != nullptr ? vr[1][d] : 0;
            vpair[d] = static_cast<int32_t>(a | (b << 16));
          }
        }
      }
      for (int64_t t = unit.t0; t < unit.t1; t += QT) {
        const int64_t nt = std::min(QT, unit.t1 - t);
        const int M = static_cast<int>(nt * G);
        for (int m = 0; m < M; ++m) {
          qrow[m] = reinterpret_cast<const int32_t*>(q + (c.start + t + m / G) * qs0 +
                                                     (h * G + m % G) * qs1);
          run_max[m] = kNoScore;
          run_sum[m] = 0.f;
          std::fill(acc[m], acc[m] + D, 0.f);
        }
        const int64_t last = ctx + t + nt - 1;  // the tile's last position
        // From the key tile of the first row's window start: the tiles before it are before
        // every row's window (0 without a window).
        const int64_t k_first = first_key(ctx + t, window) / kKeys * kKeys;
        for (int64_t k0 = k_first; k0 <= last; k0 += kStepKeys) {
          // Scores of up to kStepTiles key tiles (those holding keys <= last), scaled (and
          // capped) and masked past each row's own position and before its window, and each
          // row's max over them.
          const int64_t nkt = std::min(kStepTiles, last / kKeys + 1 - k0 / kKeys);
          for (int64_t i = 0; i < nkt; ++i)
            qk[M - 1](qrow, kp.data() + (k0 / kKeys + i - kt0) * (D / 2) * kKeys,
                      s + i * kMaxRows * kKeys);
          __mmask16 valid[kMaxRows][kStepTiles];
          for (int m = 0; m < M; ++m) {
            const int64_t n_valid = ctx + t + m / G + 1 - k0;  // keys of this step the row sees
            // and how many of those come before its window
            const int64_t n_before = n_valid - window;
            __m512 mx = _mm512_set1_ps(kNoScore);
            for (int64_t i = 0; i < nkt; ++i) {
              const int64_t n = std::clamp<int64_t>(n_valid - i * kKeys, 0, 16);
              const int64_t nb = window > 0 ? std::clamp<int64_t>(n_before - i * kKeys, 0, 16) : 0;
              valid[m][i] = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << nb) - 1u));
              float* sm = s + (i * kMaxRows + m) * kKeys;
              __m512 sc;
              if (cap) {  // softcap * tanh(scale * qk / softcap)
                const __m512 x =
                    _mm512_mul_ps(_mm512_loadu_ps(sm), _mm512_set1_ps(scale / softcap));
                sc = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), valid[m][i], vtanh(x),
                                        _mm512_set1_ps(softcap));
              } else {
                sc = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), valid[m][i],
                                        _mm512_loadu_ps(sm), _mm512_set1_ps(scale));
              }
              _mm512_storeu_ps(sm, sc);
              mx = _mm512_max_ps(mx, sc);
            }
            tile_max[m] = _mm512_reduce_max_ps(mx);
          }
          // Running maxima, and the factor each row's sum and output shrink by: all rows at
          // once (rows in lanes).
          const __mmask16 rows = static_cast<__mmask16>((1u << M) - 1u);
          const __m512 old_max = _mm512_maskz_loadu_ps(rows, run_max);
          const __m512 new_max = _mm512_max_ps(old_max, _mm512_maskz_loadu_ps(rows, tile_max));
          alignas(64) float alpha[kMaxRows];
          _mm512_storeu_ps(alpha, vexp(_mm512_sub_ps(old_max, new_max)));
          _mm512_mask_storeu_ps(run_max, rows, new_max);
          for (int m = 0; m < M; ++m) {
            const __m512 mm = _mm512_set1_ps(run_max[m]);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < nkt; ++i) {
              const __m512 sc = _mm512_loadu_ps(s + (i * kMaxRows + m) * kKeys);
              const __m512 p = _mm512_maskz_mov_ps(valid[m][i], vexp(_mm512_sub_ps(sc, mm)));
              sum = _mm512_add_ps(sum, p);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16[m] + i * kKeys),
                                  (__m256i)_mm512_cvtneps_pbh(p));
            }
            run_sum[m] = run_sum[m] * alpha[m] + _mm512_reduce_add_ps(sum);
          }
          // p.v: the rows' outputs, rescaled, plus the step's pairs of keys; tiles of up to 6
          // rows x 4 chunks of 16 dimensions, so that each V load serves several rows.
          const int32_t* vt_p = vp.data() + ((k0 - kt0 * kKeys) / 2) * D;
          const auto* p32 = reinterpret_cast<const int32_t*>(p16);
          for (int m0 = 0; m0 < M; m0 += kPvRows) {
            const int mb = std::min(kPvRows, M - m0);
            for (int64_t d0 = 0; d0 < D; d0 += 64)
              pv[mb - 1](p32 + m0 * (kStepKeys / 2), nkt * kKeys / 2, alpha + m0, vt_p + d0, D,
                         &acc[m0][d0], D);
          }
        }
        for (int m = 0; m < M; ++m) {
          uint16_t* orow = o + (c.start + t + m / G) * os0 + (h * G + m % G) * os1;
          const __m512 inv = _mm512_set1_ps(v_scale / run_sum[m]);
          for (int64_t d0 = 0; d0 < D; d0 += 16)
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(orow + d0),
                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc[m] + d0), inv)));
        }
      }
    }
  });
}
}  // namespace

bool prefill_attention_available(const torch::Tensor& query, const torch::Tensor& kc) {
  return query.scalar_type() == torch::kBFloat16 && query.size(1) / kc.size(2) <= kMaxRows;
}

void prefill_attention(const torch::Tensor& query, const torch::Tensor& kc,
                       const torch::Tensor& vc, const int64_t* tables, int64_t mb,
                       const std::vector<PromptChunk>& chunks, float scale, int64_t window,
                       float softcap, float v_scale, torch::Tensor& out) {
  const bool options = window > 0 || softcap > 0.f;
  auto with = [&](auto cache, auto dim) {
    using C = decltype(cache);
    constexpr int64_t D = decltype(dim)::value;
    if (options) run<C, D, true>(query, kc, vc, tables, mb, chunks, scale, window, softcap,
                                 v_scale, out);
    else run<C, D, false>(query, kc, vc, tables, mb, chunks, scale, window, softcap, v_scale,
                          out);
  };
  visit_cache<c10::BFloat16>(kc.scalar_type(), [&](auto cache) {
    if (query.size(2) == 64) with(cache, std::integral_constant<int64_t, 64>{});
    else if (query.size(2) == 128) with(cache, std::integral_constant<int64_t, 128>{});
    else with(cache, std::integral_constant<int64_t, 256>{});
  });
}

#else  // no AVX512-BF16: paged_attention keeps every row on its per-row kernel

bool prefill_attention_available(const torch::Tensor&, const torch::Tensor&) { return false; }

void prefill_attention(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const int64_t*, int64_t, const std::vector<PromptChunk>&, float, int64_t,
                       float, float, torch::Tensor&) {
  TORCH_CHECK(false, "prefill_attention needs AVX512-BF16");
}

#endif
