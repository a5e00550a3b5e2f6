// Quantized linears: GGUF Q4_0 / Q4_1 / Q8_0 / MXFP4 (and radixserve's own int4 / int8) weights kept
// in their blocks, repacked once into panels of 16 outputs. Torch references:
// radixserve_kernels.quant_matmul.dequant_ref (the packed layout), gguf-py's dequantize (the values), and
// tests/test_quant.py's reference_qlinear (the 16-bit-activation dot product).
#include <algorithm>

#include "amx.h"
#include "quant.h"

#if defined(RS_AMX)
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#endif

namespace rs {
namespace {

// --- quantized linears (GGUF Q4_0 / Q4_1 / Q8_0, and radixserve's own int4 / int8) ---------
// Weights stay in their blocks of 32 along k, each with fp16 scales, repacked once
// (pack_quant) into panels of 16 outputs so one 64-byte load feeds 16 outputs:
//   4-bit, 320 bytes per (panel, block): 256 bytes of nibbles, then 16 fp16 d, then 16 fp16 m.
//           Byte 64c + 4n + r holds output n's weight 4c + r (low nibble) and 16 + 4c + r
//           (high nibble), q in [0, 15]: w = d*q + m (Q4_0 becomes m = -8d, exactly).
//   8-bit, 544 bytes: 512 bytes q + 128 (byte 64c + 4n + r: weight 4c + r), then 16 fp16 d:
//           w = d*q.
//   MXFP4 (gpt-oss's experts), 336 bytes: the 4-bit layout (then 16 bytes of padding, which
//           tell the format) with each nibble standing for FP4_LUT[nibble] (the e2m1 value,
//           doubled, plus 12: 0 .. 24, unsigned as the kernels' weights are): w = d*u + m with
//           d = the block's E8M0 scale 2^(e - 128) and m = -12d, both exact in fp16 for
//           104 <= e <= 140 (other scales are refused: the caller dequantizes that tensor).
// The block bytes are GGUF's own, so the repack is exact and dequant_quant reproduces
// gguf-py's dequantization bit for bit (d*q is exact in fp32, then one rounding for + m).
// qlinear works in integers, as llama.cpp does on CPU: each row's activations are quantized per
// block of 32 (to 8 or 16 bits, see QuantRows), and every block's dot product is an integer sum
// of u8 x s8 products (vpdpbusd), scaled by d * dx. (models/quant.py decides which calls take it:
// prefill may dequantize the weight once per call and run fp32 GEMM instead.)
constexpr int64_t Q4_BYTES = 320, Q8_BYTES = 544, FP4_BYTES = 336;
// e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled, plus 12
constexpr uint8_t FP4_LUT[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

inline uint16_t float_to_half_exact(float f) {  // only for values fp16 holds exactly (-8 * an fp16 d)
  return at::Half(f).x;
}

bool fp4_zeros(const uint8_t* qs) {  // an MXFP4 block's 16 bytes of nibbles all +0 or -0
  for (int j = 0; j < 16; ++j)
    if ((qs[j] & 0x7) || (qs[j] & 0x70)) return false;
  return true;
}

int64_t quant_bits(const std::string& kind) {
  if (kind == "q4_0" || kind == "q4_1" || kind == "mxfp4") return 4;
  if (kind == "q8_0") return 8;
  TORCH_CHECK(false, "pack_quant: kind must be q4_0, q4_1, q8_0, mxfp4, q5_0, q5_1, q4_k, q5_k or q6_k, got ", kind);
}

}  // namespace

#if defined(RS_AMX)
namespace {
// RADIXSERVE_AMX=0: the VNNI tiles only (to measure what the tiles change)
std::atomic<bool> amx_on{[] {
  const char* v = std::getenv("RADIXSERVE_AMX");
  return !(v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "no") == 0));
}()};
}

