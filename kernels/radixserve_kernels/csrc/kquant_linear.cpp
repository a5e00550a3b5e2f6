// Quantized linears of the 5- and 6-bit family and GGUF's K-quants: Q5_0, Q5_1 (blocks of 32)
// and Q4_K, Q5_K, Q6_K (super-blocks of 256 in sub-blocks of 32 or 16), kept at the file's size
// and repacked once into panels of 16 outputs. Torch references: gguf-py's dequantize (the
// values, bit for bit) and tests/test_quant.py's reference_qlinear (the 16-bit-activation dot).
//
// Every format is the same shape underneath: per sub-block of 32 weights, unsigned values q of
// 4 to 6 bits, and per output a scale (and an offset) of the sub-block:
//   q5_0  w = d * (q - 16)                    q5_1  w = d * q + m
//   q4_k  w = (d * sc) * q - (dmin * mn)      q5_k  the same, q of 5 bits
//   q6_k  w = (d * sc16) * (q - 32)           (a scale per 16 weights: two per sub-block)
// so one record layout and one kernel serve them all. Per (panel, GGUF block): a header (the
// super-block's fp16 d [and dmin], 16 outputs each), then per sub-block of 32 weights:
//   [0, 256)        q's low 4 bits: byte 64c + 4n + r holds output n's weight 4c + r (low
//                   nibble) and 16 + 4c + r (high nibble), as the Q4 panels of quant_linear.cpp
//   [256, +64*hb)   q's bits above the nibble, as planes per chunk c: nibble byte j = 4n + r's
//                   two weights (low nibble L, high nibble H) have e_j = L's high bits | H's
//                   high bits << hb (4 bits for q6_k, 2 for the 5-bit kinds); q6_k keeps 32
//                   bytes per chunk, byte i = e_i | e_{i+32} << 4; the 5-bit kinds 16, byte
//                   i = e_i | e_{i+16} << 2 | e_{i+32} << 4 | e_{i+48} << 6. A 32- or 64-byte run
//                   of nibble bytes finds its e with a shift and a mask (a shuffle-free unpack
//                   on AVX2 as on AVX-512)
//   then            the sub-block's per-output scales (fp16 d [, m]; or u8 sc, mn; or i8 sc x2)
// A few rows (decode) work in integers as the Q4/Q8 kernels do; the per-half integer sums S0,
// S1 are scaled in the same order on every ISA, so the AVX-512, AVX2 and portable paths give
// the same numbers bit for bit. Many rows (prefill): dequant_kfamily, then fp32 GEMM.
#include "amx.h"
#include "quant.h"

