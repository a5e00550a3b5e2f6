// What one core's AVX2 K-quant tile can do for the quantized linears' many-row calls
// (csrc/kquant_linear.cpp, ktile_scratch), and what the alternatives to its arithmetic measure, on
// the same data: Q4_K-shaped values (4 bits) in the scratch layout (per sub-block of 32 and half
// panel of 8 outputs, 8 vectors of 8 outputs x 4 weights), 128 rows of 8-bit activations of
// Qwen2.5-1.5B's q/k/v (k = 1536), 4 rows a tile as the kernel runs them. Per variant, cycles per
// row and 256 multiply-adds (8 outputs x 32 weights) at the clock measured by a dependent imul
// chain, and GMAC/s of one core:
//   as built     per sub-block: 8 vpmaddubsw on broadcast activations, the pair sums added in 16
//                bits, vpmaddwd, then the float combination (convert, multiply, two fma)
//   integer only the same without the float combination (the sums kept in 32 bits)
//   scale / 256  activations with one scale per 256 (llama.cpp's Q8_K): the sub-block scales
//                folded into vpmaddwd, integer sums over the super-block, the float work once
//                per 256 (the min term from the activations' sums per 32); 4 and 6 rows a tile
//   u8 x s8      one activation broadcast for both halves: activations + 128 as u8, weights
//                q - 8 as s8 from memory, the offset restored in integers (the same sums)
// The variants that keep the kernel's numbers check them against "as built".
//
//   g++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off scripts/avx2_tile_limit.cpp -o /tmp/avx2_tile_limit && /tmp/avx2_tile_limit
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

constexpr int K = 1536, KB = K / 32, SB = K / 256, ROWS = 128, REPS = 50;
alignas(64) static uint8_t W[KB][2][8][32];     // q, per sub-block, half, chunk
alignas(64) static int8_t WS[KB][8][2][32];     // q - 8, both halves of a chunk adjacent
alignas(64) static int32_t CORR[KB][16];        // per output: 32768 - 128 * (sum of q)
alignas(64) static float SC[KB][2][16];         // per half: a0 (8), off (8)
alignas(64) static int16_t SCV[KB][2][16];      // sub-block scale per output, in both 16-bit halves
alignas(64) static int16_t MNV[SB][2][4][16];   // (mn_2k, mn_2k+1) per output
alignas(64) static float DV[SB][2][16];         // d, -dmin per half
alignas(64) static int8_t X[ROWS][K];
alignas(64) static uint8_t XU[ROWS][K];
alignas(64) static int16_t BS[ROWS][KB];
static float DX[ROWS][KB], SX[ROWS][KB], S256[ROWS][SB];
static int32_t SQ8[ROWS][KB];
static float OUT[ROWS][16];

template <bool FLOAT, int MR>
void as_built(int m0) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), isum[m] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < KB; ++j) {
      __m256i w[8];
      for (int c = 0; c < 8; ++c) w[c] = _mm256_load_si256((const __m256i*)W[j][h][c]);
      const __m256 a0 = _mm256_load_ps(SC[j][h]), off = _mm256_load_ps(SC[j][h] + 8);
      for (int m = 0; m < MR; ++m) {
        const int32_t* x = (const int32_t*)(X[m0 + m] + 32 * j);
        auto p = [&](int c) { return _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x[c])); };
        const __m256i s0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3))), ones);
        const __m256i s1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7))), ones);
        if constexpr (FLOAT) {
          const __m256 dx = _mm256_set1_ps(DX[m0 + m][j]);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(a0, dx), acc[m]);
          acc[m] = _mm256_fmadd_ps(off, _mm256_set1_ps(SX[m0 + m][j]), acc[m]);
        } else {
          isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(s0, s1));
        }
      }
    }
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(OUT[m0 + m] + 8 * h, FLOAT ? acc[m] : _mm256_cvtepi32_ps(isum[m]));
  }
}