bool amx_ready() {
  static const bool granted = [] {  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return granted && amx_on.load(std::memory_order_relaxed);
}

bool amx_rows_for(int64_t m) { return m >= AMX_MIN_ROWS && amx_ready(); }
#endif

// Whether the AMX tiles may run (only where built: amx.h); off: the VNNI tiles, as on CPUs without.
bool set_amx(bool on) {
#if defined(RS_AMX)
  amx_on = on;
  return amx_ready();
#else
  (void)on;
  return false;
#endif
}

// GGUF blocks (n, k/32 * block bytes) -> panels (ceil(n/16), k/32, 320, 336 or 544).
at::Tensor pack_quant(at::Tensor raw, const std::string& kind, int64_t n, int64_t k) {
  if (const int f = kfamily_of_kind(kind); f >= 0) return pack_kfamily(raw, f, n, k);
  const int64_t bits = quant_bits(kind);
  TORCH_CHECK(k % QBLOCK == 0, "pack_quant: k must be a multiple of 32, got ", k);
  const bool fp4 = kind == "mxfp4";
  const int64_t kb = k / QBLOCK, src_block = kind == "q4_0" ? 18 : kind == "q4_1" ? 20 : fp4 ? 17 : 34;
  auto rc = raw.contiguous();
  TORCH_CHECK(rc.scalar_type() == at::kByte && rc.numel() == n * kb * src_block,
              "pack_quant: ", n, " rows of ", kb, " ", kind, " blocks (", n * kb * src_block, " bytes), got ", rc.numel());
  const int64_t panels = (n + QPANEL - 1) / QPANEL, bytes = bits == 4 ? (fp4 ? FP4_BYTES : Q4_BYTES) : Q8_BYTES;
  auto out = at::zeros({panels, kb, bytes}, rc.options());
  const uint8_t* src = rc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (fp4) {  // every scale in fp16's exact range (a block of zeros takes any), before anything is written
    for (int64_t i = 0; i < n * kb; ++i) {
      const int e = src[i * src_block];
      TORCH_CHECK((e >= 104 && e <= 140) || fp4_zeros(src + i * src_block + 1), "pack_quant: an mxfp4 block's scale 2^", e - 128,
                  " is outside what fp16 holds exactly");
    }
  }
  if (bits == 8) {  // padding rows: q + 128 = 128 (and d = 0)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t b = 0; b < kb; ++b) std::memset(dst + (p * kb + b) * bytes, 128, 512);
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = r / QPANEL, lane = r % QPANEL;
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* s = src + (r * kb + b) * src_block;
        uint8_t* o = dst + (p * kb + b) * bytes;
        uint16_t d;
        if (fp4) {  // (a block of zeros outside the range: scale 1)
          d = float_to_half_exact(std::ldexp(1.f, fp4_zeros(s + 1) ? 0 : int(s[0]) - 128));
          const uint16_t m = float_to_half_exact(-12.f * half_to_float(d));
          for (int j = 0; j < 16; ++j) o[(j / 4) * 64 + lane * 4 + j % 4] = s[1 + j];
          std::memcpy(o + 256 + 2 * lane, &d, 2);
          std::memcpy(o + 288 + 2 * lane, &m, 2);
          continue;
        }
        std::memcpy(&d, s, 2);
        if (bits == 8) {
          for (int j = 0; j < 32; ++j) o[(j / 4) * 64 + lane * 4 + j % 4] = uint8_t(int(int8_t(s[2 + j])) + 128);
          std::memcpy(o + 512 + 2 * lane, &d, 2);
          continue;
        }
        uint16_t m;
        const uint8_t* qs = s + (kind == "q4_1" ? 4 : 2);
        if (kind == "q4_1") std::memcpy(&m, s + 2, 2);
        else m = float_to_half_exact(-8.f * half_to_float(d));
        for (int j = 0; j < 16; ++j)  // qs[j]: weight j (low nibble) and j + 16 (high)
          o[(j / 4) * 64 + lane * 4 + j % 4] = qs[j];
        std::memcpy(o + 256 + 2 * lane, &d, 2);
        std::memcpy(o + 288 + 2 * lane, &m, 2);
      }
    }
  });
  return out;
}

namespace {

// The packed weight's format: -1 for Q4/Q8 panels (quant_linear.cpp), else a kfamily format.
int check_quant(const at::Tensor& packed, int64_t n, int64_t k) {
  const bool shaped = packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3;
  const int f = shaped ? kfamily_of_record(packed.size(2)) : -1;
  const int64_t block = f >= 0 ? kfamily_block(f) : QBLOCK;
  TORCH_CHECK(shaped && (f >= 0 || packed.size(2) == Q4_BYTES || packed.size(2) == FP4_BYTES || packed.size(2) == Q8_BYTES) &&
                  packed.size(0) * QPANEL >= n &&
                  packed.size(1) * block >= k && (packed.size(1) - 1) * block < k && (f < 0 || k % block == 0),
              "a weight packed by pack_quant for this n and k");
  return f;
}

}  // namespace

// The fp32 weight rows `rows` (all when empty) of a packed weight: gguf-py's numbers.
at::Tensor dequant_quant(at::Tensor packed, int64_t n, int64_t k, c10::optional<at::Tensor> rows) {
  const int f = check_quant(packed, n, k);
  const int64_t kb = packed.size(1), bytes = packed.size(2);
  at::Tensor idx = rows.has_value() ? rows->contiguous() : at::arange(n, at::kLong);
  TORCH_CHECK(idx.scalar_type() == at::kLong, "dequant_quant: int64 rows");
  const int64_t count = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "dequant_quant: row ", ip[i], " out of range");
  auto out = at::empty({count, k}, at::kFloat);
  float* od = out.data_ptr<float>();
  if (f >= 0) {
    dequant_kfamily(packed, f, k, ip, count, od);
    return out;
  }
  const uint8_t* pd = packed.data_ptr<uint8_t>();
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = ip[i], p = r / QPANEL, lane = r % QPANEL;
      float* orow = od + i * k;
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* blk = pd + (p * kb + b) * bytes;
        uint16_t dh;
        std::memcpy(&dh, blk + (bytes == Q8_BYTES ? 512 : 256) + 2 * lane, 2);
        const float d = half_to_float(dh);
        const int64_t lim = std::min<int64_t>(QBLOCK, k - b * QBLOCK);