namespace rs {
namespace {

struct Fmt {
  const char* name;
  int64_t block, src_bytes, header, hbits, scale;  // weights and bytes per GGUF block; record parts
  constexpr int64_t sub() const { return 256 + 64 * hbits + scale; }
  constexpr int64_t subs() const { return block / 32; }
  constexpr int64_t rec() const { return header + subs() * sub(); }
};
enum : int { Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, NFMT };
constexpr Fmt FMTS[NFMT] = {
    {"q5_0", 32, 22, 0, 1, 32},   {"q5_1", 32, 24, 0, 1, 64},   {"q4_k", 256, 144, 64, 0, 32},
    {"q5_k", 256, 176, 64, 1, 32}, {"q6_k", 256, 210, 32, 2, 32},
};

// One GGUF block of one row, unpacked: its values q and its scales as the file has them.
struct Block {
  uint8_t q[256];
  uint16_t d = 0, m = 0;  // fp16 bits: d; q5_1's m; the K-quants' dmin in m
  uint8_t sc[16] = {}, mn[8] = {};  // K-quants: 6-bit sc, mn per sub-block; q6_k: int8 sc per 16
};

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void unpack(int f, const uint8_t* s, Block& u) {
  if (f == Q5_0 || f == Q5_1) {
    u.d = u16(s);
    const int off = f == Q5_1 ? 4 : 2;
    if (f == Q5_1) u.m = u16(s + 2);
    uint32_t qh;
    std::memcpy(&qh, s + off, 4);
    const uint8_t* qs = s + off + 4;
    for (int j = 0; j < 16; ++j) {
      u.q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
      u.q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
    return;
  }
  if (f == Q6_K) {  // ql[128], qh[64], int8 scales[16], d; weight 128h + 64s + j: ql[64h + j] >> 4s, 128h + 32t + j: qh >> 2t
    const uint8_t *ql = s, *qh = s + 128;
    std::memcpy(u.sc, s + 192, 16);
    u.d = u16(s + 208);
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 64; ++j) {
        u.q[128 * h + j] = ql[64 * h + j] & 15;
        u.q[128 * h + 64 + j] = ql[64 * h + j] >> 4;
      }
      for (int t = 0; t < 4; ++t)
        for (int j = 0; j < 32; ++j) u.q[128 * h + 32 * t + j] |= ((qh[32 * h + j] >> (2 * t)) & 3) << 4;
    }
    return;
  }
  // Q4_K / Q5_K: d, dmin, scales[12] (6-bit sc and mn of 8 sub-blocks), [qh[32]], qs[128]
  u.d = u16(s);
  u.m = u16(s + 2);
  const uint8_t* sp = s + 4;
  for (int i = 0; i < 4; ++i) {
    u.sc[i] = sp[i] & 63;
    u.mn[i] = sp[i + 4] & 63;
    u.sc[i + 4] = (sp[i + 8] & 15) | ((sp[i] >> 6) << 4);
    u.mn[i + 4] = (sp[i + 8] >> 4) | ((sp[i + 4] >> 6) << 4);
  }
  const uint8_t* qh = f == Q5_K ? s + 16 : nullptr;
  const uint8_t* qs = s + (f == Q5_K ? 48 : 16);
  for (int g = 0; g < 4; ++g)  // weight 64g + j: qs[32g + j] & 15; 64g + 32 + j: qs[32g + j] >> 4
    for (int j = 0; j < 32; ++j) {
      u.q[64 * g + j] = qs[32 * g + j] & 15;
      u.q[64 * g + 32 + j] = qs[32 * g + j] >> 4;
    }
  if (qh)  // weight 32t + j: bit t of qh[j]
    for (int t = 0; t < 8; ++t)
      for (int j = 0; j < 32; ++j) u.q[32 * t + j] |= ((qh[j] >> t) & 1) << 4;
}

// The high-bit plane of chunk c: 16 * hbits bytes (see the layout above).
inline const uint8_t* plane_at(const uint8_t* sub, int64_t hbits, int c) { return sub + 256 + 16 * hbits * c; }

// e_j of nibble byte j (0..63) of a chunk's plane.
inline int plane_e(const uint8_t* plane, int64_t hbits, int j) {
  return hbits == 2 ? (plane[j % 32] >> (4 * (j / 32))) & 15 : (plane[j % 16] >> (2 * (j / 16))) & 3;
}

// The outputs `u[0, lanes)` of one panel's GGUF block into its record (zeroed beforehand).
void write_record(int f, const Block* u, int64_t lanes, uint8_t* rec) {
  const Fmt& F = FMTS[f];
  for (int64_t lane = 0; lane < lanes && F.header; ++lane) {
    std::memcpy(rec + 2 * lane, &u[lane].d, 2);
    if (f != Q6_K) std::memcpy(rec + 32 + 2 * lane, &u[lane].m, 2);
  }
  for (int64_t i = 0; i < F.subs(); ++i) {
    uint8_t* sub = rec + F.header + i * F.sub();
    uint8_t* sc = sub + 256 + 64 * F.hbits;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const uint8_t* q = u[lane].q + 32 * i;
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < 4; ++r) {
          const uint8_t lo = q[4 * c + r], hi = q[16 + 4 * c + r];
          const int j = int(4 * lane + r);
          sub[64 * c + j] = uint8_t((lo & 15) | ((hi & 15) << 4));
          if (F.hbits) {
            const int e = (lo >> 4) | ((hi >> 4) << F.hbits);
            uint8_t* plane = sub + 256 + 16 * F.hbits * c;
            if (F.hbits == 2) plane[j % 32] |= uint8_t(e << (4 * (j / 32)));
            else plane[j % 16] |= uint8_t(e << (2 * (j / 16)));
          }
        }
      if (f == Q5_0 || f == Q5_1) {
        std::memcpy(sc + 2 * lane, &u[lane].d, 2);
        if (f == Q5_1) std::memcpy(sc + 32 + 2 * lane, &u[lane].m, 2);
      } else if (f == Q6_K) {
        sc[lane] = u[lane].sc[2 * i];
        sc[16 + lane] = u[lane].sc[2 * i + 1];
      } else {
        sc[lane] = u[lane].sc[i];
        sc[16 + lane] = u[lane].mn[i];
      }
    }
  }
}

// A sub-block's values, all 16 outputs: q[n][j] for weight j of output n.
inline void unpack_sub(const uint8_t* sub, int64_t hbits, uint8_t (*q)[32]) {
  for (int c = 0; c < 4; ++c)
    for (int n = 0; n < 16; ++n)
      for (int r = 0; r < 4; ++r) {
        const uint8_t byte = sub[64 * c + 4 * n + r];
        q[n][4 * c + r] = byte & 15;
        q[n][16 + 4 * c + r] = byte >> 4;
      }
  if (hbits)
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 64; ++j) {
        const int e = plane_e(plane_at(sub, hbits, c), hbits, j), lo_bits = e & ((1 << hbits) - 1);
        q[j / 4][4 * c + j % 4] |= uint8_t(lo_bits << 4);
        q[j / 4][16 + 4 * c + j % 4] |= uint8_t((e >> hbits) << 4);
      }
}

// One output's sub-block: w = a_p * (q - z) + off for the half p its weight is in (a float
// scale per half, z an integer zero point, off a float offset), with a_p made from the file's
// numbers in gguf-py's order so that dequantizing reproduces it bit for bit.
struct Lane {
  float a0, a1, off;
  int z;
};

inline Lane lane_scales(int f, const uint8_t* rec, const uint8_t* sub, int64_t lane) {
  const Fmt& F = FMTS[f];
  const uint8_t* sc = sub + 256 + 64 * F.hbits;
  if (f == Q5_0) {
    const float d = half_to_float(u16(sc + 2 * lane));
    return {d, d, 0.f, 16};
  }
  if (f == Q5_1) {
    const float d = half_to_float(u16(sc + 2 * lane));
    return {d, d, half_to_float(u16(sc + 32 + 2 * lane)), 0};
  }
  const float d = half_to_float(u16(rec + 2 * lane));
  if (f == Q6_K) return {d * float(int8_t(sc[lane])), d * float(int8_t(sc[16 + lane])), 0.f, 32};
  const float s = d * float(sc[lane]), dm = half_to_float(u16(rec + 32 + 2 * lane)) * float(sc[16 + lane]);
  return {s, s, -dm, 0};
}

