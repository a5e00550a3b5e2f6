// A whole decode step's layers in one call: for a batch of decode rows only (one token each,
// no shared-prefix group), every decoder layer of a Llama-family model (Llama, Mistral; Qwen2's
// q/k/v biases; Qwen3's q/k norms; linears of mixed GGUF kinds as their parts), run here
// instead of from Python: the same kernels as the per-op path (so the same numbers), without the
// ~100 us of Python and dispatch per layer. Torch reference: the same ops called layer by layer
// (radixserve.models.llama.FusedDecode). Routed layers (a mixture of experts: Qwen3-MoE,
// Mixtral) route here and run their chosen experts in moe_experts, which the per-layer path
// (radixserve.models.moe.grouped_modules) calls too.
#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>

#include "common.h"

namespace rs {
namespace {

// Either kind of packed weight: a float/bf16 panel (pack_linear) or a quantized one (pack_quant).
at::Tensor part_linear(const at::Tensor& x, const StepLinear& l, size_t i, int64_t bits) {
  if (l.parts[i].scalar_type() == at::kByte) return qlinear(x, l.parts[i], l.widths[i], l.biases[i], false, false, bits);
  return linear(x, l.parts[i], l.widths[i], l.biases[i], false);
}

at::Tensor run_linear(const at::Tensor& x, const StepLinear& l, int64_t bits) {
  if (l.parts.size() == 1) return part_linear(x, l, 0, bits);
  if (std::all_of(l.parts.begin(), l.parts.end(), [](const at::Tensor& p) { return p.scalar_type() == at::kByte; }))
    return qlinear_parts(x, l.parts, l.widths, l.biases, bits);  // quantized parts of mixed kinds: one region
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < l.parts.size(); ++i) outs.push_back(part_linear(x, l, i, bits));
  return at::cat(outs, 1);
}

std::vector<StepLinear> step_linears(const std::vector<LinearParts>& layers, int64_t width, const char* what) {
  std::vector<StepLinear> out;
  for (const auto& parts : layers) {
    StepLinear l;
    int64_t sum = 0;
    for (const auto& [packed, n, bias] : parts) {
      TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
                  "decode_weights: ", what, ": a bias is fp32, contiguous, one per output");
      l.parts.push_back(packed);
      l.widths.push_back(n);
      l.biases.push_back(bias);
      sum += n;
    }
    // (no parts: a routed layer's MLP, whose experts decode_moe gives)
    TORCH_CHECK(parts.empty() || sum == width, "decode_weights: ", what, " parts make ", sum, " outputs, not ", width);
    out.push_back(std::move(l));
  }
  return out;
}

// A routed layer's MLP on h (rows, hidden): the router's logits, the top k of their fp32 softmax
// (renormalised where asked: models.moe.route), then moe_experts.
at::Tensor moe_step(const at::Tensor& h, const StepMoE& m, int64_t bits) {
  auto logits = linear(h, m.router, static_cast<int64_t>(m.gate_up.size()), c10::nullopt, false);
  auto [weights, chosen] = at::topk(at::softmax(logits.to(at::kFloat), -1), m.top_k, -1);
  if (m.renorm) weights = weights.div(weights.sum(-1, true));
  return moe_experts(h, weights, chosen, m.gate_up, m.down, m.inter, bits);
}

}  // namespace