#if defined(RS_AVX512)
        // the scalar loops below, 16 weights at a time: row `lane`'s 4 bytes of each 64-byte
        // chunk are its next 4 weights (and, in the high nibbles, the 4 after the first 16)
        const __mmask16 m0 = lim >= 16 ? __mmask16(0xffff) : __mmask16((1u << lim) - 1);
        const __mmask16 m1 = lim >= 32 ? __mmask16(0xffff) : lim > 16 ? __mmask16((1u << (lim - 16)) - 1) : __mmask16(0);
        auto quads = [&](int c0) {  // the 16 bytes at 64c + 4*lane, c = c0 .. c0 + 3
          int32_t q[4];
          for (int c = 0; c < 4; ++c) std::memcpy(&q[c], blk + 64 * (c0 + c) + 4 * lane, 4);
          return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
        };
        const __m512 dv = _mm512_set1_ps(d);
        if (bytes == Q8_BYTES) {
          for (int half = 0; half < 2; ++half) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(quads(4 * half), _mm512_set1_epi32(128)));
            _mm512_mask_storeu_ps(orow + b * QBLOCK + 16 * half, half ? m1 : m0, _mm512_mul_ps(dv, q));
          }
          continue;
        }
        uint16_t mbits;
        std::memcpy(&mbits, blk + 288 + 2 * lane, 2);
        const __m512 mv = _mm512_set1_ps(half_to_float(mbits));
        const __m512i bytes16 = quads(0);
        __m512i lo_q = _mm512_and_si512(bytes16, _mm512_set1_epi32(0xf)), hi_q = _mm512_srli_epi32(bytes16, 4);
        if (bytes == FP4_BYTES) {  // (the 32-bit lanes index the table)
          const __m512i lut = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)FP4_LUT));
          lo_q = _mm512_permutexvar_epi32(lo_q, lut);
          hi_q = _mm512_permutexvar_epi32(hi_q, lut);
        }
        const __m512 lo = _mm512_cvtepi32_ps(lo_q), hi = _mm512_cvtepi32_ps(hi_q);
        _mm512_mask_storeu_ps(orow + b * QBLOCK, m0, _mm512_add_ps(_mm512_mul_ps(dv, lo), mv));  // d*q exact, then one rounding
        _mm512_mask_storeu_ps(orow + b * QBLOCK + 16, m1, _mm512_add_ps(_mm512_mul_ps(dv, hi), mv));
        continue;
#endif
        if (bytes == Q8_BYTES) {
          for (int64_t j = 0; j < lim; ++j) orow[b * QBLOCK + j] = d * float(int(blk[(j / 4) * 64 + lane * 4 + j % 4]) - 128);
          continue;
        }
        uint16_t mh;
        std::memcpy(&mh, blk + 288 + 2 * lane, 2);
        const float m = half_to_float(mh);
        for (int64_t j = 0; j < lim; ++j) {
          const uint8_t byte = blk[((j % 16) / 4) * 64 + lane * 4 + j % 4], nib = j < 16 ? byte & 0xf : byte >> 4;
          const float q = float(bytes == FP4_BYTES ? FP4_LUT[nib] : nib);
          const float dq = d * q;  // exact; then one rounding, as gguf-py's (d * q) + m
          orow[b * QBLOCK + j] = dq + m;
        }
      }
    }
  });
  return out;
}

namespace {

// Activations: see QuantRows (quant.h).
#if defined(RS_AVX512)
inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#elif defined(RS_AVX2)
// Eight values of a block, zeros past `lim` (a last block shorter than 32).
inline __m256 load8_upto(const float* p, int64_t lim) {
  if (lim >= 8) return _mm256_loadu_ps(p);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return lim <= 0 ? _mm256_setzero_ps() : _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(lim)), idx));
}
inline __m256 load8_upto(const uint16_t* p, int64_t lim) {
  if (lim >= 8) return vload(p).v;
  alignas(32) float v[8] = {};
  for (int64_t j = 0; j < lim; ++j) v[j] = ld(p, j);
  return _mm256_load_ps(v);
}
// 32 int32 lanes (in order) to 32 int8 (each in -128..127, so the saturating packs are exact).
inline void store32_i8(int8_t* p, const __m256i* x) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(x[0], x[1]), _mm256_packs_epi32(x[2], x[3]));
  _mm256_storeu_si256((__m256i*)p, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

}  // namespace