template <int F>
void pack_impl(const uint8_t* src, int64_t n, int64_t nb, uint8_t* dst) {
  const Fmt& fm = FMTS[F];
  const int64_t panels = (n + QPANEL - 1) / QPANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<Block> u(QPANEL);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lanes = std::min<int64_t>(QPANEL, n - p * QPANEL);
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t l = 0; l < lanes; ++l) unpack(F, src + ((p * QPANEL + l) * nb + b) * fm.src_bytes, u[l]);
        write_record(F, u.data(), lanes, dst + (p * nb + b) * fm.rec());
      }
    }
  });
}

// --- the few-rows kernel ----------------------------------------------------------------
// The float combination of one sub-block, the same on every path: S0/S1 the integer sums of the
// halves, sq/sq0 the activation block's sums (whole, first half), dx/sx its scale and dx*sq.
//   q5_0, q6_k (z != 0): acc += (S0 - z*sq0) * (a0*dx); acc += (S1 - z*(sq - sq0)) * (a1*dx)
//   q5_1, K-quants:      acc += (S0 + S1) * (a0*dx);     acc += off * sx
// (z != 0 formats have no offset, and q5_1 / K-quants have a0 == a1).

template <int F, typename O>
void ktile_generic(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy,
                   int64_t n0, int64_t n) {
  const Fmt& fm = FMTS[F];
  const int64_t kb = nb * fm.subs();
  std::vector<float> acc(m * QPANEL, 0.f);
  uint8_t q[QPANEL][32];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * fm.rec();
    for (int64_t i = 0; i < fm.subs(); ++i) {
      const uint8_t* sub = rec + fm.header + i * fm.sub();
      unpack_sub(sub, fm.hbits, q);
      for (int64_t lane = 0; lane < QPANEL; ++lane) {
        const Lane l = lane_scales(F, rec, sub, lane);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t at = r * kb + b * fm.subs() + i;
          const float dx = xr.dx[at];
          int32_t s[2] = {0, 0};
          for (int j = 0; j < 32; ++j) s[j / 16] += int32_t(q[lane][j]) * xr.value(at, j);
          float& a = acc[r * QPANEL + lane];
          if (l.z) {
            a = std::fma(float(s[0] - l.z * xr.sq0[at]), l.a0 * dx, a);
            a = std::fma(float(s[1] - l.z * (xr.sq[at] - xr.sq0[at])), l.a1 * dx, a);
          } else {
            a = std::fma(float(s[0] + s[1]), l.a0 * dx, a);
            a = std::fma(l.off, xr.sx[at], a);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) store_row16(y + r * ldy, n0, n, acc.data() + r * QPANEL, bias);
}

#if defined(RS_AVX512) && defined(__AVX512VNNI__)
constexpr int64_t KMR = 4;

// A chunk's e_j for its 64 nibble bytes, one per byte (plane_e, 64 at a time).
template <int HB>
inline __m512i plane64(const uint8_t* plane) {
  if constexpr (HB == 2) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)plane), m = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)), _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
  } else {  // bytes 16q .. 16q + 15 from the plane's bits 2q, 2q + 1
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)plane));
    const __m512i shift = _mm512_set_epi64(0x0006000600060006, 0x0006000600060006, 0x0004000400040004, 0x0004000400040004,
                                           0x0002000200020002, 0x0002000200020002, 0, 0);  // 128-bit lane q: 2q, per 16 bits
    return _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(3));
  }
}

// The 16 outputs' a0, a1, off as vectors (lane_scales, 16 at a time).
template <int F>
inline void scales16(const uint8_t* rec, const uint8_t* sub, __m512& a0, __m512& a1, __m512& off) {
  const uint8_t* sc = sub + 256 + 64 * FMTS[F].hbits;
  off = _mm512_setzero_ps();
  if constexpr (F == Q5_0 || F == Q5_1) {
    a0 = a1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
    if constexpr (F == Q5_1) off = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32)));
    return;
  }
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
  if constexpr (F == Q6_K) {
    a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)sc))));
    a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + 16)))));
    return;
  }
  a0 = a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)sc))));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32)));
  const __m512 dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + 16)))));
  off = _mm512_sub_ps(_mm512_setzero_ps(), dm);
}

// A sub-block's 8 weight vectors, all 16 outputs (w[c]: weights 4c .. 4c + 3 of each output,
// w[4 + c]: 16 + 4c ..), the values q whole.
template <int F>
inline void weights16(const uint8_t* sub, __m512i* w) {
  constexpr Fmt fm = FMTS[F];
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(sub + 64 * c);
    w[c] = _mm512_and_si512(v, low);
    w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (fm.hbits > 0) {
      const __m512i e = plane64<fm.hbits>(plane_at(sub, fm.hbits, c));
      constexpr int lo_mask = (1 << fm.hbits) - 1;
      w[c] = _mm512_or_si512(w[c], _mm512_slli_epi16(_mm512_and_si512(e, _mm512_set1_epi8(lo_mask)), 4));
      w[4 + c] = _mm512_or_si512(w[4 + c], _mm512_slli_epi16(_mm512_and_si512(e, _mm512_set1_epi8(lo_mask << fm.hbits)), 4 - fm.hbits));
    }
  }
}

