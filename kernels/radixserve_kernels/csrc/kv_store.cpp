// Writing new K/V rows into the pool: as they are (fp32 / bf16), or quantized to int8 or fp8
// e4m3 with an fp32 scale per (token, KV head). Torch references: radixserve_kernels.store_kv.store_kv_ref
// and store_kv_quant_ref (bit for bit).
#include "common.h"

namespace rs {
namespace {

// --- KV store: k_pool[slots[t]] = k[t], v likewise, in one call ------------------------
template <typename T>
void store_kv_impl(at::Tensor& kp, at::Tensor& vp, const int64_t* slots, const at::Tensor& k, const at::Tensor& v) {
  const int64_t t_len = k.size(0), heads = k.size(1), dim = k.size(2);
  for (int pass = 0; pass < 2; ++pass) {
    const at::Tensor& src = pass ? v : k;
    at::Tensor& dst = pass ? vp : kp;
    const T* sd = ptr<T>(src);
    T* dd = ptr<T>(dst);
    const int64_t s0 = src.stride(0), s1 = src.stride(1), d0 = dst.stride(0), d1 = dst.stride(1);
    for (int64_t t = 0; t < t_len; ++t)
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dd + slots[t] * d0 + h * d1, sd + t * s0 + h * s1, dim * sizeof(T));
  }
}

}  // namespace

// The slots store_kv writes to, checked against the pool (decode_layers: once, not per layer).
void check_slots(const at::Tensor& slots, int64_t pool_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "store_kv: contiguous int64 slots");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < pool_slots, "store_kv: slot ", sp[t], " out of range");
}

// store_kv after check_slots.
void run_store(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 && k_pool.stride(2) == 1 &&
                  v_pool.stride(2) == 1 && k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == v_pool.scalar_type() &&
                  slots.numel() == k.size(0),
              "store_kv: (T, kv_heads, D) k/v with contiguous D, the pools' dtype, one slot per row");
  DISPATCH_FLOAT_BF16(k, "store_kv", [&] { store_kv_impl<scalar>(k_pool, v_pool, slots.data_ptr<int64_t>(), k, v); });
}

void store_kv(at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots, at::Tensor k, at::Tensor v) {
  auto s = slots.contiguous();
  check_slots(s, std::min(k_pool.size(0), v_pool.size(0)));
  run_store(k_pool, v_pool, s, k, v);
}

namespace {

// --- quantized KV store: int8 or fp8 e4m3 values and an fp32 scale per (token, KV head) ----
// As kernels/radixserve_kernels/kv_quant.py's quantize, bit for bit: scale = max(absmax / QMAX, FLT_MIN), each
// value x / scale clamped to +-QMAX, then rounded to nearest even (int8; fp8: to its 3-bit
// mantissa, subnormals below 2^-6).
inline float qmax(const int8_t*) { return 127.f; }
inline float qmax(const uint8_t*) { return 448.f; }
inline void stq(int8_t* p, int64_t i, float r) { p[i] = int8_t(std::nearbyint(r)); }
inline void stq(uint8_t* p, int64_t i, float r) {  // |r| <= 448, not NaN
  const uint8_t sign = std::signbit(r) ? 0x80 : 0;
  const float a = std::fabs(r);
  if (a < 0.015625f) {  // subnormal: steps of 2^-9 (8 steps is the smallest normal, 0x08)
    p[i] = sign | uint8_t(std::nearbyint(a * 512.f));
    return;
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the mantissa to 3 bits, to nearest even (may carry into the exponent)
  p[i] = sign | uint8_t((((u >> 23) - 120) << 3) | ((u >> 20) & 7u));
}

template <typename T, typename E>
void store_kv_quant_impl(at::Tensor& kp, at::Tensor& vp, at::Tensor& ksc, at::Tensor& vsc, const int64_t* slots,
                         const at::Tensor& k, const at::Tensor& v) {
  const int64_t t_len = k.size(0), heads = k.size(1), dim = k.size(2);
  const float qm = qmax(static_cast<const E*>(nullptr));
  for (int pass = 0; pass < 2; ++pass) {
    const at::Tensor& src = pass ? v : k;
    at::Tensor& dst = pass ? vp : kp;
    at::Tensor& sc = pass ? vsc : ksc;
    const T* sd = ptr<T>(src);
    E* dd = ptr<E>(dst);
    float* cd = sc.data_ptr<float>();
    const int64_t s0 = src.stride(0), s1 = src.stride(1), d0 = dst.stride(0), d1 = dst.stride(1), c0 = sc.stride(0);
    at::parallel_for(0, t_len, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const T* x = sd + t * s0 + h * s1;
          float amax = 0.f;
          for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(ld(x, d)));
          const float s = std::max(amax / qm, std::numeric_limits<float>::min());
          cd[slots[t] * c0 + h] = s;
          E* y = dd + slots[t] * d0 + h * d1;
          for (int64_t d = 0; d < dim; ++d) stq(y, d, std::min(std::max(ld(x, d) / s, -qm), qm));
        }
    });
  }
}

}  // namespace

// store_kv_quant after its checks (decode_layers: once, not per layer).
void run_store_quant(at::Tensor& k_pool, at::Tensor& v_pool, at::Tensor& k_scale, at::Tensor& v_scale,
                     const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  DISPATCH_FLOAT_BF16(k, "store_kv_quant", [&] {
    DISPATCH_KV_QUANT(k_pool, "store_kv_quant", [&] {
      store_kv_quant_impl<scalar, qtype>(k_pool, v_pool, k_scale, v_scale, slots.data_ptr<int64_t>(), k, v);
    });
  });
}

void store_kv_quant(at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale, at::Tensor v_scale,
                    at::Tensor slots, at::Tensor k, at::Tensor v) {
  auto s = slots.contiguous();
  check_slots(s, std::min(k_pool.size(0), v_pool.size(0)));
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 && k_pool.stride(2) == 1 &&
                  v_pool.stride(2) == 1 && v.scalar_type() == k.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type() &&
                  k_pool.size(1) == k.size(1) && k_pool.size(2) == k.size(2) && v_pool.sizes() == k_pool.sizes() &&
                  s.numel() == k.size(0),
              "store_kv_quant: (T, kv_heads, D) k/v with contiguous D, pools of their shape, one slot per row");
  check_scales(k_pool, k_scale, "store_kv_quant");
  check_scales(v_pool, v_scale, "store_kv_quant");
  run_store_quant(k_pool, v_pool, k_scale, v_scale, s, k, v);
}

}  // namespace rs
