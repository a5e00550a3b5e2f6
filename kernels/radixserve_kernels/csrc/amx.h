// AMX tiles for the quantized linears' many-row calls (a batch's decode step, a prefill chunk) on
// CPUs with AMX-INT8 (Intel Sapphire Rapids and later): built into the avx512 build where the
// CPU has it (kernels/radixserve_kernels/cpu.py), used where the process may (amx_ready).
//
// The integer sums are the VNNI tiles', 16 rows x 16 outputs x 32 weights per tdpbsud (signed
// activations times unsigned weights):
//   B  a panel's sub-block of 32 weights as it is unpacked for vpdpbusd: 8 rows of 64 bytes, row
//      c holding weights 4c .. 4c + 3 of each output (the VNNI tiles' w[c]), or two halves of 4
//      rows (K 0..15, 16..31) where a format scales its halves apart (Q5_0, Q6_K);
//   A  16 rows' activation blocks, read in place from QuantRows (a row every kb * 32 bytes; the
//      rows are padded to a multiple of 16 with zeros when the tiles will run);
//   C  stored after each sub-block and scaled by the same float operations, in the same order, as
//      the VNNI tiles (acc += float(S - z*sq) * (a*dx) [+ off*sx]), so both paths give the same
//      numbers bit for bit (tests/test_quant.py compares them).
// A panel's sub-blocks are unpacked once per call into a thread's scratch (PanelScratch: the B tiles
// and each sub-block's scale vectors, the K-family VNNI tiles' own for 8 rows or more) and
// reused by every row tile.
#pragma once

#include "quant.h"

#if defined(RS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define RS_AMX 1