template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t kb, bool wide, QuantRows& out, bool tiles) {
  out.wide = wide;
  out.tiles = tiles;
  const int64_t rows = tiles ? (m + 15) / 16 * 16 : m;
  out.hi.assign(rows * kb * QBLOCK, 0);
  out.lo.assign(wide ? rows * kb * QBLOCK : 0, 0);
  out.dx.assign(rows * kb, 0.f);
  out.sx.assign(rows * kb, 0.f);
  out.sq.assign(rows * kb, 0);
  out.sq0.assign(rows * kb, 0);
  const float steps = wide ? QSTEPS : QSTEPS8;
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < kb; ++b) {
        const int64_t lim = std::min<int64_t>(QBLOCK, k - b * QBLOCK), at = r * kb + b;
        const T* xr = x + r * ldx + b * QBLOCK;
        int8_t* hp = out.hi.data() + at * QBLOCK;
#if defined(RS_AVX512)
        // the scalar loop below, 32 lanes at a time (the same roundings, so the same numbers)
        const __mmask16 m0 = lim >= 16 ? __mmask16(0xffff) : __mmask16((1u << lim) - 1);
        const __mmask16 m1 = lim >= 32 ? __mmask16(0xffff) : lim > 16 ? __mmask16((1u << (lim - 16)) - 1) : __mmask16(0);
        const __m512 v0 = load16_masked(xr, m0), v1 = load16_masked(xr + 16, m1);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? steps / amax : 0.f), hi_q = _mm512_set1_ps(steps), lo_q = _mm512_set1_ps(-steps);
        const __m512i x0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, inv), lo_q), hi_q));
        const __m512i x1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, inv), lo_q), hi_q));
        if (wide) {
          const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(x0, _mm512_set1_epi32(128)), 8);
          const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(x1, _mm512_set1_epi32(128)), 8);
          int8_t* lp = out.lo.data() + at * QBLOCK;
          _mm_storeu_si128((__m128i*)hp, _mm512_cvtepi32_epi8(h0));
          _mm_storeu_si128((__m128i*)(hp + 16), _mm512_cvtepi32_epi8(h1));
          _mm_storeu_si128((__m128i*)lp, _mm512_cvtepi32_epi8(_mm512_sub_epi32(x0, _mm512_slli_epi32(h0, 8))));
          _mm_storeu_si128((__m128i*)(lp + 16), _mm512_cvtepi32_epi8(_mm512_sub_epi32(x1, _mm512_slli_epi32(h1, 8))));
        } else {
          _mm_storeu_si128((__m128i*)hp, _mm512_cvtepi32_epi8(x0));
          _mm_storeu_si128((__m128i*)(hp + 16), _mm512_cvtepi32_epi8(x1));
        }
        const int32_t s0 = _mm512_reduce_add_epi32(x0);
        finish_block(out, at, amax / steps, s0 + _mm512_reduce_add_epi32(x1), s0);
#elif defined(RS_AVX2)
        // the scalar loop below, 8 lanes at a time (the same roundings, so the same numbers)
        __m256 v[4];
        for (int c = 0; c < 4; ++c) v[c] = load8_upto(xr + 8 * c, lim - 8 * c);
        const float amax = vhmax(vmax(vmax(vabs({v[0]}), vabs({v[1]})), vmax(vabs({v[2]}), vabs({v[3]}))));
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? steps / amax : 0.f), hi_q = _mm256_set1_ps(steps), lo_q = _mm256_set1_ps(-steps);
        __m256i x[4];
        for (int c = 0; c < 4; ++c) x[c] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[c], inv), lo_q), hi_q));
        if (wide) {
          __m256i h[4], l[4];
          for (int c = 0; c < 4; ++c) {
            h[c] = _mm256_srai_epi32(_mm256_add_epi32(x[c], _mm256_set1_epi32(128)), 8);
            l[c] = _mm256_sub_epi32(x[c], _mm256_slli_epi32(h[c], 8));
          }
          store32_i8(hp, h);
          store32_i8(out.lo.data() + at * QBLOCK, l);
        } else {
          store32_i8(hp, x);
        }
        const int32_t s0 = hsum_i32(_mm256_add_epi32(x[0], x[1]));
        finish_block(out, at, amax / steps, s0 + hsum_i32(_mm256_add_epi32(x[2], x[3])), s0);
#else
        float v[QBLOCK];
        float amax = 0.f;
        for (int64_t j = 0; j < QBLOCK; ++j) {
          v[j] = j < lim ? ld(xr, j) : 0.f;
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float inv = amax > 0.f ? steps / amax : 0.f;
        int32_t sq = 0, sq0 = 0;
        for (int64_t j = 0; j < QBLOCK; ++j) {
          const int32_t xi = int32_t(std::nearbyint(std::clamp(v[j] * inv, -steps, steps)));
          if (wide) {
            const int32_t h = (xi + 128) >> 8;
            hp[j] = int8_t(h);
            out.lo[at * QBLOCK + j] = int8_t(xi - 256 * h);
          } else {
            hp[j] = int8_t(xi);
          }
          sq += xi;
          if (j == 15) sq0 = sq;
        }
        finish_block(out, at, amax / steps, sq, sq0);
#endif
      }
  });
}

template void quantize_rows<float>(const float*, int64_t, int64_t, int64_t, int64_t, bool, QuantRows&, bool);
template void quantize_rows<uint16_t>(const uint16_t*, int64_t, int64_t, int64_t, int64_t, bool, QuantRows&, bool);