// One row's sub-block `at` against the panel's 8 weight vectors: acc += its scaled sums (the
// tiles below, unpacking as they go or from the scratch).
template <int F, bool W>
inline void ksub16(const __m512i* w, const QuantRows& xr, int64_t at, __m512 a0, __m512 a1, __m512 off, __m512& acc) {
  constexpr int Z = F == Q5_0 ? 16 : F == Q6_K ? 32 : 0;
  __m512i s0, s1;
  dot_block_vnni<W>(w, xr, at, s0, s1);
  const __m512 dx = _mm512_set1_ps(xr.dx[at]);
  if constexpr (Z != 0) {
    const __m512i z0 = _mm512_set1_epi32(Z * xr.sq0[at]), z1 = _mm512_set1_epi32(Z * (xr.sq[at] - xr.sq0[at]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s0, z0)), _mm512_mul_ps(a0, dx), acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s1, z1)), _mm512_mul_ps(a1, dx), acc);
  } else {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(a0, dx), acc);
    acc = _mm512_fmadd_ps(off, _mm512_set1_ps(xr.sx[at]), acc);
  }
}

template <int F, int MR, bool W, typename O>
void ktile(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy, int64_t n0,
           int64_t n) {
  constexpr Fmt fm = FMTS[F];
  const int64_t kb = nb * fm.subs();
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * fm.rec();
    for (int64_t i = 0; i < fm.subs(); ++i) {
      const uint8_t* sub = rec + fm.header + i * fm.sub();
      prefetch_l2(sub + QPREFETCH * fm.sub(), fm.sub());
      __m512i w[8];
      weights16<F>(sub, w);
      __m512 a0, a1, off;
      scales16<F>(rec, sub, a0, a1, off);
      for (int m = 0; m < MR; ++m) ksub16<F, W>(w, xr, (m0 + m) * kb + b * fm.subs() + i, a0, a1, off, acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float v[QPANEL];
    _mm512_store_ps(v, acc[m]);
    store_row16(y + (m0 + m) * ldy, n0, n, v, bias);
  }
}

// Many rows (a prefill chunk, a batch's decode step): each sub-block unpacked once for the call
// (weights16, scales16) into the thread's PanelScratch (the AMX tiles take the same), and every
// KMR_MANY rows read it back from cache, where ktile unpacks it again for every KMR rows. The
// same integer sums and float operations, in the same order per output, as ktile: the same
// numbers bit for bit. Worth it only where unpacking costs: the kinds with high-bit planes, from
// 32 rows (Qwen2.5-shaped 2048 x 1536, 2-core Xeon, AMX off, GMAC/s: Q6_K 168 -> 178 at 32 rows,
// 163 -> 195 at 128; Q5_K 171 -> 179, 151 -> 211; at 16 rows, and for Q4_K at any, it lost).
#define RS_KSCRATCH 1
constexpr int64_t KMR_MANY = 8, KSCRATCH_MIN_ROWS = 32;
constexpr bool kscratch_kind(int f) { return FMTS[f].hbits > 0; }

template <int F>
void kfill(const uint8_t* panel, int64_t nb, PanelScratch& pan) {
  constexpr Fmt fm = FMTS[F];
  pan.reserve(nb * fm.subs());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * fm.rec();
    for (int64_t i = 0; i < fm.subs(); ++i) {
      const uint8_t* sub = rec + fm.header + i * fm.sub();
      const int64_t j = b * fm.subs() + i;
      __m512i w[8];
      weights16<F>(sub, w);
      for (int c = 0; c < 8; ++c) _mm512_store_si512(pan.tile(j) + 64 * c, w[c]);
      __m512 a0, a1, off;
      scales16<F>(rec, sub, a0, a1, off);
      _mm512_storeu_ps(pan.scales(j), a0);
      _mm512_storeu_ps(pan.scales(j) + 16, a1);
      _mm512_storeu_ps(pan.scales(j) + 32, off);
    }
  }
}

template <int F, int MR, bool W, typename O>
void ktile_scratch(const PanelScratch& pan, int64_t kb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy,
                   int64_t n0, int64_t n) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kb; ++j) {
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_load_si512(pan.tile(j) + 64 * c);
    const float* sc = pan.scales(j);
    const __m512 a0 = _mm512_loadu_ps(sc), a1 = _mm512_loadu_ps(sc + 16), off = _mm512_loadu_ps(sc + 32);
    for (int m = 0; m < MR; ++m) ksub16<F, W>(w, xr, (m0 + m) * kb + j, a0, a1, off, acc[m]);
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float v[QPANEL];
    _mm512_store_ps(v, acc[m]);
    store_row16(y + (m0 + m) * ldy, n0, n, v, bias);
  }
}

constexpr bool HAS_VEC_KTILE = true;
#elif defined(__AVX2__)
constexpr int64_t KMR = 4;

// A chunk's e_j for nibble bytes 32h .. 32h + 31, one per byte (plane_e, 32 at a time).
template <int HB>
inline __m256i plane32(const uint8_t* plane, int h) {
  if constexpr (HB == 2) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)plane);
    return _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
  } else {  // bytes 32h + 16q' .. from the plane's bits 2(2h + q')
    const __m128i v = _mm_loadu_si128((const __m128i*)plane);
    const __m256i b = _mm256_set_m128i(_mm_srli_epi16(v, 4 * h + 2), _mm_srli_epi16(v, 4 * h));
    return _mm256_and_si256(b, _mm256_set1_epi8(3));
  }
}