template <int MR>
void scale256(int m0) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < SB; ++b) {
      __m256i T[MR];
      for (int m = 0; m < MR; ++m) T[m] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const int j = 8 * b + i;
        __m256i w[8];
        for (int c = 0; c < 8; ++c) w[c] = _mm256_load_si256((const __m256i*)W[j][h][c]);
        const __m256i sc = _mm256_load_si256((const __m256i*)SCV[j][h]);
        for (int m = 0; m < MR; ++m) {
          const int32_t* x = (const int32_t*)(X[m0 + m] + 32 * j);
          auto p = [&](int c) { return _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x[c])); };
          const __m256i P = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3))),
                                             _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7))));
          T[m] = _mm256_add_epi32(T[m], _mm256_madd_epi16(P, sc));
        }
      }
      const __m256 d = _mm256_load_ps(DV[b][h]), dm = _mm256_load_ps(DV[b][h] + 8);
      for (int m = 0; m < MR; ++m) {
        const int32_t* bs = (const int32_t*)(BS[m0 + m] + 8 * b);
        __m256i M = _mm256_madd_epi16(_mm256_load_si256((const __m256i*)MNV[b][h][0]), _mm256_set1_epi32(bs[0]));
        for (int k = 1; k < 4; ++k)
          M = _mm256_add_epi32(M, _mm256_madd_epi16(_mm256_load_si256((const __m256i*)MNV[b][h][k]), _mm256_set1_epi32(bs[k])));
        const __m256 s = _mm256_set1_ps(S256[m0 + m][b]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[m]), _mm256_mul_ps(d, s), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(dm, s), acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(OUT[m0 + m] + 8 * h, acc[m]);
  }
}

template <int MR>
void u8s8(int m0) {
  __m256 acc[2][MR];
  for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  auto tree = [](const __m256i* v) {
    return _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(v[0], v[1]), _mm256_add_epi16(v[2], v[3])),
                            _mm256_add_epi16(_mm256_add_epi16(v[4], v[5]), _mm256_add_epi16(v[6], v[7])));
  };
  for (int j = 0; j < KB; ++j) {
    const __m256i c0 = _mm256_load_si256((const __m256i*)CORR[j]), c1 = _mm256_load_si256((const __m256i*)(CORR[j] + 8));
    for (int m = 0; m < MR; ++m) {
      const int32_t* x = (const int32_t*)(XU[m0 + m] + 32 * j);
      __m256i a[8], b[8];
      for (int c = 0; c < 8; ++c) {
        const __m256i xb = _mm256_set1_epi32(x[c]);
        a[c] = _mm256_maddubs_epi16(xb, _mm256_load_si256((const __m256i*)WS[j][c][0]));
        b[c] = _mm256_maddubs_epi16(xb, _mm256_load_si256((const __m256i*)WS[j][c][1]));
      }
      const __m256i q8 = _mm256_set1_epi32(SQ8[m0 + m][j]);
      const __m256i s0 = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(tree(a), ones), c0), q8);
      const __m256i s1 = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(tree(b), ones), c1), q8);
      const __m256 dx = _mm256_set1_ps(DX[m0 + m][j]), sx = _mm256_set1_ps(SX[m0 + m][j]);
      acc[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(_mm256_load_ps(SC[j][0]), dx), acc[0][m]);
      acc[0][m] = _mm256_fmadd_ps(_mm256_load_ps(SC[j][0] + 8), sx, acc[0][m]);
      acc[1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(_mm256_load_ps(SC[j][1]), dx), acc[1][m]);
      acc[1][m] = _mm256_fmadd_ps(_mm256_load_ps(SC[j][1] + 8), sx, acc[1][m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(OUT[m0 + m], acc[0][m]), _mm256_storeu_ps(OUT[m0 + m] + 8, acc[1][m]);
}

double clock_ghz() {  // a chain of dependent imuls, 3 cycles each
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    long x = 3;
    const long n = 100000000;
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) asm volatile("imul %0, %0\n\timul %0, %0" : "+r"(x));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (6.0 * n / s / 1e9 > best) best = 6.0 * n / s / 1e9;
  }
  return best;
}