namespace {


// One panel's outputs for rows [m0, m0 + mr): the portable path (and the reference the AVX-512
// path is checked against in tests, through qlinear on machines without VNNI).
template <typename O>
void qtile_generic(const uint8_t* panel, int64_t kb, int64_t bytes, const QuantRows& xr, int64_t m0, int64_t mr, const float* bias,
                   O* y, int64_t ldy, int64_t n0, int64_t n) {
  for (int64_t r = m0; r < m0 + mr; ++r) {
    float acc[QPANEL] = {0};
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t* blk = panel + b * bytes;
      int32_t q[QBLOCK];
      for (int j = 0; j < QBLOCK; ++j) q[j] = xr.value(r * kb + b, j);
      const float dx = xr.dx[r * kb + b], sx = xr.sx[r * kb + b];
      for (int64_t lane = 0; lane < QPANEL; ++lane) {
        int32_t isum = 0;
        uint16_t dh;
        if (bytes == Q8_BYTES) {
          for (int j = 0; j < 32; ++j) isum += int32_t(blk[(j / 4) * 64 + lane * 4 + j % 4]) * q[j];
          isum -= 128 * xr.sq[r * kb + b];
          std::memcpy(&dh, blk + 512 + 2 * lane, 2);
          acc[lane] += float(isum) * (half_to_float(dh) * dx);
        } else {
          for (int j = 0; j < 32; ++j) {
            const uint8_t byte = blk[((j % 16) / 4) * 64 + lane * 4 + j % 4], nib = j < 16 ? byte & 0xf : byte >> 4;
            isum += int32_t(bytes == FP4_BYTES ? FP4_LUT[nib] : nib) * q[j];
          }
          uint16_t mh;
          std::memcpy(&dh, blk + 256 + 2 * lane, 2);
          std::memcpy(&mh, blk + 288 + 2 * lane, 2);
          acc[lane] += float(isum) * (half_to_float(dh) * dx) + half_to_float(mh) * sx;
        }
      }
    }
    store_row16(y + r * ldy, n0, n, acc, bias);
  }
}

#if defined(RS_AVX512) && defined(__AVX512VNNI__)
constexpr int64_t QMR = 4;  // rows per tile: 8 weight registers + 2 per row

// LUT: MXFP4's nibbles, each looked up in FP4_LUT (vpshufb) before the dot products.
template <int MR, int BITS, bool W, bool LUT, typename O>
void qtile(const uint8_t* panel, int64_t kb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy, int64_t n0,
           int64_t n) {
  constexpr int64_t bytes = BITS == 4 ? (LUT ? FP4_BYTES : Q4_BYTES) : Q8_BYTES;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)FP4_LUT));
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk = panel + b * bytes;
    prefetch_l2(blk + QPREFETCH * bytes, bytes);  // ~5-9 KB ahead: DRAM's latency (at 3-4 rows too: without it a 4-row tile waited on memory, 1.7x slower)
    __m512i w[8];
    __m512 d, mv = _mm512_setzero_ps();
    if constexpr (BITS == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * c);
        w[c] = _mm512_and_si512(v, low);
        w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (LUT) {
          w[c] = _mm512_shuffle_epi8(lut, w[c]);
          w[4 + c] = _mm512_shuffle_epi8(lut, w[4 + c]);
        }
      }
      d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 256)));
      mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 288)));
    } else {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(blk + 64 * c);
      d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 512)));
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * kb + b;
      __m512i h0, h1;
      dot_block_vnni<W>(w, xr, at, h0, h1);
      __m512i s = _mm512_add_epi32(h0, h1);
      if constexpr (BITS == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * xr.sq[at]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xr.dx[at])), acc[m]);
      if constexpr (BITS == 4) acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xr.sx[at]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float v[QPANEL];
    _mm512_store_ps(v, acc[m]);
    store_row16(y + (m0 + m) * ldy, n0, n, v, bias);
  }
}

constexpr bool HAS_VEC_QTILE = true;
#elif defined(__AVX2__)
constexpr int64_t QMR = 4;

// One 8-output half of a panel, AVX2 (and AVX-512 without VNNI): u8 x s8 products by
// vpmaddubsw into int16 pairs, widened by vpmaddwd with a power-of-two weight, so every part
// lands in one int32 sum per output without saturating: the nibbles are at most 15, so a pair
// is at most 2 * 15 * 128 = 3840 before vpmaddwd. 4-bit: the low and high nibbles are two
// weights; 8-bit (q + 128 in a byte): the high nibble is worth 16. The activation's halves hi
// (worth 256) and lo fold in the same way, so the integer sums are exactly the VNNI path's.
inline __m256i dot_nib(__m256i w, int32_t x4, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)), scale);
}

