// Float linears for decode batches: y (M, N) = x (M, K) W^T + b for few rows M. The weight
// streams from memory once per call and every row reuses it. W is packed once (pack_linear)
// into panels of PANEL = NR vectors of outputs, one contiguous stream each:
//   fp32:                    [panel][K][PANEL outputs]: one FMA per broadcast x and W outputs;
//   bf16 (AVX512-BF16 only): [panel][K/2][PANEL][2 k]: one vdpbf16ps multiplies a broadcast
//                            pair of x by 16 outputs' pairs of W, fp32 accumulation.
//   bf16 (elsewhere):        as fp32, each weight widened to fp32 as it is loaded.
// MR rows x NR vectors of accumulators live in registers. y is x's dtype, or fp32 (logits).
// Torch reference: F.linear.
#include "common.h"

#include <type_traits>

namespace rs {
namespace {

constexpr int64_t NR = 4, PANEL = NR * W, PF = 8;  // PF: k steps of W prefetched ahead
constexpr int64_t MR_MAX = W == 16 ? 6 : W == 8 ? 3 : 4;  // 32 registers on AVX-512, 16 on AVX2

#if defined(RS_AVX512) && defined(__AVX512BF16__)
constexpr bool HAS_BF16_DP = true;
#else
constexpr bool HAS_BF16_DP = false;
#endif

inline void prefetch_panel(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < PANEL * 4; i += 64) prefetch(c + i);
}

template <int MR, typename O>
inline void store_tile(VecF (&acc)[MR][NR], const float* bias, O* y, int64_t ldy, int64_t n0, int64_t n) {
  for (int j = 0; j < NR; ++j) {
    const int64_t c0 = n0 + j * W;
    if (c0 >= n) break;
    const int64_t cnt = std::min<int64_t>(W, n - c0);
    const VecF b = bias ? (cnt == W ? vload(bias + c0) : vload_part(bias + c0, cnt)) : vzero();
    for (int m = 0; m < MR; ++m) {
      const VecF v = acc[m][j] + b;
      O* yr = y + m * ldy + c0;
      if (cnt == W) {
        vstore(yr, v);
      } else {
        O tmp[W];
        vstore(tmp, v);
        std::memcpy(yr, tmp, cnt * sizeof(O));
      }
    }
  }
}

#if defined(RS_AVX512) && defined(__AVX512BF16__)
template <int MR, typename O>
void tile_bf16dp(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* panel, int64_t kp, const float* bias, O* y, int64_t ldy,
          int64_t n0, int64_t n) {
  VecF acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = vzero();
  const int64_t full = k / 2;
  for (int64_t p = 0; p < kp; ++p) {
    const uint16_t* wp = panel + p * NR * 32;
    if (MR <= 2) prefetch_panel(wp + PF * NR * 32);  // few rows: the stream of W is the bound; keep 2 KiB in flight
    __m512i w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_si512(wp + j * 32);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      if (p < full) std::memcpy(&pair, x + m * ldx + 2 * p, 4);
      else pair = int32_t(x[m * ldx + 2 * p]);  // odd k: the last pair's second half is 0
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[m][j].v = _mm512_dpbf16_ps(acc[m][j].v, xb, (__m512bh)w[j]);
    }
  }
  store_tile<MR>(acc, bias, y, ldy, n0, n);
}
#endif

// fp32 weights, or bf16 ones widened as they are loaded (no AVX512-BF16): [panel][K][PANEL].
template <int MR, typename T, typename O>
void tile(const T* x, int64_t ldx, int64_t k, const T* panel, int64_t, const float* bias, O* y, int64_t ldy, int64_t n0,
          int64_t n) {
  VecF acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = vzero();
  for (int64_t c = 0; c < k; ++c) {
    const T* wp = panel + c * PANEL;
    if (MR <= 2) prefetch_panel(wp + PF * PANEL);
    VecF w[NR];
    for (int j = 0; j < NR; ++j) w[j] = vload(wp + j * W);
    for (int m = 0; m < MR; ++m) {
      const VecF xb = vset1(ld(x, m * ldx + c));
      for (int j = 0; j < NR; ++j) acc[m][j] = vfma(xb, w[j], acc[m][j]);
    }
  }
  store_tile<MR>(acc, bias, y, ldy, n0, n);
}

