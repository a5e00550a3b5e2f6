// A whole decode step's layers in one call: for a batch of decode rows only (one token each,
// no shared-prefix group), every decoder layer of a Llama-family model without biases or q/k
// norms, run here instead of from Python: the same kernels as the per-op path (so the same
// numbers), without the ~100 us of Python and dispatch per layer. Torch reference: the same ops
// called layer by layer (radixserve.models.llama.FusedDecode).
#include "common.h"

namespace rs {
namespace {

// Either kind of packed weight: a float/bf16 panel (pack_linear) or a quantized one (pack_quant).
at::Tensor any_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, bool float_out) {
  if (w.scalar_type() == at::kByte) return qlinear(x, w, n, c10::nullopt, float_out, false);
  return linear(x, w, n, c10::nullopt, float_out);
}

}  // namespace

// Returns (x, residual) before the final norm.
std::vector<at::Tensor> decode_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_pools,
                                         std::vector<at::Tensor> v_pools, at::Tensor slots, at::Tensor q_rows,
                                         at::Tensor table, at::Tensor lens, std::vector<at::Tensor> in_norm,
                                         std::vector<at::Tensor> qkv, std::vector<at::Tensor> o_proj,
                                         std::vector<at::Tensor> post_norm, std::vector<at::Tensor> gate_up,
                                         std::vector<at::Tensor> down, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t inter, double eps, double scale, std::vector<at::Tensor> k_scales,
                                         std::vector<at::Tensor> v_scales) {
  const size_t layers = in_norm.size();
  const bool quantized = !k_scales.empty();  // an int8 / fp8 pool: stored and read with its scales
  TORCH_CHECK(!quantized || (k_scales.size() == layers && v_scales.size() == layers),
              "decode_layers: a quantized pool's scales, one per layer");
  for (size_t i = 0; quantized && i < layers; ++i) {
    check_scales(k_pools[i], k_scales[i], "decode_layers");
    check_scales(v_pools[i], v_scales[i], "decode_layers");
  }
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  TORCH_CHECK(k_pools.size() == layers && v_pools.size() == layers && qkv.size() == layers && o_proj.size() == layers &&
                  post_norm.size() == layers && gate_up.size() == layers && down.size() == layers,
              "decode_layers: one of each weight and pool per layer");
  const int64_t rows = x.size(0), hidden = x.size(1), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  for (size_t i = 1; i < layers; ++i)
    TORCH_CHECK(k_pools[i].size(0) == k_pools[0].size(0) && v_pools[i].size(0) == k_pools[0].size(0),
                "decode_layers: every layer's pools hold the same slots");
  auto out_slots = slots.contiguous(), rows_c = q_rows.contiguous(), lens_c = lens.contiguous();
  check_slots(out_slots, k_pools[0].size(0));  // the new slots and the slot table, once for every layer
  check_table(rows_c, table, lens_c, rows, k_pools[0].size(0));
  at::Tensor residual;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor h;
    if (i == 0) {
      residual = x;
      h = rms_norm(x, c10::nullopt, in_norm[i], eps)[0];
    } else {
      auto r = rms_norm(x, residual, in_norm[i], eps);
      h = r[0];
      residual = r[1];
    }
    auto proj = any_linear(h, qkv[i], q_size + 2 * kv_size, false);
    auto q = proj.narrow(1, 0, q_size).view({rows, heads, head_dim});
    auto k = proj.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
    auto v = proj.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    rope_(q, k, cos, sin);
    auto attn = at::empty({rows, heads, head_dim}, x.options());
    if (quantized) {  // store_kv_quant and decode_attention_quant, past their (once-only) checks
      run_store_quant(k_pools[i], v_pools[i], k_scales[i], v_scales[i], out_slots, k, v);
      run_decode_quant(q, k_pools[i], v_pools[i], k_scales[i], v_scales[i], attn, nullptr, rows_c, table, lens_c, scale);
    } else {
      run_store(k_pools[i], v_pools[i], out_slots, k, v);
      run_decode(q, k_pools[i], v_pools[i], attn, nullptr, rows_c, table, lens_c, scale);
    }
    auto o = any_linear(attn.view({rows, q_size}), o_proj[i], hidden, false);
    auto r = rms_norm(o, residual, post_norm[i], eps);
    residual = r[1];
    x = any_linear(silu_and_mul(any_linear(r[0], gate_up[i], 2 * inter, false)), down[i], hidden, false);
  }
  return {x, residual};
}


}  // namespace rs
