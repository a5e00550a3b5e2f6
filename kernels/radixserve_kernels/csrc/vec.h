// The vector layer under every kernel: one float vector type `VecF` of W lanes and the few
// operations the kernels use, defined once per instruction set. The kernels are written
// against this layer only (plus, for the quantized linears, the integer dot `dot4` below), so
// the same source compiles to AVX-512 (W = 16), AVX2 + FMA (W = 8) and a portable fallback
// (W = 4, plain C++ the compiler vectorizes as it can). A NEON or SVE port is one more block
// here, not a rewrite of the kernels.
//
// kernels/radixserve_kernels/cpu.py builds the sources once per instruction set it can run (`-mavx2 -mfma -mf16c`
// for AVX2; the CPU's own AVX-512 extensions for AVX-512) and loads the best; `isa()` names it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rs {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define RS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RS_AVX2 1
#endif

// ---- scalars: fp32 and bf16 (raw uint16, widened to fp32) --------------------------------
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const uint16_t* p, int64_t i) {
  uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(uint16_t* p, int64_t i, float v) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = 0x7fc0;  // NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = uint16_t(u >> 16);
}
// a quantized KV row's element: int8, or the raw byte of an fp8 e4m3fn (s eeee mmm, bias 7)
inline float ldq(const int8_t* p, int64_t i) { return float(p[i]); }
inline float ldq(const uint8_t* p, int64_t i) {
  const int e = (p[i] >> 3) & 15, m = p[i] & 7;
  const float mag = e ? std::ldexp(float(8 + m), e - 10) : std::ldexp(float(m), -9);
  return (p[i] & 0x80) ? -mag : mag;
}

inline void prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}
// One head's K or V row on its way into the cache: the slots are scattered, so no hardware
// prefetcher sees the stream coming.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch(static_cast<const char*>(p) + off);
}
// A weight stream's coming lines into L2 only (prefetcht2), for the tiles that read each weight
// once a call (a decode step's few rows). 16 K-quant sub-blocks (~5 KB) ahead into L2, against 4
// (~1 KB) into L1 with prefetch_row: a Qwen2.5-1.5B decode step 67-71 -> 59-64 ms on the AVX-512
// build and 72-75 -> 63-72 ms on AVX2 (2-core Xeon; docs/benchmarks.md).
inline void prefetch_l2(const void* p, int64_t bytes) {
#if defined(__GNUC__)
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, 1);
#endif
}

// ---- VecF ----------------------------------------------------------------------------------
#if defined(RS_AVX512)
constexpr const char* ISA = "avx512";
struct VecF {
  static constexpr int W = 16;
  __m512 v;
};
inline VecF vzero() { return {_mm512_setzero_ps()}; }
inline VecF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VecF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VecF vload(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline VecF vload(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
// fp8 e4m3 -> the fp16 of the same sign, exponent and mantissa bits (exponent bias 15, not 7:
// the value / 256, exactly, subnormals included) -> fp32, times 256.
inline VecF vload(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f))};
}
inline VecF vload_half(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline void vstore(float* p, VecF a) { _mm512_storeu_ps(p, a.v); }
inline void vstore(uint16_t* p, VecF a) {  // round to nearest even, as torch does
#if defined(__AVX512BF16__)
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(a.v));
#else
  __m512i u = _mm512_castps_si512(a.v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}
inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF vfma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b + c
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
inline VecF vabs(VecF a) { return {_mm512_abs_ps(a.v)}; }
inline float vsum(VecF a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(VecF a) { return _mm512_reduce_max_ps(a.v); }
inline VecF vround(VecF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline VecF vpow2i(VecF p, VecF n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n, n integral
// The sums of W vectors, as one vector (out[i] = the sum of v[i]'s lanes): a transpose-and-add
// tree, 46 instructions for 16 dot products instead of 16 horizontal reductions.
inline VecF vsums(const VecF* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i].v, v[i + 8].v, 0x44), _mm512_shuffle_f32x4(v[i].v, v[i + 8].v, 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // r holds v0 v2 v1 v3 | v8 v10 v9 v11 | v4 v6 v5 v7 | v12 v14 v13 v15
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), r)};
}

