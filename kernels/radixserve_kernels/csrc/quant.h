// What the quantized-linear families share: the activations of a few rows quantized per block
// of 32 to 8 or 16 bits (QuantRows, made once per call by quantize_rows), and the panel of 16
// outputs every packed quantized weight is cut into.
#pragma once

#include <new>

#include "common.h"

namespace rs {

constexpr int64_t QPANEL = 16, QBLOCK = 32;
// Rows a pass of qlinear: a prefill's rows go through every panel this many at a time (each panel's
// sub-blocks unpacked once a pass). 128 measured 3-5 % faster than 64 on a Qwen2.5-1.5B prefill
// (2-core Xeon, AVX2 and AMX builds), 256 level with 128.
constexpr int64_t QLINEAR_ROWS = 128;
// Weight blocks (a legacy kind's block, a K-quant's sub-block; 288-544 bytes a panel) that the
// few-rows tiles prefetch ahead into L2 (prefetch_l2, vec.h): a decode step reads each weight once.
constexpr int64_t QPREFETCH = 16;

// The builds with a vector integer dot product for the quantized tiles: vpdpbusd (AVX512-VNNI)
// or vpmaddubsw + vpmaddwd (AVX2, also AVX-512 without VNNI); elsewhere the portable tiles.
#if (defined(RS_AVX512) && defined(__AVX512VNNI__)) || defined(__AVX2__)
#define RS_INT_DOT 1
#endif

// Activations of `m` rows, quantized per block of 32 (llama.cpp's Q8_0 form, or finer):
//   8 bits (wide = false; the default for quantized weights): xi = round(x / dx) with
//     dx = amax / 127, held in `hi` (-127..127): one u8 x s8 product per weight;
//   16 bits (wide = true): dx = amax / 32639, xi held as two int8 halves xi = 256*hi + lo (hi in
//     -127..127, lo in -128..127), so u8 x s8 products make each block's exact integer sum in
//     two passes: twice the integer work, and a rounding error (~1.5e-5 of a block's largest)
//     far below bf16's. `radixserve bench quality` measures what 8 bits change.
// sq: the sum of a block's xi (sq0: of its first 16); sx = dx * sq, the sum of the values they
// stand for (a format's offset term multiplies it: the result is then the exact dot product of
// the weights with the quantized activations).
constexpr float QSTEPS = 32639.f;  // 127 * 256 + 127: hi = (xi + 128) >> 8 stays in -127..127
constexpr float QSTEPS8 = 127.f;

// Storage on 64-byte lines (the AMX tiles load rows of 32 or 64 bytes: a row split over two
// lines costs a load up to 5x).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
template <typename T>
using aligned_vector = std::vector<T, Aligned64<T>>;

// One panel's sub-blocks unpacked once for all of a call's rows (the AMX tiles', amx.h, and the
// AVX2 K-family tiles' for many rows): per sub-block 512 bytes of weight vectors and 48 floats
// of scales (a0, a1, off for the 16 outputs). A thread's scratch, grown as needed.
struct PanelScratch {
  aligned_vector<uint8_t> b;
  std::vector<float> sc;
  void reserve(int64_t kb) {
    if (int64_t(b.size()) < kb * 512) b.resize(kb * 512);
    if (int64_t(sc.size()) < kb * 48) sc.resize(kb * 48);
  }
  uint8_t* tile(int64_t i) { return b.data() + i * 512; }
  const uint8_t* tile(int64_t i) const { return b.data() + i * 512; }
  float* scales(int64_t i) { return sc.data() + i * 48; }
  const float* scales(int64_t i) const { return sc.data() + i * 48; }
};

inline PanelScratch& panel_scratch() {
  thread_local PanelScratch p;
  return p;
}

struct QuantRows {
  aligned_vector<int8_t> hi, lo;  // lo: empty unless wide
  std::vector<float> dx, sx;
  std::vector<int32_t> sq, sq0;
  bool wide = true;
  bool tiles = false;  // for the AMX tiles (amx.h): the rows padded with zeros to a multiple of 16
  // xi of block `at`'s weight j, whichever the width
  int32_t value(int64_t at, int j) const {
    const int64_t i = at * 32 + j;
    return wide ? 256 * int32_t(hi[i]) + lo[i] : int32_t(hi[i]);
  }
};

#if defined(RS_AVX512) && defined(__AVX512VNNI__)
// One block of 32 of row-block `at` against a panel's 8 weight vectors (w[c]: weights 4c..4c+3,
// w[4 + c]: 16 + 4c..), by vpdpbusd: s0 the integer sums of the first 16 weights, s1 of the
// last 16, per output; at 16 bits (W) the halves combine as 256*hi + lo. (Both quantized-linear
// families' VNNI tiles.)
template <bool W>
inline void dot_block_vnni(const __m512i* w, const QuantRows& xr, int64_t at, __m512i& s0, __m512i& s1) {
  const int32_t* hi = reinterpret_cast<const int32_t*>(xr.hi.data() + at * 32);
  s0 = _mm512_setzero_si512();
  s1 = s0;
  for (int c = 0; c < 4; ++c) {  // independent chains, so the sums overlap
    s0 = _mm512_dpbusd_epi32(s0, w[c], _mm512_set1_epi32(hi[c]));
    s1 = _mm512_dpbusd_epi32(s1, w[4 + c], _mm512_set1_epi32(hi[4 + c]));
  }
  if constexpr (W) {
    const int32_t* lo = reinterpret_cast<const int32_t*>(xr.lo.data() + at * 32);
    __m512i l0 = _mm512_setzero_si512(), l1 = l0;
    for (int c = 0; c < 4; ++c) {
      l0 = _mm512_dpbusd_epi32(l0, w[c], _mm512_set1_epi32(lo[c]));
      l1 = _mm512_dpbusd_epi32(l1, w[4 + c], _mm512_set1_epi32(lo[4 + c]));
    }
    s0 = _mm512_add_epi32(_mm512_slli_epi32(s0, 8), l0);
    s1 = _mm512_add_epi32(_mm512_slli_epi32(s1, 8), l1);
  }
}
#endif

// One block of row r: xi, its halves, and the block's scale and sums (see QuantRows).
inline void finish_block(QuantRows& out, int64_t at, float d, int32_t sq, int32_t sq0) {
  out.dx[at] = d;
  out.sx[at] = d * float(sq);
  out.sq[at] = sq;
  out.sq0[at] = sq0;
}


// x (m, k) rows with stride ldx, into kb blocks of 32 each (the last one zero-padded), to 16
// bits (wide) or 8; tiles: rows of zeros after them, to a multiple of 16 (amx.h).
template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t kb, bool wide, QuantRows& out, bool tiles = false);

