// bf16 linear layer with AVX512-BF16: y = x W^T + b, for the CPU's decode and prompt steps.
//
// oneDNN reaches ~400 GFLOP/s on this 2-core AVX-512 CPU for prompt-sized GEMMs but only about
// half the memory bandwidth at 1 row and half the arithmetic at 16 rows, where a decode step
// spends most of its time. Here the weight is packed once into blocks of 16 output columns,
// [ceil(N/16), ceil(K/2), 16, 2] (baton_kernels.cpu_linear.pack_vnni), so each 64-byte load holds
// two K values of 16 columns and one VDPBF16PS multiplies it with a broadcast pair of x and adds
// into 16 float32 accumulators. A tile is MB rows x NB blocks (MB * NB accumulators + NB weight
// registers + 1 <= 32 zmm) over all of K. Each thread owns a contiguous range of column blocks
// and streams its part of the weight from memory once: up to 12 rows run as one tile (one pass
// over the weight), more as tiles of 8 rows x 3 blocks that read it from L2, each of them
// prefetching the next column tile into L2 meanwhile so that the memory stream overlaps their
// arithmetic (the first tile's prefetches fetch it, the later ones' find it there).
//
// Products of bf16 values are exact in float32 and the sums are float32, as in oneDNN; only the
// order of the additions differs. The output is rounded to bf16 (round to nearest even), or
// kept in float32 on request (the LM head: logits closer than a bf16 step apart stay apart).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {
constexpr int kBlock = 16;  // output columns per packed block (one zmm of float32)
constexpr int kMaxRows = 12;
// The most rows a tile of NB blocks may have: MB * NB accumulators + NB weight registers + 1.
constexpr int kRowLimit[4] = {12, 12, 8, 6};
constexpr int kMaxBlocks = 4;
// Rows of the tiles used when x has more than kRowLimit[1] rows, and their blocks.
constexpr int kTileRows = 8;
constexpr int kTileBlocks = 3;
// How far one tile alone prefetches ahead of its weight loads: 64 pairs of a block (4 KiB).
constexpr int64_t kAheadPairs = 64;
constexpr int64_t kPanelRows = 128;

// Rows [0, MB) of x times blocks [0, NB) of the packed weight; `ahead`: elements past each
// weight load to prefetch into L2 (0: none).
template <int MB, int NB>
void micro_kernel(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kp, int64_t k,
                  int64_t ahead, const uint16_t* bias, void* y, bool f32_out, int64_t ldy,
                  int64_t n_valid) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;  // pairs whose both x values exist
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* wj = w + (j * kp + p) * 2 * kBlock;
      b[j] = (__m512bh)_mm512_loadu_si512(wj);
      if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(wj + ahead), _MM_HINT_T1);
    }
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  if (k & 1) {  // odd K: the last pair's second x value is zero (its weight is padding)
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j)
      b[j] = (__m512bh)_mm512_loadu_si512(w + (j * kp + pairs) * 2 * kBlock);
    for (int i = 0; i < MB; ++i) {
      const int32_t pair = x[i * ldx + 2 * pairs];
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t cols = std::min<int64_t>(kBlock, n_valid - j * kBlock);
    if (cols <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    __m512 bj = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + j * kBlock);
      bj = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 sum = _mm512_add_ps(acc[i][j], bj);
      if (f32_out) {
        _mm512_mask_storeu_ps(static_cast<float*>(y) + i * ldy + j * kBlock, mask, sum);
      } else {
        const __m256bh out = _mm512_cvtneps_pbh(sum);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i * ldy + j * kBlock, mask,
                                 (__m256i)out);
      }
    }
  }
}

using Kernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                        const uint16_t*, void*, bool, int64_t, int64_t);

template <int NB, int... MBs>
constexpr std::array<Kernel, kMaxRows> row_entries(std::integer_sequence<int, MBs...>) {
  return {(MBs + 1 <= kRowLimit[NB - 1] ? &micro_kernel<MBs + 1, NB> : nullptr)...};
}