// As quant_linear.cpp's AVX2 tile: vpmaddubsw + vpmaddwd with a power-of-two weight, so the
// integer sums are exactly the VNNI path's (q <= 63: a pair is at most 2 * 63 * 128 = 16128).
inline __m256i dot_q(__m256i w, int32_t x4, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)), scale);
}

// The super-block's d (and dmin) of outputs 8h .. 8h + 7 from the K-quants' header, once per
// record for all its sub-blocks (Q5_0 and Q5_1 have none: their scales are per sub-block).
struct Head8 {
  __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
};

template <int F>
inline Head8 head8(const uint8_t* rec, int h) {
  Head8 hd;
  if constexpr (FMTS[F].header > 0) {
    hd.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16 * h)));
    if constexpr (F != Q6_K) hd.dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 32 + 16 * h)));
  }
  return hd;
}

template <int F>
inline void scales8(Head8 hd, const uint8_t* sub, int h, __m256& a0, __m256& a1, __m256& off) {
  const uint8_t* sc = sub + 256 + 64 * FMTS[F].hbits;
  off = _mm256_setzero_ps();
  auto f16 = [&](const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h))); };
  auto u8 = [&](const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h)))); };
  auto i8 = [&](const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h)))); };
  if constexpr (F == Q5_0 || F == Q5_1) {
    a0 = a1 = f16(sc);
    if constexpr (F == Q5_1) off = f16(sc + 32);
    return;
  }
  if constexpr (F == Q6_K) {
    a0 = _mm256_mul_ps(hd.d, i8(sc));
    a1 = _mm256_mul_ps(hd.d, i8(sc + 16));
    return;
  }
  a0 = a1 = _mm256_mul_ps(hd.d, u8(sc));
  off = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(hd.dmin, u8(sc + 16)));
}

// A sub-block's integer sums for one row at 8 bits: vpmaddubsw's pair sums added in 16 bits
// before one vpmaddwd, four chunks at a time for values of at most 5 bits (4 * 2 * 31 * 127 =
// 31496) and two for q6_k's 6 (2 * 2 * 63 * 127 = 32004): the same integers as one vpmaddwd
// per chunk, in half the instructions.
template <int HB>
inline void dot_sub8(const __m256i* w, const int32_t* x, __m256i ones, __m256i& s0, __m256i& s1) {
  auto p = [&](int c) { return _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x[c])); };
  if constexpr (HB < 2) {
    s0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3))), ones);
    s1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7))), ones);
  } else {
    s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p(0), p(1)), ones),
                          _mm256_madd_epi16(_mm256_add_epi16(p(2), p(3)), ones));
    s1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p(4), p(5)), ones),
                          _mm256_madd_epi16(_mm256_add_epi16(p(6), p(7)), ones));
  }
}

// The 8 weight vectors of outputs 8h .. 8h + 7 in one sub-block.
template <int F>
inline void weights8(const uint8_t* sub, int h, __m256i* w) {
  constexpr Fmt fm = FMTS[F];
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(sub + 64 * c + 32 * h));
    w[c] = _mm256_and_si256(v, low);
    w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (fm.hbits == 2) {  // plane byte i: e_i (L's bits 0-1, H's 2-3), e_{i+32} above: each to bits 4-5
      const __m256i e = _mm256_loadu_si256((const __m256i*)plane_at(sub, 2, c)), top = _mm256_set1_epi8(0x30);
      const __m256i el = h ? e : _mm256_slli_epi16(e, 4), eh = h ? _mm256_srli_epi16(e, 2) : _mm256_slli_epi16(e, 2);
      w[c] = _mm256_or_si256(w[c], _mm256_and_si256(el, top));  // (16-bit shifts: what crosses a byte is masked off)
      w[4 + c] = _mm256_or_si256(w[4 + c], _mm256_and_si256(eh, top));
    } else if constexpr (fm.hbits > 0) {
      const __m256i e = plane32<fm.hbits>(plane_at(sub, fm.hbits, c), h);
      constexpr int lo_mask = (1 << fm.hbits) - 1;
      w[c] = _mm256_or_si256(w[c], _mm256_slli_epi16(_mm256_and_si256(e, _mm256_set1_epi8(lo_mask)), 4));
      w[4 + c] = _mm256_or_si256(w[4 + c], _mm256_slli_epi16(_mm256_and_si256(e, _mm256_set1_epi8(lo_mask << fm.hbits)), 4 - fm.hbits));
    }
  }
}

