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
// On CPUs with AMX (Sapphire Rapids and later) the same packed weight feeds the tile unit
// instead where K is a multiple of 32: its layout is a B tile's (16 pairs of K x 16 columns is
// 1 KiB of consecutive rows of 64 bytes), x rows are A tiles of up to 16 rows x 32 K, and one
// TDPBF16PS multiplies them into 16 x 16 float32 sums; a thread runs up to 4 column blocks x
// 16 rows at a time over all of K (`amx_tiles`).
//
// Products of bf16 values are exact in float32 and the sums are float32, as in oneDNN; only the
// order of the additions differs. The output is rounded to bf16 (round to nearest even), or
// kept in float32 on request (the LM head: logits closer than a bf16 step apart stay apart).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define BATON_AMX 1
#endif

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

// Block j's bias (bf16) as float32, its first `mask` columns (zero without a bias).
inline __m512 load_bias(const uint16_t* bias, int64_t j, __mmask16 mask) {
  if (bias == nullptr) return _mm512_setzero_ps();
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + j * kBlock);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// sums + bias into y at element `at`, the first `mask` columns, as bf16 or float32.
inline void store_sums(__m512 sums, __m512 bias, void* y, bool f32_out, int64_t at,
                       __mmask16 mask) {
  const __m512 sum = _mm512_add_ps(sums, bias);
  if (f32_out) {
    _mm512_mask_storeu_ps(static_cast<float*>(y) + at, mask, sum);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + at, mask,
                             (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

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
    const __m512 bj = load_bias(bias, j, mask);
    for (int i = 0; i < MB; ++i) store_sums(acc[i][j], bj, y, f32_out, i * ldy + j * kBlock, mask);
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

#if defined(BATON_AMX)
constexpr int kAmxRows = 16;    // rows of an A and a C tile
constexpr int kAmxK = 32;       // K values of an A tile (16 pairs: a B tile's rows)
constexpr int kAmxBlocks = 4;   // column blocks (C tiles) a thread runs at once

// Linux leaves the tile state off until a process asks for it (once; oneDNN asks too).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C, `rows` x 16 float32; tmm4: A, `rows` x 32 bf16; tmm5-7: B, 16 pairs x 16 x 2 bf16.
// The configuration is per thread: each thread loads it before its tiles.
void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
  }
  _tile_loadconfig(&cfg);
}

// The first `out_rows` rows of a C tile's sums of block j, plus its bias, into y.
inline void store_tile(const float (*sums)[kBlock], int out_rows, const uint16_t* bias, int j,
                       void* y, bool f32_out, int64_t ldy, int64_t n_valid) {
  const int64_t cols = std::min<int64_t>(kBlock, n_valid - j * kBlock);
  if (cols <= 0) return;
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bj = load_bias(bias, j, mask);
  for (int i = 0; i < out_rows; ++i)
    store_sums(_mm512_load_ps(sums[i]), bj, y, f32_out, i * ldy + j * kBlock, mask);
}

// One row tile of x (A, the configured rows, `ldx` apart) times blocks [0, NB) of the packed
// weight over all K (C tiles 0..NB-1, B tiles 5-7 in turn), then the first `out_rows` rows
// with the bias into y: one A load serves up to 4 blocks. (Prompt-sized x ran no faster as
// 2 row tiles x 2 blocks, each A and B load serving two products: 2,048 rows of the default
// model's layers 435 ms against 400, a noisy VM.)
template <int NB>
void amx_tiles(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t block_elems,
               int64_t k, int out_rows, const uint16_t* bias, void* y, bool f32_out,
               int64_t ldy, int64_t n_valid) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t k0 = 0; k0 < k; k0 += kAmxK) {
    _tile_loadd(4, x + k0, ldx * 2);
    const uint16_t* b = w + k0 * kBlock;  // pair k0 / 2 of block 0
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, b + block_elems, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(7, b + 2 * block_elems, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, b + 3 * block_elems, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float sums[kAmxBlocks][kAmxRows][kBlock];
  _tile_stored(0, sums[0], 64);
  if constexpr (NB > 1) _tile_stored(1, sums[1], 64);
  if constexpr (NB > 2) _tile_stored(2, sums[2], 64);
  if constexpr (NB > 3) _tile_stored(3, sums[3], 64);
  for (int j = 0; j < NB; ++j) store_tile(sums[j], out_rows, bias, j, y, f32_out, ldy, n_valid);
}

using AmxKernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int,
                           const uint16_t*, void*, bool, int64_t, int64_t);