// kTable[nb - 1][mb - 1]; null where the tile would not fit in the 32 vector registers.
const std::array<std::array<Kernel, kMaxRows>, kMaxBlocks> kTable = {
    row_entries<1>(std::make_integer_sequence<int, kMaxRows>{}),
    row_entries<2>(std::make_integer_sequence<int, kMaxRows>{}),
    row_entries<3>(std::make_integer_sequence<int, kMaxRows>{}),
    row_entries<4>(std::make_integer_sequence<int, kMaxRows>{}),
};
}  // namespace

bool bf16_gemm_available() { return true; }

torch::Tensor linear_bf16_vnni(torch::Tensor x, torch::Tensor packed,
                               c10::optional<torch::Tensor> bias, int64_t n, bool out_float32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kBlock && packed.size(3) == 2,
              "packed weight must be contiguous [ceil(N/16), ceil(K/2), 16, 2] bfloat16");
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1), nblocks = packed.size(0);
  TORCH_CHECK(kp == (k + 1) / 2, "x has K=", k, " but the packed weight ", 2 * kp);
  TORCH_CHECK(n > 0 && (n + kBlock - 1) / kBlock == nblocks, "N=", n, " does not match ",
              nblocks, " packed blocks");
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kBFloat16,
                "bias must be [N] bfloat16");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto y = torch::empty({m, n}, x.options().dtype(out_float32 ? torch::kFloat : torch::kBFloat16));
  if (m == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t out_size = y.element_size();
  const int64_t ldx = x.stride(0), block_elems = kp * 2 * kBlock;
  // Up to 12 rows: one tile with as many blocks as registers allow. More: tiles of up to 8 rows
  // (as even as possible) x 3 blocks.
  int64_t tile_rows = kTileRows, tile_blocks = kTileBlocks;
  if (m <= kRowLimit[1]) {
    tile_rows = m;
    tile_blocks = kMaxBlocks;
    while (kRowLimit[tile_blocks - 1] < m) --tile_blocks;
  }
  const int64_t row_tiles = (m + tile_rows - 1) / tile_rows;
  // One tile streams its weight from memory with a prefetch 64 pairs ahead; several read it
  // from L2 and prefetch the next column tile. (Letting the first tile prefetch too, rather
  // than only the later ones, took 16 rows from 14.2 to 13.3 ms and 13 rows from 12.6 to 11.9
  // per step's linear layers: the stream starts a tile earlier.)
  const int64_t ahead = row_tiles == 1 ? kAheadPairs * 2 * kBlock : tile_blocks * block_elems;
  // Each thread takes a contiguous range of column blocks.
  at::parallel_for(0, nblocks, tile_blocks, [&](int64_t begin, int64_t end) {
    // Many rows: a panel of kPanelRows rows of x at a time, so the x rows a tile broadcasts from
    // stay in L2 across the thread's column tiles.
    for (int64_t panel = 0; panel < m; panel += kPanelRows) {
      const int64_t panel_end = std::min(m, panel + kPanelRows);
      const int64_t tiles = (panel_end - panel + tile_rows - 1) / tile_rows;
      for (int64_t b0 = begin; b0 < end; b0 += tile_blocks) {
        const int nb = static_cast<int>(std::min<int64_t>(tile_blocks, end - b0));
        const int64_t col0 = b0 * kBlock;
        for (int64_t t = 0, r0 = panel; t < tiles; ++t) {
          const int64_t r1 = panel + (t + 1) * (panel_end - panel) / tiles;
          kTable[nb - 1][r1 - r0 - 1](xp + r0 * ldx, ldx, wp + b0 * block_elems, kp, k,
                                      ahead,
                                      bp ? bp + col0 : nullptr,
                                      yp + (r0 * n + col0) * out_size, out_float32, n, n - col0);
          r0 = r1;
        }
      }
    }
  });
  return y;
}

#else  // no AVX512-BF16 on the CPU this was built for

bool bf16_gemm_available() { return false; }

torch::Tensor linear_bf16_vnni(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                               int64_t, bool) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16; use the oneDNN path");
}

#endif