// One row's sub-block `at` against the half's weights: acc += its scaled sums.
template <int F, bool W>
inline void ksub8(const __m256i* w, const QuantRows& xr, int64_t at, __m256 a0, __m256 a1, __m256 off, __m256& acc) {
  constexpr int Z = F == Q5_0 ? 16 : F == Q6_K ? 32 : 0;
  const __m256i x1 = _mm256_set1_epi16(1);
  const int32_t* hi = reinterpret_cast<const int32_t*>(xr.hi.data() + at * QBLOCK);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0;
  if constexpr (W) {
    const __m256i x256 = _mm256_set1_epi16(256);
    const int32_t* lo = reinterpret_cast<const int32_t*>(xr.lo.data() + at * QBLOCK);
    for (int c = 0; c < 4; ++c) {
      s0 = _mm256_add_epi32(s0, _mm256_add_epi32(dot_q(w[c], hi[c], x256), dot_q(w[c], lo[c], x1)));
      s1 = _mm256_add_epi32(s1, _mm256_add_epi32(dot_q(w[4 + c], hi[4 + c], x256), dot_q(w[4 + c], lo[4 + c], x1)));
    }
  } else {
    dot_sub8<FMTS[F].hbits>(w, hi, x1, s0, s1);
  }
  const __m256 dx = _mm256_set1_ps(xr.dx[at]);
  if constexpr (Z != 0) {
    const __m256i z0 = _mm256_set1_epi32(Z * xr.sq0[at]), z1 = _mm256_set1_epi32(Z * (xr.sq[at] - xr.sq0[at]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s0, z0)), _mm256_mul_ps(a0, dx), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s1, z1)), _mm256_mul_ps(a1, dx), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(a0, dx), acc);
    acc = _mm256_fmadd_ps(off, _mm256_set1_ps(xr.sx[at]), acc);
  }
}

// MR rows by the panel's 16 outputs. Up to 2 rows (decode) both halves of each sub-block go
// together, so the weights stream through once; 3 or 4 rows (prefill) take one half of the
// panel at a time over the whole K, so the rows' accumulators, the half's eight weight vectors
// and its scales fit the 16 registers (a half is 32 bytes of each 64-byte line: the second
// pass finds the panel in cache).
template <int F, int MR, bool W, typename O>
void ktile(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy, int64_t n0,
           int64_t n) {
  constexpr Fmt fm = FMTS[F];
  const int64_t kb = nb * fm.subs();
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
  constexpr int passes = MR <= 2 ? 1 : 2;
  for (int pass = 0; pass < passes; ++pass) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = panel + b * fm.rec();
      const Head8 hd[2] = {head8<F>(rec, 0), head8<F>(rec, 1)};
      for (int64_t i = 0; i < fm.subs(); ++i) {
        const uint8_t* sub = rec + fm.header + i * fm.sub();
        prefetch_l2(sub + QPREFETCH * fm.sub(), fm.sub());
        for (int h = passes == 1 ? 0 : pass; h < (passes == 1 ? 2 : pass + 1); ++h) {
          __m256i w[8];
          weights8<F>(sub, h, w);
          __m256 a0, a1, off;
          scales8<F>(hd[h], sub, h, a0, a1, off);
          for (int m = 0; m < MR; ++m) ksub8<F, W>(w, xr, (m0 + m) * kb + b * fm.subs() + i, a0, a1, off, acc[h][m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) store_halves16(y + (m0 + m) * ldy, n0, n, acc[0][m], acc[1][m], bias);
}

// Many rows (a prefill chunk, a batch's decode step): each sub-block's halves are unpacked once
// for the call (weights8, scales8) into the thread's PanelScratch, and every KMR_MANY (here KMR)
// rows read them back from cache, where ktile unpacks them again for every KMR rows. The same
// integer sums and float operations, in the same order per output, as ktile: the same numbers
// bit for bit. From 16 rows (Qwen2.5-shaped 2048 x 1536, 2-core Xeon, GMAC/s at 16 / 32 / 128
// rows: Q4_K 115 -> 118, 111-123 -> 132, 116 -> 142; Q6_K 80 -> 93, 85 -> 103, 81 -> 110; at 8
// rows Q4_K lost).
#define RS_KSCRATCH 1
constexpr int64_t KMR_MANY = KMR, KSCRATCH_MIN_ROWS = 4 * KMR;
constexpr bool kscratch_kind(int) { return true; }

template <int F>
void kfill(const uint8_t* panel, int64_t nb, PanelScratch& pan) {
  constexpr Fmt fm = FMTS[F];
  pan.reserve(nb * fm.subs());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = panel + b * fm.rec();
    for (int64_t i = 0; i < fm.subs(); ++i) {
      const uint8_t* sub = rec + fm.header + i * fm.sub();
      const int64_t j = b * fm.subs() + i;
      for (int h = 0; h < 2; ++h) {
        __m256i w[8];
        weights8<F>(sub, h, w);
        for (int c = 0; c < 8; ++c) _mm256_store_si256((__m256i*)(pan.tile(j) + 256 * h + 32 * c), w[c]);
        __m256 a0, a1, off;
        scales8<F>(head8<F>(rec, h), sub, h, a0, a1, off);
        float* sc = pan.scales(j) + 24 * h;
        _mm256_storeu_ps(sc, a0);
        _mm256_storeu_ps(sc + 8, a1);
        _mm256_storeu_ps(sc + 16, off);
      }
    }
  }
}

template <int F, int MR, bool W, typename O>
void ktile_scratch(const PanelScratch& pan, int64_t kb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy,
                   int64_t n0, int64_t n) {
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kb; ++j) {
      __m256i w[8];
      for (int c = 0; c < 8; ++c) w[c] = _mm256_load_si256((const __m256i*)(pan.tile(j) + 256 * h + 32 * c));
      const float* sc = pan.scales(j) + 24 * h;
      const __m256 a0 = _mm256_loadu_ps(sc), a1 = _mm256_loadu_ps(sc + 8), off = _mm256_loadu_ps(sc + 16);
      for (int m = 0; m < MR; ++m) ksub8<F, W>(w, xr, (m0 + m) * kb + j, a0, a1, off, acc[h][m]);
    }
  }
  for (int m = 0; m < MR; ++m) store_halves16(y + (m0 + m) * ldy, n0, n, acc[0][m], acc[1][m], bias);
}