template <int MR, int BITS, bool W, bool LUT, typename O>
void qtile(const uint8_t* panel, int64_t kb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy, int64_t n0,
           int64_t n) {
  constexpr int64_t bytes = BITS == 4 ? (LUT ? FP4_BYTES : Q4_BYTES) : Q8_BYTES;
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)FP4_LUT));
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), x1 = _mm256_set1_epi16(1), x16 = _mm256_set1_epi16(16),
                x256 = _mm256_set1_epi16(256), x4096 = _mm256_set1_epi16(4096);
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk = panel + b * bytes;
    prefetch_l2(blk + QPREFETCH * bytes, bytes);
    for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7: bytes 32h .. 32h + 31 of each 64
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + (BITS == 4 ? 256 : 512) + 16 * h)));
      __m256i s[MR];
      for (int m = 0; m < MR; ++m) s[m] = _mm256_setzero_si256();
      if constexpr (BITS == 4) {
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 * c + 32 * h));
          __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if constexpr (LUT) {  // (at most 24: a vpmaddubsw pair stays below 2 * 24 * 128)
            wl = _mm256_shuffle_epi8(lut, wl);
            wh = _mm256_shuffle_epi8(lut, wh);
          }
          for (int m = 0; m < MR; ++m) {
            const int64_t at = (m0 + m) * kb + b;
            const int32_t* hi = reinterpret_cast<const int32_t*>(xr.hi.data() + at * QBLOCK);
            if constexpr (W) {
              const int32_t* lo = reinterpret_cast<const int32_t*>(xr.lo.data() + at * QBLOCK);
              s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(dot_nib(wl, hi[c], x256), dot_nib(wh, hi[4 + c], x256)));
              s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(dot_nib(wl, lo[c], x1), dot_nib(wh, lo[4 + c], x1)));
            } else if constexpr (LUT) {
              s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(dot_nib(wl, hi[c], x1), dot_nib(wh, hi[4 + c], x1)));
            } else {  // pairs summed in 16 bits (eight of at most 2 * 15 * 127), widened once below
              s[m] = _mm256_add_epi16(s[m], _mm256_add_epi16(_mm256_maddubs_epi16(wl, _mm256_set1_epi32(hi[c])),
                                                             _mm256_maddubs_epi16(wh, _mm256_set1_epi32(hi[4 + c]))));
            }
          }
        }
        if constexpr (!W && !LUT)
          for (int m = 0; m < MR; ++m) s[m] = _mm256_madd_epi16(s[m], x1);
      } else {
        for (int c = 0; c < 8; ++c) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 * c + 32 * h));
          const __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int m = 0; m < MR; ++m) {
            const int64_t at = (m0 + m) * kb + b;
            const int32_t hi = reinterpret_cast<const int32_t*>(xr.hi.data() + at * QBLOCK)[c];
            if constexpr (W) {
              const int32_t lo = reinterpret_cast<const int32_t*>(xr.lo.data() + at * QBLOCK)[c];
              s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(dot_nib(wh, hi, x4096), dot_nib(wl, hi, x256)));
              s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(dot_nib(wh, lo, x16), dot_nib(wl, lo, x1)));
            } else {
              s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(dot_nib(wh, hi, x16), dot_nib(wl, hi, x1)));
            }
          }
        }
      }
      const __m256 mv = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 288 + 16 * h))) : _mm256_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (m0 + m) * kb + b;
        __m256i si = s[m];
        if constexpr (BITS == 8) si = _mm256_sub_epi32(si, _mm256_set1_epi32(128 * xr.sq[at]));
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d, _mm256_set1_ps(xr.dx[at])), acc[h][m]);
        if constexpr (BITS == 4) acc[h][m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xr.sx[at]), acc[h][m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) store_halves16(y + (m0 + m) * ldy, n0, n, acc[0][m], acc[1][m], bias);
}
constexpr bool HAS_VEC_QTILE = true;
#else
constexpr bool HAS_VEC_QTILE = false;
#endif

#if defined(RS_INT_DOT)
template <int BITS, bool W, bool LUT, typename O>
void qpanel(const uint8_t* panel, int64_t kb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
            int64_t n) {
  for (int64_t m0 = 0; m0 < m; m0 += QMR) {
    switch (std::min<int64_t>(QMR, m - m0)) {
      case 1: qtile<1, BITS, W, LUT>(panel, kb, xr, m0, bias, y, ldy, n0, n); break;
      case 2: qtile<2, BITS, W, LUT>(panel, kb, xr, m0, bias, y, ldy, n0, n); break;
      case 3: qtile<3, BITS, W, LUT>(panel, kb, xr, m0, bias, y, ldy, n0, n); break;
      default: qtile<4, BITS, W, LUT>(panel, kb, xr, m0, bias, y, ldy, n0, n); break;
    }
  }
}
#endif


#if defined(RS_AMX)
// A Q4 / MXFP4 / Q8 panel's blocks into the tiles' scratch (amx.h): the VNNI tile's weight
// vectors and its scales (Q4: a0 = d, off = m; Q8: a0 = d, with the zero point 128).
template <int BITS, bool LUT>
void amx_fill(const uint8_t* panel, int64_t kb, PanelScratch& pan) {
  constexpr int64_t bytes = BITS == 4 ? (LUT ? FP4_BYTES : Q4_BYTES) : Q8_BYTES;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)FP4_LUT)), low = _mm512_set1_epi8(0x0f);
  pan.reserve(kb);
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk = panel + b * bytes;
    uint8_t* t = pan.tile(b);
    if constexpr (BITS == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * c);
        __m512i wl = _mm512_and_si512(v, low), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (LUT) {
          wl = _mm512_shuffle_epi8(lut, wl);
          wh = _mm512_shuffle_epi8(lut, wh);
        }
        _mm512_storeu_si512(t + 64 * c, wl);
        _mm512_storeu_si512(t + 256 + 64 * c, wh);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 256)));
      put_scales(pan, b, d, d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 288))));
    } else {
      std::memcpy(t, blk, 512);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 512)));
      put_scales(pan, b, d, d, _mm512_setzero_ps());
    }
  }
}