// The chosen experts of a routed layer on h (rows, hidden), as models.moe.grouped_modules
// calls it too: each chosen expert once on its rows (experts in the order the rows first chose
// them; an expert of -1, another rank's, skipped), every gate_up in one qlinear_many and every
// down in another, the outputs weighted and summed per row in fp32 (in that order), returned
// in h's dtype. weights (rows, k) fp32, chosen (rows, k) int64.
at::Tensor moe_experts(at::Tensor h, at::Tensor weights, at::Tensor chosen, std::vector<at::Tensor> gate_up,
                       std::vector<at::Tensor> down, int64_t inter, int64_t act_bits) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && chosen.dim() == 2 && weights.scalar_type() == at::kFloat &&
                  chosen.scalar_type() == at::kLong && weights.sizes() == chosen.sizes() && chosen.size(0) == h.size(0) &&
                  down.size() == gate_up.size(),
              "moe_experts: contiguous h (rows, hidden), fp32 weights and int64 experts (rows, k), a gate_up and a down per expert");
  const int64_t rows = h.size(0), hidden = h.size(1), k = chosen.size(1), experts = static_cast<int64_t>(gate_up.size());
  weights = weights.contiguous();
  chosen = chosen.contiguous();
  const float* wp = weights.data_ptr<float>();
  const int64_t* ep = chosen.data_ptr<int64_t>();
  std::vector<int64_t> order;                                               // experts, as first chosen
  std::vector<std::vector<std::pair<int64_t, float>>> pairs(experts);  // each one's (row, weight)s
  for (int64_t i = 0; i < rows * k; ++i) {
    const int64_t e = ep[i];
    if (e < 0) continue;
    TORCH_CHECK(e < experts, "moe_experts: expert ", e, " of ", experts);
    if (pairs[e].empty()) order.push_back(e);
    pairs[e].emplace_back(i / k, wp[i]);
  }
  auto out = at::zeros({rows, hidden}, h.options().dtype(at::kFloat));
  if (order.empty()) return out.to(h.scalar_type());
  std::vector<at::Tensor> xs, ups, downs;
  std::vector<int64_t> counts;
  for (int64_t e : order) {
    const auto& p = pairs[e];
    if (p.size() == 1) {
      xs.push_back(h.narrow(0, p[0].first, 1));
    } else {
      std::vector<int64_t> ts;
      for (const auto& [t, _] : p) ts.push_back(t);
      xs.push_back(at::index_select(h, 0, at::tensor(ts, at::kLong)));
    }
    ups.push_back(gate_up[e]);
    downs.push_back(down[e]);
    counts.push_back(static_cast<int64_t>(p.size()));
  }
  auto hs = qlinear_many(xs, ups, std::vector<int64_t>(order.size(), 2 * inter), act_bits);
  auto acts = silu_and_mul(at::cat(hs)).split_with_sizes(counts);
  auto ys = qlinear_many(std::vector<at::Tensor>(acts.begin(), acts.end()), downs,
                         std::vector<int64_t>(order.size(), hidden), act_bits);
  // each output row's (job, row of the job's output, weight), in job order: rows summed in parallel, each in that order
  std::vector<std::vector<std::tuple<size_t, int64_t, float>>> parts(rows);
  for (size_t j = 0; j < order.size(); ++j) {
    const auto& p = pairs[order[j]];
    for (size_t r = 0; r < p.size(); ++r) parts[p[r].first].emplace_back(j, static_cast<int64_t>(r), p[r].second);
  }
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict dst = o + t * hidden;
      for (const auto& [j, r, w] : parts[t]) {
        const float* __restrict src = ys[j].data_ptr<float>() + r * hidden;
        for (int64_t c = 0; c < hidden; ++c) dst[c] += w * src[c];
      }
    }
  });
  return out.to(h.scalar_type());
}

void decode_moe(DecodeWeights& w, int64_t layer, at::Tensor router, std::vector<at::Tensor> gate_up,
                std::vector<at::Tensor> down, int64_t inter, int64_t top_k, bool renorm) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(w.moe.size()), "decode_moe: no layer ", layer);
  TORCH_CHECK(w.gate_up[layer].parts.empty() && w.down[layer].parts.empty(),
              "decode_moe: layer ", layer, " has a dense MLP (give it no gate_up/down parts)");
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "decode_moe: one gate_up and one down per expert");
  TORCH_CHECK(top_k >= 1 && top_k <= static_cast<int64_t>(gate_up.size()), "decode_moe: top_k ", top_k,
              " must be between 1 and the ", gate_up.size(), " experts");
  for (size_t e = 0; e < gate_up.size(); ++e)
    TORCH_CHECK(gate_up[e].scalar_type() == at::kByte && down[e].scalar_type() == at::kByte,
                "decode_moe: experts are packed quantized weights (pack_quant)");
  w.moe[layer] = StepMoE{std::move(router), std::move(gate_up), std::move(down), top_k, inter, renorm};
}

