// What every op file shares: ATen (only the headers the ops need: torch/extension.h, the
// module's, costs a file ~4x the compile time), the vector layer, dtype dispatch, and the declarations of
// the ops one file calls from another (decode_step.cpp runs them all; ops.cpp registers them).
//
// Types: fp32 and bf16 tensors; bf16 is read as raw uint16 and widened to fp32, and every
// sum is accumulated in fp32. A quantized KV pool is int8 or fp8 e4m3 (raw uint8) rows with
// fp32 scales. Threads: at::parallel_for, torch's own OpenMP pool (parallel_dynamic below for the
// quantized linears' panels).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include "vec.h"

namespace rs {

// f(begin, end) over [0, n) in chunks that the threads take as they come (~8 a thread): a
// thread held up (the server's process or a neighbour on its core) leaves the rest of its share
// to the others instead of keeping them at the barrier, as a static split does. For work whose
// items are independent (a linear's output panels: the same numbers whoever computes them).
template <typename F>
void parallel_dynamic(int64_t n, const F& f) {
  const int64_t threads = at::get_num_threads();
  if (n <= 0) return;
  if (threads <= 1 || n == 1 || at::in_parallel_region()) return f(0, n);
  const int64_t chunk = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) f(b, std::min(n, b + chunk));
  });
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Runs body with scalar = float or uint16_t (bf16) by the tensor's dtype.
#define DISPATCH_FLOAT_BF16(t, name, ...)                                        \
  do {                                                                           \
    if ((t).scalar_type() == at::kFloat) {                                    \
      using scalar = float;                                                      \
      __VA_ARGS__();                                                             \
    } else if ((t).scalar_type() == at::kBFloat16) {                          \
      using scalar = uint16_t;                                                   \
      __VA_ARGS__();                                                             \
    } else {                                                                     \
      TORCH_CHECK(false, name ": float32 or bfloat16 tensors only, got ", (t).scalar_type()); \
    }                                                                            \
  } while (0)

// Runs body with qtype = int8_t (an int8 pool) or uint8_t (the bytes of an fp8 e4m3 pool).
#define DISPATCH_KV_QUANT(t, name, ...)                                                     \
  do {                                                                                       \
    if ((t).scalar_type() == at::kChar) {                                                 \
      using qtype = int8_t;                                                                  \
      __VA_ARGS__();                                                                         \
    } else if ((t).scalar_type() == c10::ScalarType::Float8_e4m3fn) {                        \
      using qtype = uint8_t;                                                                 \
      __VA_ARGS__();                                                                         \
    } else {                                                                                 \
      TORCH_CHECK(false, name ": an int8 or float8_e4m3fn pool only, got ", (t).scalar_type()); \
    }                                                                                        \
  } while (0)

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) u = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) u = sign;
  else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    u = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// --- attention.cpp ----------------------------------------------------------------------
void check_table(const at::Tensor& rows, const at::Tensor& table, const at::Tensor& lens, int64_t q_rows_bound,
                 int64_t pool_slots);
void check_scales(const at::Tensor& pool, const at::Tensor& scales, const char* name);
void run_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                float* lse, const at::Tensor& rows, const at::Tensor& table, const at::Tensor& lens, double scale);
void run_decode_quant(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& k_scale, const at::Tensor& v_scale, at::Tensor& out, float* lse,
                      const at::Tensor& rows, const at::Tensor& table, const at::Tensor& lens, double scale);
void decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor out,
                      c10::optional<at::Tensor> lse, at::Tensor q_rows, at::Tensor table, at::Tensor seq_lens,
                      double scale);
void decode_attention_quant(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale,
                            at::Tensor v_scale, at::Tensor out, c10::optional<at::Tensor> lse, at::Tensor q_rows,
                            at::Tensor table, at::Tensor seq_lens, double scale);

// --- kv_store.cpp -------------------------------------------------------------------------
void check_slots(const at::Tensor& slots, int64_t pool_slots);
void run_store(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v);
void run_store_quant(at::Tensor& k_pool, at::Tensor& v_pool, at::Tensor& k_scale, at::Tensor& v_scale,
                     const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v);
void store_kv(at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots, at::Tensor k, at::Tensor v);
void store_kv_quant(at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale, at::Tensor v_scale,
                    at::Tensor slots, at::Tensor k, at::Tensor v);

// --- norm_rope_act.cpp --------------------------------------------------------------------
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
void lora_add_(at::Tensor y, at::Tensor x, at::Tensor rows, std::vector<int64_t> bounds, std::vector<at::Tensor> as,
               std::vector<at::Tensor> bts, std::vector<at::Tensor> cols);
void rope_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);

// --- linear.cpp -----------------------------------------------------------------------------
bool linear_supports(at::ScalarType t);
at::Tensor pack_linear(at::Tensor w);
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias, bool float_out);