constexpr std::array<AmxKernel, kAmxBlocks> kAmx = {&amx_tiles<1>, &amx_tiles<2>,
                                                    &amx_tiles<3>, &amx_tiles<4>};

// y = x W^T + b on the tile unit (k a multiple of 32). Rows run as tiles of 16; a last partial
// tile of a longer x is copied into a zero-padded one, so that every tile has the rows of one
// configuration (min(m, 16)). Each thread takes a contiguous range of column blocks and runs
// its blocks 4 at a time over a panel of row tiles (the blocks' weight stays in L1/L2 over the
// panel, the panel's rows in L2 over the thread's blocks), panel after panel.
void linear_amx(const uint16_t* xp, int64_t ldx, int64_t m, int64_t k, const uint16_t* wp,
                int64_t block_elems, int64_t nblocks, const uint16_t* bp, char* yp,
                int64_t out_size, bool out_float32, int64_t n) {
  const int rows = static_cast<int>(std::min<int64_t>(m, kAmxRows));
  const int64_t full = m / rows, tail = m % rows;
  std::vector<uint16_t> padded;  // the last partial tile's rows, then zeros
  if (tail != 0) {
    padded.assign(static_cast<size_t>(kAmxRows * k), 0);
    for (int64_t i = 0; i < tail; ++i)
      std::memcpy(padded.data() + i * k, xp + (full * rows + i) * ldx, k * 2);
  }
  const int64_t tiles = full + (tail != 0);
  // tile t's rows of x, their stride and how many of them are stored (the last partial tile:
  // the padded copy, its padding rows' sums dropped)
  auto tile_x = [&](int64_t t) { return t == full ? padded.data() : xp + t * rows * ldx; };
  auto tile_ld = [&](int64_t t) { return t == full ? k : ldx; };
  auto tile_rows = [&](int64_t t) { return t == full ? static_cast<int>(tail) : rows; };
  constexpr int64_t kPanelTiles = kPanelRows / kAmxRows;
  at::parallel_for(0, nblocks, kAmxBlocks, [&](int64_t begin, int64_t end) {
    configure_tiles(rows);
    for (int64_t p0 = 0; p0 < tiles; p0 += kPanelTiles) {
      const int64_t p1 = std::min(tiles, p0 + kPanelTiles);
      for (int64_t b0 = begin; b0 < end; b0 += kAmxBlocks) {
        const int nb = static_cast<int>(std::min<int64_t>(kAmxBlocks, end - b0));
        const int64_t col0 = b0 * kBlock;
        const uint16_t* w = wp + b0 * block_elems;
        const uint16_t* bias = bp ? bp + col0 : nullptr;
        for (int64_t t = p0; t < p1; ++t)
          kAmx[nb - 1](tile_x(t), tile_ld(t), w, block_elems, k, tile_rows(t), bias,
                       yp + (t * rows * n + col0) * out_size, out_float32, n, n - col0);
      }
    }
    _tile_release();
  });
}
#endif

std::atomic<bool> amx_enabled{true};
}  // namespace

bool bf16_gemm_available() { return true; }

bool amx_gemm_available() {
#if defined(BATON_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

bool use_amx_gemm(bool enabled) { return amx_enabled.exchange(enabled); }

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
#if defined(BATON_AMX)
  if (k % kAmxK == 0 && amx_enabled.load() && amx_permitted()) {
    linear_amx(xp, ldx, m, k, wp, block_elems, nblocks, bp, yp, out_size, out_float32, n);
    return y;
  }
#endif
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
bool amx_gemm_available() { return false; }
bool use_amx_gemm(bool) { return false; }

torch::Tensor linear_bf16_vnni(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                               int64_t, bool) {
  TORCH_CHECK(false, "this CPU has no AVX512-BF16; use the oneDNN path");
}

#endif