std::shared_ptr<DecodeWeights> decode_weights(std::vector<at::Tensor> in_norm, std::vector<at::Tensor> post_norm,
                                              std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm,
                                              std::vector<LinearParts> qkv, std::vector<LinearParts> o_proj,
                                              std::vector<LinearParts> gate_up, std::vector<LinearParts> down, int64_t heads,
                                              int64_t kv_heads, int64_t head_dim, int64_t inter, double eps, double scale,
                                              int64_t act_bits) {
  const size_t layers = in_norm.size();
  TORCH_CHECK(layers > 0, "decode_weights: no layers");
  TORCH_CHECK(post_norm.size() == layers && qkv.size() == layers && o_proj.size() == layers && gate_up.size() == layers &&
                  down.size() == layers && q_norm.size() == k_norm.size() && (q_norm.empty() || q_norm.size() == layers),
              "decode_weights: one of each weight per layer (q/k norms: none or one per layer)");
  const int64_t hidden = in_norm[0].numel();
  auto w = std::make_shared<DecodeWeights>();
  w->in_norm = std::move(in_norm);
  w->post_norm = std::move(post_norm);
  w->q_norm = std::move(q_norm);
  w->k_norm = std::move(k_norm);
  w->qkv = step_linears(qkv, (heads + 2 * kv_heads) * head_dim, "qkv");
  w->o_proj = step_linears(o_proj, hidden, "o_proj");
  w->gate_up = step_linears(gate_up, 2 * inter, "gate_up");
  w->down = step_linears(down, hidden, "down");
  w->moe.resize(layers);
  w->heads = heads;
  w->kv_heads = kv_heads;
  w->head_dim = head_dim;
  w->inter = inter;
  w->eps = eps;
  w->scale = scale;
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "decode_weights: act_bits is 8 or 16, got ", act_bits);
  w->act_bits = act_bits;
  return w;
}

std::shared_ptr<StepLoRA> step_lora(std::vector<c10::optional<at::Tensor>> a, std::vector<c10::optional<at::Tensor>> bt,
                                    std::vector<c10::optional<at::Tensor>> cols) {
  TORCH_CHECK(a.size() == bt.size() && a.size() == cols.size() && a.size() % 4 == 0,
              "step_lora: A, Bt and cols for each layer's qkv, o, gate_up and down (None: not targeted)");
  auto l = std::make_shared<StepLoRA>();
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].has_value() == bt[i].has_value() && a[i].has_value() == cols[i].has_value(),
                "step_lora: a linear has all of A, Bt and cols or none");
    l->a.push_back(a[i].value_or(at::Tensor()));
    l->bt.push_back(bt[i].value_or(at::Tensor()));
    l->cols.push_back(cols[i].value_or(at::Tensor()));
  }
  return l;
}

namespace {

// The adapters' deltas over linear j of layer i (y = its output for x): the groups whose adapter
// targets it, as models.lora.apply calls lora_add_.
void add_lora(at::Tensor& y, const at::Tensor& x, size_t i, int j, const at::Tensor& rows, const std::vector<int64_t>& bounds,
              const std::vector<std::shared_ptr<StepLoRA>>& loras) {
  std::vector<int64_t> b;
  std::vector<at::Tensor> as, bts, cols;
  for (size_t g = 0; g < loras.size(); ++g) {
    const StepLoRA& l = *loras[g];
    const size_t at = 4 * i + j;
    if (at >= l.a.size() || !l.a[at].defined()) continue;
    b.push_back(bounds[2 * g]);
    b.push_back(bounds[2 * g + 1]);
    as.push_back(l.a[at]);
    bts.push_back(l.bt[at]);
    cols.push_back(l.cols[at]);
  }
  if (!as.empty()) lora_add_(y, x.contiguous(), rows, b, as, bts, cols);
}

}  // namespace

