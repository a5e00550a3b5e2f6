// What one core's AVX2 decode tile can do for a quantized linear at one row (a decode step at
// batch 1): csrc/kquant_linear.cpp's ktile<Q4_K, 1> inner loop, copied, on Q4_K records in the
// packed layout (per super-block a 64-byte header, then 8 sub-blocks of 256 nibble bytes and
// 32 scale bytes, 16 outputs), Qwen2.5-1.5B's k = 1536, weights kept in cache (argv[1]
// panels of 16 outputs: 8 = 111 KB in L2, 512 = 7 MB past it), so what is timed is the
// arithmetic, not the memory. Per variant, cycles per sub-block (16 outputs x 32 weights: 288
// bytes) at the clock a dependent imul chain measures, and GB/s of weights a core:
//   as built     both 8-output halves: unpack (and, shift, and), 8 vpmaddubsw on broadcast
//                activations, pair sums added in 16 bits, vpmaddwd, then the float combination
//                (the sub-block's scale and min from the file's bytes, convert, two fma)
//   integer only the same without the float combination (sums kept in 32 bits)
//   as loaded    the weights not unpacked (nonsense numbers: the unpack's cost)
//   no prefetch  as built without the 16-sub-block prefetch into L2
//   streamed     the chunks' two halves interleaved, sums added as they come (the same integers)
//
//   g++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off scripts/avx2_decode_tile_limit.cpp -o /tmp/t && /tmp/t 8 && /tmp/t 512
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
constexpr int K = 1536, NB = K / 256, KB = K / 32, SUB = 288, REC = 64 + 8 * SUB;
static int PANELS = 8;
static uint8_t* W;
alignas(64) static int8_t X[K];
static float DX[KB], SX[KB];
static float OUT[4096];

inline __m256 u8f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }

template <int V>
void tile(const uint8_t* panel, float* y) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256i iacc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
  for (int b = 0; b < NB; ++b) {
    const uint8_t* rec = panel + b * REC;
    __m256 d[2], dmin[2];
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16 * h)));
      dmin[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 32 + 16 * h)));
    }
    for (int i = 0; i < 8; ++i) {
      const uint8_t* sub = rec + 64 + i * SUB;
      const int at = b * 8 + i;
      const int32_t* x = (const int32_t*)(X + 32 * at);
      if (V != 3) __builtin_prefetch(sub + 16 * SUB, 0, 1), __builtin_prefetch(sub + 16 * SUB + 64, 0, 1), __builtin_prefetch(sub + 16 * SUB + 128, 0, 1), __builtin_prefetch(sub + 16 * SUB + 192, 0, 1), __builtin_prefetch(sub + 16 * SUB + 256, 0, 1);
      if (V == 4) {
        __m256i q0[2], q1[2];
        for (int h = 0; h < 2; ++h) q0[h] = q1[h] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i xl = _mm256_set1_epi32(x[c]), xh = _mm256_set1_epi32(x[4 + c]);
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(sub + 64 * c + 32 * h));
            q0[h] = _mm256_add_epi16(q0[h], _mm256_maddubs_epi16(_mm256_and_si256(v, low), xl));
            q1[h] = _mm256_add_epi16(q1[h], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), xh));
          }
        }
        const __m256 dx = _mm256_set1_ps(DX[at]), sx = _mm256_set1_ps(SX[at]);
        for (int h = 0; h < 2; ++h) {
          const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(q0[h], ones), _mm256_madd_epi16(q1[h], ones));
          const uint8_t* sc = sub + 256;
          const __m256 a0 = _mm256_mul_ps(d[h], u8f(sc + 8 * h));
          const __m256 off = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin[h], u8f(sc + 16 + 8 * h)));
          acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(a0, dx), acc[h]);
          acc[h] = _mm256_fmadd_ps(off, sx, acc[h]);
        }
        continue;
      }
      for (int h = 0; h < 2; ++h) {
        __m256i w[8];
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(sub + 64 * c + 32 * h));
          if (V == 2) { w[c] = v; w[4 + c] = v; }
          else { w[c] = _mm256_and_si256(v, low); w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); }
        }
        auto p = [&](int c) { return _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x[c])); };
        __m256i s0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3))), ones);
        __m256i s1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7))), ones);
        if (V == 1) { iacc[h] = _mm256_add_epi32(iacc[h], _mm256_add_epi32(s0, s1)); continue; }
        const uint8_t* sc = sub + 256;
        const __m256 a0 = _mm256_mul_ps(d[h], u8f(sc + 8 * h));
        const __m256 off = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin[h], u8f(sc + 16 + 8 * h)));
        const __m256 dx = _mm256_set1_ps(DX[at]);
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(a0, dx), acc[h]);
        acc[h] = _mm256_fmadd_ps(off, _mm256_set1_ps(SX[at]), acc[h]);
      }
    }
  }
  acc[0] = _mm256_add_ps(acc[0], _mm256_cvtepi32_ps(iacc[0]));
  acc[1] = _mm256_add_ps(acc[1], _mm256_cvtepi32_ps(iacc[1]));
  _mm256_storeu_ps(y, acc[0]);
  _mm256_storeu_ps(y + 8, acc[1]);
}

static double ghz() {  // a chain of dependent imuls, 3 cycles each
  auto t = std::chrono::steady_clock::now();
  uint64_t v = 1;
  for (int i = 0; i < 200000000; ++i) asm volatile("imul %0, %0" : "+r"(v));
  return 3 * 2e8 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / 1e9;
}

template <int V>
void run(const char* name, double g) {
  double best = 1e9;
  for (int r = 0; r < 30; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 200; ++rep)
      for (int p = 0; p < PANELS; ++p) tile<V>(W + (size_t)p * NB * REC, OUT + 16 * (p % 256));
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  const double subs = 200.0 * PANELS * KB;
  std::printf("%-12s %5.1f cycles per sub-block (16 outputs x 32), %5.1f GB/s a core\n", name, best * g * 1e9 / subs, subs * SUB / best / 1e9);
}

int main(int argc, char** argv) {
  if (argc > 1) PANELS = std::atoi(argv[1]);
  W = (uint8_t*)aligned_alloc(64, (size_t)PANELS * NB * REC + 64 * SUB);
  for (size_t i = 0; i < (size_t)PANELS * NB * REC + 64 * SUB; ++i) W[i] = rand() & 0x3f;
  for (int i = 0; i < K; ++i) X[i] = rand() % 255 - 127;
  for (int i = 0; i < KB; ++i) DX[i] = 0.01f, SX[i] = 0.3f;
  const double g = ghz();
  std::printf("clock %.2f GHz, %d panels (%.0f KB)\n", g, PANELS, PANELS * NB * REC / 1024.0);
  run<0>("as built", g);
  run<1>("integer only", g);
  run<2>("as loaded", g);
  run<3>("no prefetch", g);
  run<4>("streamed", g);
}