template <int BITS, bool LUT, typename O>
void amx_panel(const uint8_t* panel, int64_t kb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n0,
               int64_t n) {
  PanelScratch& pan = panel_scratch();
  amx_fill<BITS, LUT>(panel, kb, pan);
  amx_rows_of<BITS == 8 ? 128 : 0, false, BITS == 4>(pan, kb, xr, m, bias, y, ldy, n0, n);
}
#endif

// Panel p (outputs 16p ..) of a Q4 / Q8 packed weight times xr's m rows, into y (m, n; rows ldy
// apart).
template <typename O>
void qpanel_of(const at::Tensor& packed, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t ldy, int64_t n, int64_t p,
               bool vector) {
  const int64_t kb = packed.size(1), bytes = packed.size(2);
  const uint8_t* panel = packed.data_ptr<uint8_t>() + p * kb * bytes;
#if defined(RS_AMX)
  if (vector && xr.tiles) {
    if (bytes == Q4_BYTES) amx_panel<4, false>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n);
    else if (bytes == FP4_BYTES) amx_panel<4, true>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n);
    else amx_panel<8, false>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n);
    return;
  }
#endif
#if defined(RS_INT_DOT)
  if (vector) {
    if (bytes == Q4_BYTES) xr.wide ? qpanel<4, true, false>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n)
                           : qpanel<4, false, false>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n);
    else if (bytes == FP4_BYTES) xr.wide ? qpanel<4, true, true>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n)
                                 : qpanel<4, false, true>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n);
    else xr.wide ? qpanel<8, true, false>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n)
                 : qpanel<8, false, false>(panel, kb, xr, m, bias, y, ldy, p * QPANEL, n);
    return;
  }
#endif
  qtile_generic(panel, kb, bytes, xr, 0, m, bias, y, ldy, p * QPANEL, n);
}

template <typename O>
void qlinear_impl(const at::Tensor& packed, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t n, bool vector) {
  parallel_dynamic((n + QPANEL - 1) / QPANEL, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) qpanel_of(packed, xr, m, bias, y, n, n, p, vector);
  });
}

}  // namespace

namespace {
// Whether m rows run on the AMX tiles (where built and granted; never on the portable path).
bool tiles_for(int64_t m, bool generic) {
#if defined(RS_AMX)
  return !generic && amx_rows_for(m);
#else
  (void)m;
  (void)generic;
  return false;
#endif
}
}  // namespace

// y (M, n) = x (M, k) W^T + bias over a pack_quant weight; y is x's dtype, or fp32; x quantized
// per block of 32 to act_bits (8 or 16, see QuantRows).
// generic: the portable C++ path even where AVX512-VNNI is built (tests compare the two).
at::Tensor qlinear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias, bool float_out,
                      bool generic, int64_t act_bits) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear: 2-d float32 or bfloat16 x, rows contiguous");
  const int64_t m = x.size(0), k = x.size(1);
  const int f = check_quant(packed, n, k);
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "qlinear: act_bits is 8 or 16, got ", act_bits);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "qlinear: a contiguous float32 bias of n");
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = at::empty({m, n}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (m == 0) return y;
  // A pass of at most QLINEAR_ROWS rows at a time (a prefill's rows): its quantized rows stay in
  // cache while every panel of the weight goes by. The rows are independent, so the passes make
  // the numbers a call of each pass's rows alone makes; the buffers are the thread's, kept.
  thread_local QuantRows xr;
  const int64_t kb = f >= 0 ? k / QBLOCK : packed.size(1);
  const bool vector = HAS_VEC_QTILE && !generic;
  for (int64_t r0 = 0; r0 < m; r0 += QLINEAR_ROWS) {
    const int64_t rows = std::min(QLINEAR_ROWS, m - r0);
    DISPATCH_FLOAT_BF16(x, "qlinear", [&] {
      quantize_rows(ptr<scalar>(x) + r0 * x.stride(0), x.stride(0), rows, k, kb, act_bits == 16, xr, tiles_for(rows, generic));
    });
    at::Tensor yp = y.narrow(0, r0, rows);
    if (f >= 0) qlinear_kfamily(packed, f, xr, rows, bd, yp, n, generic);
    else if (float_out) qlinear_impl(packed, xr, rows, bd, yp.data_ptr<float>(), n, vector);
    else DISPATCH_FLOAT_BF16(yp, "qlinear", [&] { qlinear_impl(packed, xr, rows, bd, ptr<scalar>(yp), n, vector); });
  }
  return y;
}

namespace {
// f(j, p) for panel p of job j, every job's panels numbered one after another (start[j]: job j's
// first; start.back(): the total), spread over the threads together: one parallel region for
// several linears (qlinear_parts, qlinear_many).
template <typename F>
void parallel_panels(const std::vector<int64_t>& start, const F& f) {
  parallel_dynamic(start.back(), [&](int64_t begin, int64_t end) {
    size_t j = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t q = begin; q < end; ++q) {
      while (q >= start[j + 1]) ++j;
      f(j, q - start[j]);
    }
  });
}
}  // namespace