constexpr bool HAS_VEC_KTILE = true;
#else
constexpr bool HAS_VEC_KTILE = false;
#endif

#if defined(RS_KSCRATCH)
// Rows m0 .. m0 + rows (1 <= rows <= R) on the scratch tile of that many rows.
template <int F, int R, bool W, typename O>
inline void ktile_scratch_rows(int64_t rows, const PanelScratch& pan, int64_t kb, const QuantRows& xr, int64_t m0, const float* bias,
                               O* y, int64_t ldy, int64_t n0, int64_t n) {
  if constexpr (R > 1)
    if (rows < R) return ktile_scratch_rows<F, R - 1, W>(rows, pan, kb, xr, m0, bias, y, ldy, n0, n);
  ktile_scratch<F, R, W>(pan, kb, xr, m0, bias, y, ldy, n0, n);
}

// The build's fill (kfill) once for the panel, then its scratch tiles KMR_MANY rows at a time.
template <int F, bool W, typename O>
void ktiles_scratch(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy,
                    int64_t n0, int64_t n) {
  PanelScratch& pan = panel_scratch();
  kfill<F>(panel, nb, pan);
  const int64_t kb = nb * FMTS[F].subs();
  for (int64_t m0 = 0; m0 < m; m0 += KMR_MANY)
    ktile_scratch_rows<F, KMR_MANY, W>(std::min<int64_t>(KMR_MANY, m - m0), pan, kb, xr, m0, bias, y, ldy, n0, n);
}
#endif

#if defined(RS_INT_DOT)
template <int F, bool W, typename O>
void ktiles(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
            int64_t n) {
  for (int64_t m0 = 0; m0 < m; m0 += KMR) {
    switch (std::min<int64_t>(KMR, m - m0)) {
      case 1: ktile<F, 1, W>(panel, nb, xr, m0, bias, y, ldy, n0, n); break;
      case 2: ktile<F, 2, W>(panel, nb, xr, m0, bias, y, ldy, n0, n); break;
      case 3: ktile<F, 3, W>(panel, nb, xr, m0, bias, y, ldy, n0, n); break;
      default: ktile<F, KMR, W>(panel, nb, xr, m0, bias, y, ldy, n0, n); break;
    }
  }
}
#endif

#if defined(RS_AMX)
// A panel's sub-blocks into the tiles' scratch (amx.h): the VNNI tile's weight vectors and scales.
template <int F, typename O>
void amx_kpanel(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
                int64_t n) {
  constexpr Fmt fm = FMTS[F];
  constexpr int Z = F == Q5_0 ? 16 : F == Q6_K ? 32 : 0;
  const int64_t kb = nb * fm.subs();
  PanelScratch& pan = panel_scratch();
  kfill<F>(panel, nb, pan);
  amx_rows_of<Z, Z != 0, Z == 0>(pan, kb, xr, m, bias, y, ldy, n0, n);
}
#endif

template <int F, typename O>
void kpanel(const uint8_t* panel, int64_t nb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
            int64_t n, bool vector) {
#if defined(RS_AMX)
  if (vector && xr.tiles) {
    amx_kpanel<F>(panel, nb, xr, m, bias, y, ldy, n0, n);
    return;
  }
#endif
#if defined(RS_KSCRATCH)
  if (vector && m >= KSCRATCH_MIN_ROWS && kscratch_kind(F)) {
    if (xr.wide) ktiles_scratch<F, true>(panel, nb, xr, m, bias, y, ldy, n0, n);
    else ktiles_scratch<F, false>(panel, nb, xr, m, bias, y, ldy, n0, n);
    return;
  }
#endif
#if defined(RS_INT_DOT)
  if (vector) {
    if (xr.wide) ktiles<F, true>(panel, nb, xr, m, bias, y, ldy, n0, n);
    else ktiles<F, false>(panel, nb, xr, m, bias, y, ldy, n0, n);
    return;
  }
#endif
  ktile_generic<F>(panel, nb, xr, m, bias, y, ldy, n0, n);
}

// Panel p (outputs 16p ..) of a packed weight of format f times xr's m rows, into y (m, n; rows
// ldy apart).
template <typename O>
void kfamily_panel_of(int f, const at::Tensor& packed, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy,
                      int64_t n, int64_t p, bool vector) {
  const int64_t nb = packed.size(1);
  const uint8_t* panel = packed.data_ptr<uint8_t>() + p * nb * packed.size(2);
  switch (f) {
    case Q5_0: kpanel<Q5_0>(panel, nb, xr, m, bias, y, ldy, p * QPANEL, n, vector); break;
    case Q5_1: kpanel<Q5_1>(panel, nb, xr, m, bias, y, ldy, p * QPANEL, n, vector); break;
    case Q4_K: kpanel<Q4_K>(panel, nb, xr, m, bias, y, ldy, p * QPANEL, n, vector); break;
    case Q5_K: kpanel<Q5_K>(panel, nb, xr, m, bias, y, ldy, p * QPANEL, n, vector); break;
    default: kpanel<Q6_K>(panel, nb, xr, m, bias, y, ldy, p * QPANEL, n, vector); break;
  }
}