// Returns (x, residual) before the final norm.
std::vector<at::Tensor> decode_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_pools,
                                      std::vector<at::Tensor> v_pools, at::Tensor slots, at::Tensor q_rows, at::Tensor table,
                                      at::Tensor lens, const DecodeWeights& w, std::vector<at::Tensor> k_scales,
                                      std::vector<at::Tensor> v_scales, c10::optional<at::Tensor> lora_rows,
                                      std::vector<int64_t> lora_bounds, std::vector<std::shared_ptr<StepLoRA>> loras) {
  const size_t layers = w.in_norm.size();
  const bool lora = lora_rows.has_value() && !loras.empty();
  TORCH_CHECK(!lora || (lora_bounds.size() == 2 * loras.size() && x.scalar_type() == at::kFloat),
              "decode_layers: LoRA adapters on an fp32 step, a range of lora_rows (first, end) per adapter");
  const at::Tensor lrows = lora ? lora_rows->contiguous() : at::Tensor();
  auto linear_at = [&](const at::Tensor& in, const StepLinear& l, size_t i, int j) {
    at::Tensor y = run_linear(in, l, w.act_bits);
    if (lora) add_lora(y, in, i, j, lrows, lora_bounds, loras);
    return y;
  };
  const int64_t heads = w.heads, kv_heads = w.kv_heads, head_dim = w.head_dim;
  const bool quantized = !k_scales.empty();  // an int8 / fp8 pool: stored and read with its scales
  TORCH_CHECK(!quantized || (k_scales.size() == layers && v_scales.size() == layers),
              "decode_layers: a quantized pool's scales, one per layer");
  for (size_t i = 0; quantized && i < layers; ++i) {
    check_scales(k_pools[i], k_scales[i], "decode_layers");
    check_scales(v_pools[i], v_scales[i], "decode_layers");
  }
  TORCH_CHECK(k_pools.size() == layers && v_pools.size() == layers, "decode_layers: one pool of each per layer");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in_norm[0].numel(), "decode_layers: x (rows, hidden) for these weights");
  const int64_t rows = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
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
      h = rms_norm(x, c10::nullopt, w.in_norm[i], w.eps)[0];
    } else {
      auto r = rms_norm(x, residual, w.in_norm[i], w.eps);
      h = r[0];
      residual = r[1];
    }
    auto proj = linear_at(h, w.qkv[i], i, 0);
    auto q = proj.narrow(1, 0, q_size).view({rows, heads, head_dim});
    auto k = proj.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
    auto v = proj.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    if (!w.q_norm.empty()) {  // Qwen3: each head's q and k normalized (as the per-layer path: contiguous first)
      q = rms_norm(q.contiguous(), c10::nullopt, w.q_norm[i], w.eps)[0];
      k = rms_norm(k.contiguous(), c10::nullopt, w.k_norm[i], w.eps)[0];
    }
    rope_(q, k, cos, sin);
    auto attn = at::empty({rows, heads, head_dim}, x.options());
    if (quantized) {  // store_kv_quant and decode_attention_quant, past their (once-only) checks
      run_store_quant(k_pools[i], v_pools[i], k_scales[i], v_scales[i], out_slots, k, v);
      run_decode_quant(q, k_pools[i], v_pools[i], k_scales[i], v_scales[i], attn, nullptr, rows_c, table, lens_c, w.scale);
    } else {
      run_store(k_pools[i], v_pools[i], out_slots, k, v);
      run_decode(q, k_pools[i], v_pools[i], attn, nullptr, rows_c, table, lens_c, w.scale);
    }
    auto o = linear_at(attn.view({rows, q_size}), w.o_proj[i], i, 1);
    auto r = rms_norm(o, residual, w.post_norm[i], w.eps);
    residual = r[1];
    if (!w.moe[i].gate_up.empty()) {
      x = moe_step(r[0], w.moe[i], w.act_bits);
    } else {
      TORCH_CHECK(!w.gate_up[i].parts.empty(), "decode_layers: layer ", i, " has neither an MLP nor experts");
      x = linear_at(silu_and_mul(linear_at(r[0], w.gate_up[i], i, 2)), w.down[i], i, 3);
    }
  }
  return {x, residual};
}

}  // namespace rs