// The linears of one x side by side (a fused q/k/v or gate/up whose parts a file keeps in
// different kinds, as a Q4_K_M file keeps v in Q6_K): y (M, sum ns) in x's dtype = x times each
// part plus its bias, the parts' outputs in order. x is quantized once and every part's panels
// share one parallel region, written in place: no fork and join per part, no concatenation. The
// same numbers as a qlinear per part.
at::Tensor qlinear_parts(at::Tensor x, std::vector<at::Tensor> packed, std::vector<int64_t> ns,
                         std::vector<c10::optional<at::Tensor>> biases, int64_t act_bits) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear_parts: 2-d float32 or bfloat16 x, rows contiguous");
  const size_t parts = packed.size();
  TORCH_CHECK(parts > 0 && ns.size() == parts && biases.size() == parts, "qlinear_parts: one n and bias (or None) per packed part");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "qlinear_parts: act_bits is 8 or 16, got ", act_bits);
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<int> fmt(parts);
  std::vector<int64_t> col(parts + 1, 0), start(parts + 1, 0);
  for (size_t j = 0; j < parts; ++j) {
    fmt[j] = check_quant(packed[j], ns[j], k);  // (so every part's blocks of 32 are x's: one quantization)
    if (biases[j].has_value())
      TORCH_CHECK(biases[j]->scalar_type() == at::kFloat && biases[j]->is_contiguous() && biases[j]->numel() == ns[j],
                  "qlinear_parts: a part's bias is a contiguous float32 of its n");
    col[j + 1] = col[j] + ns[j];
    start[j + 1] = start[j] + (ns[j] + QPANEL - 1) / QPANEL;
  }
  const int64_t width = col[parts], kb = fmt[0] >= 0 ? k / QBLOCK : packed[0].size(1);
  auto y = at::empty({m, width}, x.options());
  thread_local QuantRows mine;
  QuantRows& xr = mine;  // (the calling thread's, named so: the workers below have their own)
  for (int64_t r0 = 0; r0 < m; r0 += QLINEAR_ROWS) {  // passes of rows, as qlinear's
    const int64_t rows = std::min(QLINEAR_ROWS, m - r0);
    DISPATCH_FLOAT_BF16(x, "qlinear_parts", [&] {
      quantize_rows(ptr<scalar>(x) + r0 * x.stride(0), x.stride(0), rows, k, kb, act_bits == 16, xr, tiles_for(rows, false));
      scalar* yp = ptr<scalar>(y) + r0 * width;
      parallel_panels(start, [&](size_t j, int64_t p) {
        const float* bd = biases[j].has_value() ? biases[j]->data_ptr<float>() : nullptr;
        if (fmt[j] >= 0) kfamily_panel(packed[j], fmt[j], xr, rows, bd, yp + col[j], width, ns[j], p, false);
        else qpanel_of(packed[j], xr, rows, bd, yp + col[j], width, ns[j], p, HAS_VEC_QTILE);
      });
    });
  }
  return y;
}

// Several quantized linears in one parallel region: ys[j] (m_j, ns[j]) fp32 = xs[j] times
// packed[j]^T, each x quantized once, the jobs' panels spread over the threads together (a
// mixture of experts' chosen experts at decode: one region instead of a call, and a fork and
// join of the threads, each; tests/test_moe.py checks it against qlinear).
std::vector<at::Tensor> qlinear_many(std::vector<at::Tensor> xs, std::vector<at::Tensor> packed, std::vector<int64_t> ns,
                                     int64_t act_bits) {
  const size_t jobs = xs.size();
  TORCH_CHECK(packed.size() == jobs && ns.size() == jobs, "qlinear_many: one packed weight and n per x");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "qlinear_many: act_bits is 8 or 16, got ", act_bits);
  std::vector<QuantRows> rows(jobs);
  std::vector<at::Tensor> ys(jobs);
  std::vector<int> fmt(jobs);
  std::vector<int64_t> start(jobs + 1, 0);
  for (size_t j = 0; j < jobs; ++j) {
    const at::Tensor& x = xs[j];
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "qlinear_many: 2-d float32 or bfloat16 xs, rows contiguous");
    const int64_t m = x.size(0), k = x.size(1);
    fmt[j] = check_quant(packed[j], ns[j], k);
    const int64_t kb = fmt[j] >= 0 ? k / QBLOCK : packed[j].size(1);
    DISPATCH_FLOAT_BF16(x, "qlinear_many", [&] { quantize_rows(ptr<scalar>(x), x.stride(0), m, k, kb, act_bits == 16, rows[j], tiles_for(m, false)); });
    ys[j] = at::empty({m, ns[j]}, x.options().dtype(at::kFloat));
    start[j + 1] = start[j] + (m ? (ns[j] + QPANEL - 1) / QPANEL : 0);
  }
  parallel_panels(start, [&](size_t j, int64_t p) {
    const int64_t m = xs[j].size(0), n = ns[j];
    float* y = ys[j].data_ptr<float>();
    if (fmt[j] >= 0) kfamily_panel(packed[j], fmt[j], rows[j], m, nullptr, y, n, n, p, false);
    else qpanel_of(packed[j], rows[j], m, nullptr, y, n, n, p, HAS_VEC_QTILE);
  });
  return ys;
}

}  // namespace rs