template <void (*F)(int), int MR>
void run(const char* name, double ghz, const float* check) {
  double best = 1e9;
  for (int rep = 0; rep < 9; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < REPS; ++it)
      for (int m0 = 0; m0 + MR <= ROWS; m0 += MR) F(m0);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  const double macs = double(REPS) * (ROWS / MR * MR) * 16 * K;
  float err = 0;
  for (int r = 0; check && r < ROWS / MR * MR; ++r)
    for (int o = 0; o < 16; ++o) err = std::fmax(err, std::fabs(OUT[r][o] - check[16 * r + o]));
  printf("| %-12s | %d | %5.2f | %6.1f | %s |\n", name, MR, ghz * 1e9 * best / (macs / 256), macs / best / 1e9,
         check ? (err == 0 ? "same numbers" : "DIFFERENT") : "-");
}

int main() {
  srand(1);
  for (int j = 0; j < KB; ++j)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 8; ++c)
        for (int b = 0; b < 32; ++b) {
          const int q = rand() & 15;
          W[j][h][c][b] = q;
          WS[j][c][h][b] = q - 8;
        }
  for (int j = 0; j < KB; ++j)
    for (int o = 0; o < 16; ++o) {
      int s = 0;
      for (int c = 0; c < 8; ++c)
        for (int b = 0; b < 4; ++b) s += W[j][o / 8][c][4 * (o % 8) + b];
      CORR[j][o] = 32768 - 128 * s;  // sum x q = sum (x + 128)(q - 8) + 8 sum x + 32768 - 128 sum q
    }
  for (int r = 0; r < ROWS; ++r)
    for (int i = 0; i < K; ++i) X[r][i] = int8_t(rand() % 255 - 127), XU[r][i] = uint8_t(X[r][i] + 128);
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < KB; ++j) {
      int s = 0;
      for (int i = 0; i < 32; ++i) s += X[r][32 * j + i];
      SQ8[r][j] = 8 * s, BS[r][j] = int16_t(s), DX[r][j] = 1e-2f, SX[r][j] = 1e-2f * s;
    }
  for (auto& a : SC) for (auto& b : a) for (int i = 0; i < 16; ++i) b[i] = (rand() % 100) * (i < 8 ? 1e-3f : -1e-4f);
  for (auto& a : SCV) for (auto& b : a) for (auto& v : b) v = int16_t(rand() & 63);
  for (auto& a : MNV) for (auto& b : a) for (auto& c : b) for (auto& v : c) v = int16_t(rand() & 63);
  for (auto& a : DV) for (auto& b : a) for (int i = 0; i < 16; ++i) b[i] = i < 8 ? 1e-3f : -1e-4f;
  for (auto& a : S256) for (auto& v : a) v = 1e-2f;
  const double ghz = clock_ghz();
  printf("clock under a dependent imul chain: %.2f GHz; one core, k = %d, %d rows\n\n", ghz, K, ROWS);
  printf("| variant | rows a tile | cycles / row / 256 MACs | GMAC/s | numbers |\n|---|---:|---:|---:|---|\n");
  static float ref[ROWS * 16];
  for (int round = 0; round < 2; ++round) {
    run<as_built<true, 4>, 4>("as built", ghz, nullptr);
    for (int r = 0; r < ROWS; ++r)
      for (int o = 0; o < 16; ++o) ref[16 * r + o] = OUT[r][o];
    run<as_built<false, 4>, 4>("integer only", ghz, nullptr);
    run<scale256<4>, 4>("scale / 256", ghz, nullptr);
    run<scale256<6>, 6>("scale / 256", ghz, nullptr);
    run<u8s8<4>, 4>("u8 x s8", ghz, ref);
  }
}