#elif defined(RS_AVX2)
constexpr const char* ISA = "avx2";
struct VecF {
  static constexpr int W = 8;
  __m256 v;
};
inline VecF vzero() { return {_mm256_setzero_ps()}; }
inline VecF vset1(float x) { return {_mm256_set1_ps(x)}; }
inline VecF vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline VecF vload(const uint16_t* p) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16))};
}
inline VecF vload(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)))};
}
inline VecF vload(const uint8_t* p) {  // fp8 e4m3, as the AVX-512 load: through fp16 bits
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return {_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f))};
}
inline VecF vload_half(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }
inline void vstore(float* p, VecF a) { _mm256_storeu_ps(p, a.v); }
inline void vstore(uint16_t* p, VecF a) {  // round to nearest even, as torch does (NaN: the st() rule)
  alignas(32) float t[8];
  _mm256_store_ps(t, a.v);
  for (int i = 0; i < 8; ++i) st(p, i, t[i]);
}
inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF vfma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
inline VecF vabs(VecF a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
inline float vsum(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(VecF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VecF vround(VecF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline VecF vpow2i(VecF p, VecF n) {  // p * 2^n for integral n in [-126, 127]: n added to the exponent bits of 1.0
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(e))};
}
inline VecF vsums(const VecF* v) {  // out[i] = the sum of v[i]'s lanes
  const __m256 a0 = _mm256_hadd_ps(v[0].v, v[1].v), a1 = _mm256_hadd_ps(v[2].v, v[3].v);
  const __m256 a2 = _mm256_hadd_ps(v[4].v, v[5].v), a3 = _mm256_hadd_ps(v[6].v, v[7].v);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // v0..v3 | v4..v7, each half of a lane set
  return {_mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31))};
}

#else
constexpr const char* ISA = "generic";
struct VecF {  // portable: the compiler vectorizes these loops as the target allows
  static constexpr int W = 4;
  float v[4];
};
#define RS_LANES(expr)               \
  VecF r;                            \
  for (int i = 0; i < 4; ++i) r.v[i] = (expr); \
  return r
inline VecF vzero() { RS_LANES(0.f); }
inline VecF vset1(float x) { RS_LANES(x); }
inline VecF vload(const float* p) { RS_LANES(p[i]); }
inline VecF vload(const uint16_t* p) { RS_LANES(ld(p, i)); }
inline VecF vload(const int8_t* p) { RS_LANES(ldq(p, i)); }
inline VecF vload(const uint8_t* p) { RS_LANES(ldq(p, i)); }
inline void vstore(float* p, VecF a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline void vstore(uint16_t* p, VecF a) {
  for (int i = 0; i < 4; ++i) st(p, i, a.v[i]);
}
inline VecF operator+(VecF a, VecF b) { RS_LANES(a.v[i] + b.v[i]); }
inline VecF operator-(VecF a, VecF b) { RS_LANES(a.v[i] - b.v[i]); }
inline VecF operator*(VecF a, VecF b) { RS_LANES(a.v[i] * b.v[i]); }
inline VecF operator/(VecF a, VecF b) { RS_LANES(a.v[i] / b.v[i]); }
inline VecF vfma(VecF a, VecF b, VecF c) { RS_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
inline VecF vmax(VecF a, VecF b) { RS_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline VecF vmin(VecF a, VecF b) { RS_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline VecF vabs(VecF a) { RS_LANES(std::fabs(a.v[i])); }
inline float vsum(VecF a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
inline float vhmax(VecF a) { return std::fmax(std::fmax(a.v[0], a.v[1]), std::fmax(a.v[2], a.v[3])); }
inline VecF vround(VecF a) { RS_LANES(std::nearbyint(a.v[i])); }
inline VecF vpow2i(VecF p, VecF n) { RS_LANES(std::ldexp(p.v[i], int(n.v[i]))); }
inline VecF vsums(const VecF* v) { RS_LANES(vsum(v[i])); }
#undef RS_LANES
#endif

constexpr int W = VecF::W;

// exp(x): 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5] by a degree-6 polynomial (relative
// error ~2e-7); x is clamped to [-87, 88] (below: ~0, as exp in fp32; above: ~fp32's max).
inline VecF vexp(VecF x) {
  x = vmin(vmax(x, vset1(-87.f)), vset1(88.f));
  const VecF t = x * vset1(1.44269504088896341f);
  const VecF n = vround(t);
  const VecF f = t - n;
  VecF p = vset1(1.535336188319500e-4f);
  p = vfma(p, f, vset1(1.339887440266574e-3f));
  p = vfma(p, f, vset1(9.618437357674640e-3f));
  p = vfma(p, f, vset1(5.550332471162809e-2f));
  p = vfma(p, f, vset1(2.402264791363012e-1f));
  p = vfma(p, f, vset1(6.931472028550421e-1f));
  p = vfma(p, f, vset1(1.f));
  return vpow2i(p, n);
}

// The first n (< W) lanes of p, the rest 0; and their store (the tails of loops over W).
template <typename T>
inline VecF vload_part(const T* p, int64_t n) {
  T buf[W] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return vload(buf);
}
inline void vstore_part(float* p, VecF a, int64_t n) {
  float buf[W];
  vstore(buf, a);
  std::memcpy(p, buf, n * sizeof(float));
}

}  // namespace rs
