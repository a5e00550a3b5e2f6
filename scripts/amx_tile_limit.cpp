// What one core's AMX tiles can do for the quantized linears' many-row calls (csrc/amx.h), by
// parts: per 16 rows x 16 outputs x 32 weights (one tdpbsud), the tile work (load A and B,
// zero, tdpbsud, store C), the vector work that scales the stored sums into fp32 (one cvt, mul,
// two fma per row: the VNNI tiles' float combination), and both as the kernel runs them. Data
// sized as Qwen2.5-1.5B's q/k/v at 256 rows (k = 1536), on 64-byte lines as the kernel keeps them.
//
//   g++ -O3 -march=native scripts/amx_tile_limit.cpp -o /tmp/amx_tile_limit && /tmp/amx_tile_limit
//
// Prints cycles per tile at the clock given (default 2.6 GHz; `amx_tile_limit 3.0`) and GMAC/s of
// one core. Linux only (the tile state is requested with arch_prctl).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <typename T>
T* lines(size_t n, int fill) {
  T* p = static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  for (size_t i = 0; i < n; ++i) p[i] = T(fill);
  return p;
}

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? atof(argv[1]) : 2.6;
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    printf("the kernel refused the AMX tile state (or this CPU has none)\n");
    return 1;
  }
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 64;  // C
  cfg.rows[4] = 16, cfg.colsb[4] = 32;  // A: 16 rows of a block of 32
  cfg.rows[5] = 8, cfg.colsb[5] = 64;   // B: the block's 32 weights of 16 outputs, 4 per 32-bit lane
  _tile_loadconfig(&cfg);
  const int64_t kb = 48, m = 256, stride = kb * 32, reps = 1000;
  int8_t* a = lines<int8_t>(m * stride, 1);
  uint8_t* b = lines<uint8_t>(kb * 512, 2);
  float* sc = lines<float>(kb * 48, 1);
  float* dx = lines<float>(m * kb, 1);
  float* sx = lines<float>(m * kb, 1);
  alignas(64) int32_t c[16][16] = {};
  const char* names[3] = {"tiles and scaling (the kernel)", "tile work only", "scaling only"};
  for (int mode = 0; mode < 3; ++mode) {
    float sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t rep = 0; rep < reps; ++rep)
      for (int64_t m0 = 0; m0 < m; m0 += 16) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < kb; ++i) {
          if (mode != 2) {
            _tile_loadd(5, b + i * 512, 64);
            _tile_zero(0);
            _tile_loadd(4, a + m0 * stride + i * 32, stride);
            _tile_dpbsud(0, 4, 5);
            _tile_stored(0, c, 64);
          }
          if (mode == 1) continue;
          const __m512 a0 = _mm512_loadu_ps(sc + i * 48), off = _mm512_loadu_ps(sc + i * 48 + 32);
          for (int r = 0; r < 16; ++r) {
            const int64_t at = (m0 + r) * kb + i;
            const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c[r]));
            acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(a0, _mm512_set1_ps(dx[at])), acc[r]);
            acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(sx[at]), acc[r]);
          }
        }
        for (int r = 0; r < 16; ++r) sink += _mm512_reduce_add_ps(acc[r]);
      }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tiles = double(reps) * (m / 16) * kb;
    printf("%-32s %6.1f cycles a tile at %.1f GHz, %5.0f GMAC/s a core%s\n", names[mode], s / tiles * ghz * 1e9, ghz,
           tiles * 16 * 16 * 32 / s / 1e9, sink == 1.f ? " " : "");
  }
  _tile_release();
  return 0;
}