template <typename O>
void kfamily_impl(int f, const at::Tensor& packed, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t n, bool vector) {
  parallel_dynamic((n + QPANEL - 1) / QPANEL, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) kfamily_panel_of(f, packed, xr, m, bias, y, n, n, p, vector);
  });
}

}  // namespace

int kfamily_of_kind(const std::string& kind) {
  for (int f = 0; f < NFMT; ++f)
    if (kind == FMTS[f].name) return f;
  return -1;
}

int kfamily_of_record(int64_t bytes) {
  for (int f = 0; f < NFMT; ++f)
    if (bytes == FMTS[f].rec()) return f;
  return -1;
}

int64_t kfamily_block(int f) { return FMTS[f].block; }

// GGUF blocks (n, k/block * block bytes) -> panels (ceil(n/16), k/block, record bytes).
at::Tensor pack_kfamily(const at::Tensor& raw, int f, int64_t n, int64_t k) {
  const Fmt& fm = FMTS[f];
  TORCH_CHECK(k % fm.block == 0, "pack_quant: k must be a multiple of ", fm.block, " for ", fm.name, ", got ", k);
  const int64_t nb = k / fm.block;
  auto rc = raw.contiguous();
  TORCH_CHECK(rc.scalar_type() == at::kByte && rc.numel() == n * nb * fm.src_bytes, "pack_quant: ", n, " rows of ", nb, " ",
              fm.name, " blocks (", n * nb * fm.src_bytes, " bytes), got ", rc.numel());
  auto out = at::zeros({(n + QPANEL - 1) / QPANEL, nb, fm.rec()}, rc.options());
  const uint8_t* src = rc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  switch (f) {
    case Q5_0: pack_impl<Q5_0>(src, n, nb, dst); break;
    case Q5_1: pack_impl<Q5_1>(src, n, nb, dst); break;
    case Q4_K: pack_impl<Q4_K>(src, n, nb, dst); break;
    case Q5_K: pack_impl<Q5_K>(src, n, nb, dst); break;
    default: pack_impl<Q6_K>(src, n, nb, dst); break;
  }
  return out;
}

// The fp32 rows `ip` of a packed weight, bit for bit gguf-py's dequantization. Every row in
// order (a prefill's whole weight) goes panel by panel, each sub-block's values unpacked once
// for its 16 outputs; a few rows (an embedding lookup) go one by one.
void dequant_kfamily(const at::Tensor& packed, int f, int64_t k, const int64_t* ip, int64_t count, float* od) {
  const Fmt& fm = FMTS[f];
  const int64_t nb = packed.size(1);
  const uint8_t* pd = packed.data_ptr<uint8_t>();
  bool all = true;
  for (int64_t i = 0; i < count && all; ++i) all = ip[i] == i;
  auto one_sub = [&](const uint8_t* rec, const uint8_t* sub, const uint8_t (*q)[32], int64_t lane, float* o) {
    const Lane l = lane_scales(f, rec, sub, lane);
    for (int j = 0; j < 32; ++j)  // d*q exact, then one rounding (as gguf-py)
      o[j] = l.z ? (j < 16 ? l.a0 : l.a1) * float(int(q[lane][j]) - l.z) : l.a0 * float(q[lane][j]) + l.off;
  };
  const int64_t items = all ? (count + QPANEL - 1) / QPANEL : count;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    uint8_t q[QPANEL][32];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t p = all ? it : ip[it] / QPANEL;
      const int64_t lane0 = all ? 0 : ip[it] % QPANEL, lanes = all ? std::min<int64_t>(QPANEL, count - p * QPANEL) : 1;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rec = pd + (p * nb + b) * fm.rec();
        for (int64_t s = 0; s < fm.subs(); ++s) {
          const uint8_t* sub = rec + fm.header + s * fm.sub();
          unpack_sub(sub, fm.hbits, q);
          for (int64_t l = 0; l < lanes; ++l)
            one_sub(rec, sub, q, lane0 + l, od + ((all ? p * QPANEL + l : it) * k) + b * fm.block + 32 * s);
        }
      }
    }
  });
}

// Panel p (outputs 16p ..) of a packed weight of format f times xr's m rows, plus bias, into y
// (m, n; rows ldy apart): see quant.h.
template <typename O>
void kfamily_panel(const at::Tensor& packed, int f, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n,
                   int64_t p, bool generic) {
  kfamily_panel_of(f, packed, xr, m, bias, y, ldy, n, p, HAS_VEC_KTILE && !generic);
}
template void kfamily_panel<float>(const at::Tensor&, int, const QuantRows&, int64_t, const float*, float*, int64_t, int64_t, int64_t,
                                   bool);
template void kfamily_panel<uint16_t>(const at::Tensor&, int, const QuantRows&, int64_t, const float*, uint16_t*, int64_t, int64_t,
                                      int64_t, bool);

// y (M, n) = the quantized rows xr times a packed weight of format f, plus bias.
void qlinear_kfamily(const at::Tensor& packed, int f, const QuantRows& xr, int64_t m, const float* bias, at::Tensor& y, int64_t n,
                     bool generic) {
  const bool vector = HAS_VEC_KTILE && !generic;
  if (y.scalar_type() == at::kFloat) kfamily_impl(f, packed, xr, m, bias, y.data_ptr<float>(), n, vector);
  else kfamily_impl(f, packed, xr, m, bias, ptr<uint16_t>(y), n, vector);
}

}  // namespace rs