// One panel's 16 sums v into row y's outputs n0.. (n0 + 16 <= n or fewer), plus the bias.
template <typename O>
inline void store_row16(O* y, int64_t n0, int64_t n, const float* v, const float* bias) {
  for (int64_t i = 0; i < QPANEL && n0 + i < n; ++i) st(y, n0 + i, v[i] + (bias ? bias[n0 + i] : 0.f));
}

#if defined(__AVX2__)
// The AVX2 tiles' two 8-output halves of a panel's row, stored as store_row16 does.
template <typename O>
inline void store_halves16(O* y, int64_t n0, int64_t n, __m256 lo, __m256 hi, const float* bias) {
  alignas(32) float v[QPANEL];
  _mm256_store_ps(v, lo);
  _mm256_store_ps(v + 8, hi);
  store_row16(y, n0, n, v, bias);
}
#endif

// --- kquant_linear.cpp: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K -------------------------------------
int kfamily_of_kind(const std::string& kind);  // -1: not one of them
int kfamily_of_record(int64_t bytes);          // the format whose packed record is this many bytes, or -1
int64_t kfamily_block(int f);                  // weights per GGUF block (32 or 256)
at::Tensor pack_kfamily(const at::Tensor& raw, int f, int64_t n, int64_t k);
void dequant_kfamily(const at::Tensor& packed, int f, int64_t k, const int64_t* rows, int64_t count, float* out);
void qlinear_kfamily(const at::Tensor& packed, int f, const QuantRows& xr, int64_t m, const float* bias, at::Tensor& y, int64_t n,
                     bool generic);
// Panel p of a packed weight of format f times xr's m rows into y (m, n; rows ldy apart), plus
// bias: one panel of qlinear_kfamily, for the callers that spread several linears' panels over
// one parallel region (qlinear_many, qlinear_parts). O: float, or uint16_t (bf16).
template <typename O>
void kfamily_panel(const at::Tensor& packed, int f, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n,
                   int64_t p, bool generic);

}  // namespace rs