// --- quant_linear.cpp ---------------------------------------------------------------------
at::Tensor pack_quant(at::Tensor raw, const std::string& kind, int64_t n, int64_t k);
at::Tensor dequant_quant(at::Tensor packed, int64_t n, int64_t k, c10::optional<at::Tensor> rows);
std::vector<at::Tensor> qlinear_many(std::vector<at::Tensor> xs, std::vector<at::Tensor> packed, std::vector<int64_t> ns,
                                     int64_t act_bits);
at::Tensor qlinear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias, bool float_out,
                      bool generic, int64_t act_bits);
at::Tensor qlinear_parts(at::Tensor x, std::vector<at::Tensor> packed, std::vector<int64_t> ns,
                         std::vector<c10::optional<at::Tensor>> biases, int64_t act_bits);
bool set_amx(bool on);

// --- decode_step.cpp ----------------------------------------------------------------------
// One linear of a layer in the fused step: its packed parts (one; or one per shard where a GGUF
// file keeps q/k/v or gate/up in different kinds), each with its output width and an optional
// fp32 bias added inside its kernel; the parts' outputs side by side.
struct StepLinear {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> widths;
  std::vector<c10::optional<at::Tensor>> biases;
};
// A routed layer's MLP (mixture of experts): its router as a float panel (pack_linear) and each
// expert's packed quantized gate_up (2 * inter outputs) and down; top-k of the softmax over the
// experts, renormalised where the family does.
struct StepMoE {
  at::Tensor router;
  std::vector<at::Tensor> gate_up, down;
  int64_t top_k = 0, inter = 0;
  bool renorm = false;
};
// Every decoder layer's weights, handed over once (models.llama.FusedDecode), not on every step.
struct DecodeWeights {
  std::vector<at::Tensor> in_norm, post_norm, q_norm, k_norm;  // q/k norms: none, or one per layer (Qwen3)
  std::vector<StepLinear> qkv, o_proj, gate_up, down;  // a routed layer: no gate_up/down parts, its `moe` instead
  std::vector<StepMoE> moe;  // one per layer; experts only where routed
  int64_t act_bits = 16;  // quantized linears' activations: 8 or 16 bits (QuantRows)
  int64_t heads = 0, kv_heads = 0, head_dim = 0, inter = 0;
  double eps = 0, scale = 0;
};
// A layer's linear as Python gives it: (packed, width, bias or None) per part.
using LinearParts = std::vector<std::tuple<at::Tensor, int64_t, c10::optional<at::Tensor>>>;
std::shared_ptr<DecodeWeights> decode_weights(std::vector<at::Tensor> in_norm, std::vector<at::Tensor> post_norm,
                                              std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm,
                                              std::vector<LinearParts> qkv, std::vector<LinearParts> o_proj,
                                              std::vector<LinearParts> gate_up, std::vector<LinearParts> down, int64_t heads,
                                              int64_t kv_heads, int64_t head_dim, int64_t inter, double eps, double scale,
                                              int64_t act_bits);
at::Tensor moe_experts(at::Tensor h, at::Tensor weights, at::Tensor chosen, std::vector<at::Tensor> gate_up,
                       std::vector<at::Tensor> down, int64_t inter, int64_t act_bits);
void decode_moe(DecodeWeights& w, int64_t layer, at::Tensor router, std::vector<at::Tensor> gate_up,
                std::vector<at::Tensor> down, int64_t inter, int64_t top_k, bool renorm);
// One LoRA adapter's weights as decode_layers takes them (models/lora.py Fused): per layer and
// linear (qkv, o, gate_up, down: index 4 * layer + j), A, Bt and cols for lora_add_, undefined
// where the adapter does not target that linear.
struct StepLoRA {
  std::vector<at::Tensor> a, bt, cols;
};
std::shared_ptr<StepLoRA> step_lora(std::vector<c10::optional<at::Tensor>> a, std::vector<c10::optional<at::Tensor>> bt,
                                    std::vector<c10::optional<at::Tensor>> cols);
// loras: one per group of rows [bounds[2g], bounds[2g+1]) of lora_rows (an fp32 step): each
// linear's output gets its adapters' deltas (lora_add_), as the per-layer path adds them.
std::vector<at::Tensor> decode_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_pools,
                                      std::vector<at::Tensor> v_pools, at::Tensor slots, at::Tensor q_rows, at::Tensor table,
                                      at::Tensor lens, const DecodeWeights& w, std::vector<at::Tensor> k_scales,
                                      std::vector<at::Tensor> v_scales, c10::optional<at::Tensor> lora_rows,
                                      std::vector<int64_t> lora_bounds, std::vector<std::shared_ptr<StepLoRA>> loras);

}  // namespace rs
