// The module: every op of the other files, registered once. kernels/radixserve_kernels/cpu.py builds these sources
// once per instruction set (vec.h) and loads the best this CPU runs; `isa()` names the build.
#include <torch/extension.h>

#include "amx.h"
#include "common.h"

namespace {

std::string isa() {
  std::string s = rs::ISA;
#if defined(RS_AVX512) && defined(__AVX512VNNI__)
  s += "+vnni";
#endif
#if defined(RS_AVX512) && defined(__AVX512BF16__)
  s += "+bf16";
#endif
#if defined(RS_AMX)
  if (rs::amx_ready()) s += "+amx";  // built with the tiles, and this process may use them
#endif
  return s;
}

bool linear_supports_dtype(torch::Tensor w) { return rs::linear_supports(w.scalar_type()); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set these kernels were built for (avx512[+vnni][+bf16][+amx], avx2, generic)");
  m.def("decode_attention", &rs::decode_attention, "paged decode attention, in place on the pool");
  m.def("decode_attention_quant", &rs::decode_attention_quant, "paged decode attention over an int8/fp8 pool, in place");
  m.def("rms_norm", &rs::rms_norm, "RMSNorm with an optional fused residual add");
  m.def("rope_", &rs::rope_, "neox rotary embedding of q and k, in place");
  m.def("silu_and_mul", &rs::silu_and_mul, "SwiGLU activation");
  m.def("lora_add_", &rs::lora_add_, "LoRA deltas in place: y[rows of group g] += (A_g x) Bt_g (y, x, rows, bounds, As, Bts, cols)");
  m.def("store_kv", &rs::store_kv, "write K/V rows into the pool");
  m.def("store_kv_quant", &rs::store_kv_quant, "quantize K/V rows into an int8/fp8 pool and its scales");
  m.def("linear_supports", &linear_supports_dtype, "whether `linear` is built for this weight's dtype");
  m.def("pack_linear", &rs::pack_linear, "pack a weight (N, K) for `linear`");
  m.def("linear", &rs::linear, "a linear of a few rows over a packed weight (x, packed, n, bias, float_out)");
  m.def("pack_quant", &rs::pack_quant, "repack GGUF blocks (raw, kind, n, k) of q4_0/q4_1/q8_0/q5_0/q5_1/q4_k/q5_k/q6_k for qlinear");
  m.def("dequant_quant", &rs::dequant_quant, "fp32 rows of a pack_quant weight (packed, n, k, rows)");
  m.def("qlinear_many", &rs::qlinear_many, "several quantized linears in one parallel region, fp32 out (xs, packed, ns, act_bits)");
  m.def("set_amx", &rs::set_amx, "allow the AMX tiles for many-row quantized linears (on by default where built); returns whether they run");
  m.def("qlinear_parts", &rs::qlinear_parts, "quantized linears of one x side by side in one parallel region, out (rows, sum ns) in x's dtype (x, packed, ns, biases, act_bits)");
  m.def("qlinear", &rs::qlinear, "a linear over a pack_quant weight, activations quantized to act_bits 8 or 16 (x, packed, n, bias, float_out, generic, act_bits)");
  // module-local: each build (avx512, avx2, generic) may be loaded in one process, each with its own type
  pybind11::class_<rs::DecodeWeights, std::shared_ptr<rs::DecodeWeights>>(m, "DecodeWeights", pybind11::module_local());
  m.def("decode_weights", &rs::decode_weights,
        "every decoder layer's weights for decode_layers (in_norm, post_norm, q_norm, k_norm, qkv, o_proj, gate_up, down, "
        "heads, kv_heads, head_dim, inter, eps, scale, act_bits); a linear per layer is [(packed, width, bias or None), ...]");
  m.def("moe_experts", &rs::moe_experts,
        "a routed layer's chosen experts, fp32 sums in h's dtype (h, weights, experts, gate_ups, downs, inter, act_bits)");
  m.def("decode_moe", &rs::decode_moe,
        "a routed layer's experts for decode_layers (weights, layer, router panel, gate_ups, downs, inter, top_k, renorm)");
  pybind11::class_<rs::StepLoRA, std::shared_ptr<rs::StepLoRA>>(m, "StepLoRA", pybind11::module_local());
  m.def("step_lora", &rs::step_lora, "one LoRA adapter's weights for decode_layers (A, Bt, cols per layer and linear; None: not targeted)");
  m.def("decode_layers", &rs::decode_layers,
        "every decoder layer of a decode-only batch, in one call (and its rows' LoRA adapters: lora_rows, bounds, step_lora each)");
}