template <int MR, typename T, typename O>
inline void run_tile(const T* x, int64_t ldx, int64_t k, const T* panel, int64_t kp, const float* bias, O* y, int64_t ldy,
                     int64_t n0, int64_t n) {
#if defined(RS_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) return tile_bf16dp<MR>(x, ldx, k, panel, kp, bias, y, ldy, n0, n);
#endif
  tile<MR>(x, ldx, k, panel, kp, bias, y, ldy, n0, n);
}

template <typename T, typename O>
void linear_impl(const T* xd, int64_t ldx, int64_t m, int64_t k, const T* wd, int64_t kp, int64_t panels, const float* bias,
                 O* yd, int64_t n) {
  const int64_t panel_size = kp * PANEL * (std::is_same_v<T, float> || !HAS_BF16_DP ? 1 : 2);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T* panel = wd + p * panel_size;
      for (int64_t m0 = 0; m0 < m; m0 += MR_MAX) {
        const T* xr = xd + m0 * ldx;
        O* yr = yd + m0 * n;
        switch (std::min<int64_t>(MR_MAX, m - m0)) {
          case 1: run_tile<1>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 2: run_tile<2>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 3: run_tile<3>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 4: run_tile<4>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 5: run_tile<5>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          default: run_tile<MR_MAX>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
        }
      }
    }
  });
}

}  // namespace

bool linear_supports(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

at::Tensor pack_linear(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && linear_supports(w.scalar_type()), "pack_linear: a 2-d float32 or bf16 weight");
  auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), panels = (n + PANEL - 1) / PANEL;
  const int64_t pair = wc.scalar_type() == at::kBFloat16 && HAS_BF16_DP ? 2 : 1, kp = (k + pair - 1) / pair;
  auto out = at::zeros({panels, kp, NR, W * pair}, wc.options());
  const int64_t esize = wc.element_size();
  const char* src = static_cast<const char*>(wc.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = p * PANEL; r < std::min(n, (p + 1) * PANEL); ++r) {
        const int64_t blk = (r % PANEL) / W, lane = r % W;
        for (int64_t c = 0; c < k; ++c) {
          const int64_t at = ((p * kp + c / pair) * NR + blk) * W * pair + lane * pair + c % pair;
          std::memcpy(dst + at * esize, src + (r * k + c) * esize, esize);
        }
      }
  });
  return out;
}

at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias, bool float_out) {
  const auto t = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == t && x.stride(1) == 1 && linear_supports(t),
              "linear: 2-d x of the packed weight's dtype, rows contiguous");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), kp = packed.size(1);
  const int64_t pair = t == at::kBFloat16 && HAS_BF16_DP ? 2 : 1;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && kp == (k + pair - 1) / pair && panels * PANEL >= n &&
                  packed.size(2) == NR && packed.size(3) == W * pair, "linear: a weight packed by pack_linear for this k and n");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "linear: a contiguous float32 bias of n (the caller converts it once)");
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = at::empty({m, n}, x.options().dtype(float_out ? at::kFloat : t));
  if (m == 0) return y;
  if (t == at::kBFloat16) {
    if (float_out) linear_impl(ptr<uint16_t>(x), x.stride(0), m, k, ptr<uint16_t>(packed), kp, panels, bd, y.data_ptr<float>(), n);
    else linear_impl(ptr<uint16_t>(x), x.stride(0), m, k, ptr<uint16_t>(packed), kp, panels, bd, ptr<uint16_t>(y), n);
    return y;
  }
  linear_impl(x.data_ptr<float>(), x.stride(0), m, k, packed.data_ptr<float>(), kp, panels, bd, y.data_ptr<float>(), n);
  return y;
}

}  // namespace rs