namespace rs {

constexpr int64_t AMX_ROWS = 16;  // rows per tile
// Rows from which a call runs on the tiles (fewer: the VNNI tiles). Measured on a 2-core Intel
// Xeon with AMX (docs/benchmarks.md): at 24 rows (two tiles, one half empty) the tiles ran at
// 0.75-0.87x the VNNI tiles' rate, at 32 rows 1.0-1.25x, at 64 1.1-1.35x.
constexpr int64_t AMX_MIN_ROWS = 32;

// Whether this process may use the tiles: Linux grants the tile state on request (arch_prctl
// ARCH_REQ_XCOMP_PERM), asked once; refused (a kernel before 5.16), the VNNI tiles serve.
// set_amx(false), or RADIXSERVE_AMX=0 in the environment, turns them off for the process (the
// tests compare both paths).
bool amx_ready();
bool amx_rows_for(int64_t m);  // amx_ready() and m >= AMX_MIN_ROWS

// The tiles take a panel's sub-blocks from the thread's PanelScratch (quant.h): per sub-block a
// 512-byte B tile and 48 floats (a0, a1, off: 16 outputs each).
inline void put_scales(PanelScratch& pan, int64_t i, __m512 a0, __m512 a1, __m512 off) {
  _mm512_storeu_ps(pan.scales(i), a0);
  _mm512_storeu_ps(pan.scales(i) + 16, a1);
  _mm512_storeu_ps(pan.scales(i) + 32, off);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 C (16 x 16 int32), 4 and 7 A, 5 and 6 B. Whole sub-blocks: A 16 x 32 bytes, B 8 x 64;
// halves (split): A 16 x 16, B 4 x 64.
inline TileConfig make_tile_config(bool split) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  c.rows[4] = c.rows[7] = 16;
  c.colsb[4] = c.colsb[7] = split ? 16 : 32;
  c.rows[5] = c.rows[6] = split ? 4 : 8;
  c.colsb[5] = c.colsb[6] = 64;
  return c;
}

// The tile work of sub-block i of 16 rows (A: the rows' block 0, a row every `stride` bytes),
// its sums stored to c: tile 0 (whole; SPLIT: the halves in 0 and 1; W: the low halves' sums
// after them, in 1, or 2 and 3). (GCC's tile intrinsics take literal tile numbers: macros.)
#define RS_AMX_WHOLE(T, A, x)     \
  _tile_zero(T);                  \
  _tile_loadd(A, (x), stride);    \
  _tile_dpbsud(T, A, 5)
#define RS_AMX_HALVES(T0, T1, x)     \
  _tile_zero(T0);                    \
  _tile_zero(T1);                    \
  _tile_loadd(4, (x), stride);       \
  _tile_loadd(7, (x) + 16, stride);  \
  _tile_dpbsud(T0, 4, 5);            \
  _tile_dpbsud(T1, 7, 6)
template <bool SPLIT, bool W>
inline void amx_issue(const PanelScratch& pan, int64_t i, const int8_t* hi, const int8_t* lo, int64_t stride, int32_t (*c)[16][16]) {
  const uint8_t* b = pan.b.data() + i * 512;
  _tile_loadd(5, b, 64);
  if constexpr (!SPLIT) {
    RS_AMX_WHOLE(0, 4, hi + i * QBLOCK);
    if constexpr (W) { RS_AMX_WHOLE(1, 7, lo + i * QBLOCK); }
  } else {
    _tile_loadd(6, b + 256, 64);
    RS_AMX_HALVES(0, 1, hi + i * QBLOCK);
    if constexpr (W) { RS_AMX_HALVES(2, 3, lo + i * QBLOCK); }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (SPLIT || W) _tile_stored(1, c[1], 64);
  if constexpr (SPLIT && W) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}
#undef RS_AMX_WHOLE
#undef RS_AMX_HALVES

// The m rows of xr (padded to 16) times one panel's unpacked sub-blocks, into y's outputs
// n0 .. n0 + 15 (those below n), plus the bias. Z: the weights' integer zero point; SPLIT: the
// halves scaled apart (a0 for K 0..15, a1 for 16..31); OFF: acc += off * sx; W: 16-bit
// activations (S = 256 * S(hi) + S(lo)). The float combination is the VNNI tiles' (see above).
template <int Z, bool SPLIT, bool OFF, bool W, typename O>
void amx_rows(PanelScratch& pan, int64_t kb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
              int64_t n) {
  static const TileConfig cfg = make_tile_config(SPLIT);
  _tile_loadconfig(&cfg);
  alignas(64) int32_t c[4][16][16];
  const int64_t stride = kb * QBLOCK;
  for (int64_t m0 = 0; m0 < m; m0 += AMX_ROWS) {
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* hi = xr.hi.data() + m0 * stride;
    const int8_t* lo = W ? xr.lo.data() + m0 * stride : nullptr;
    for (int64_t i = 0; i < kb; ++i) {
      amx_issue<SPLIT, W>(pan, i, hi, lo, stride, c);
      const float* s = pan.scales(i);
      const __m512 a0 = _mm512_loadu_ps(s), a1 = _mm512_loadu_ps(s + 16), off = _mm512_loadu_ps(s + 32);
      for (int r = 0; r < AMX_ROWS; ++r) {
        const int64_t at = (m0 + r) * kb + i;
        const __m512 dx = _mm512_set1_ps(xr.dx[at]);
        auto sum = [&](int t) {  // tile t's sums of row r, at 16 bits combined with its low half
          const __m512i v = _mm512_load_si512(c[t][r]);
          if constexpr (W) return _mm512_add_epi32(_mm512_slli_epi32(v, 8), _mm512_load_si512(c[t + (SPLIT ? 2 : 1)][r]));
          else return v;
        };
        if constexpr (SPLIT) {
          const __m512i z0 = _mm512_set1_epi32(Z * xr.sq0[at]), z1 = _mm512_set1_epi32(Z * (xr.sq[at] - xr.sq0[at]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum(0), z0)), _mm512_mul_ps(a0, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum(1), z1)), _mm512_mul_ps(a1, dx), acc[r]);
        } else {
          __m512i si = sum(0);
          if constexpr (Z != 0) si = _mm512_sub_epi32(si, _mm512_set1_epi32(Z * xr.sq[at]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(a0, dx), acc[r]);
          if constexpr (OFF) acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(xr.sx[at]), acc[r]);
        }
      }
    }
    for (int64_t r = 0; r < std::min<int64_t>(AMX_ROWS, m - m0); ++r) {
      alignas(64) float v[QPANEL];
      _mm512_store_ps(v, acc[r]);
      store_row16(y + (m0 + r) * ldy, n0, n, v, bias);
    }
  }
  _tile_release();
}

// amx_rows at xr's activation width.
template <int Z, bool SPLIT, bool OFF, typename O>
void amx_rows_of(PanelScratch& pan, int64_t kb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
                 int64_t n) {
  if (xr.wide) amx_rows<Z, SPLIT, OFF, true>(pan, kb, xr, m, bias, y, ldy, n0, n);
  else amx_rows<Z, SPLIT, OFF, false>(pan, kb, xr, m, bias, y, ldy, n0, n);
}

}  // namespace rs
#endif
