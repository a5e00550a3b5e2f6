// LoRA adapters' deltas over a linear's output (radixserve/models/lora.py): every row rows[i] with i in
// group g's range [bounds[2g], bounds[2g+1]) gets y[row] += (A_g x[row]) Bt_g, A_g (r, in) and
// Bt_g (r, out) fp32, each rank row k of Bt_g read only in its columns [cols_g[k][0], cols_g[k][1])
// (a fused linear's parts: zero elsewhere). One call a linear for the whole batch: the shrink in parallel over each
// group's rank rows, the expand over blocks of output columns, so each group's weights are read
// once for all its rows. Torch reference: radixserve_kernels.lora.lora_add_ref.
#include "common.h"

namespace rs {

namespace {
constexpr int64_t kCols = 256;  // the expand's block of output columns (a thread's share: its rows of y stay in cache)
}  // namespace

void lora_add_(at::Tensor y, at::Tensor x, at::Tensor rows, std::vector<int64_t> bounds, std::vector<at::Tensor> as,
               std::vector<at::Tensor> bts, std::vector<at::Tensor> cols) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && x.dim() == 2 && y.dim() == 2 &&
                  x.is_contiguous() && y.is_contiguous() && x.size(0) == y.size(0),
              "lora_add_: fp32 contiguous x (rows, in) and y (rows, out)");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1, "lora_add_: int64 rows");
  const int64_t groups = int64_t(as.size()), in = x.size(1), out = y.size(1), n = rows.numel();
  TORCH_CHECK(int64_t(bts.size()) == groups && int64_t(cols.size()) == groups && int64_t(bounds.size()) == 2 * groups,
              "lora_add_: an A, a Bt, its columns and a range of rows (first, end) per group");
  std::vector<const float*> ap(groups), bp(groups);
  std::vector<const int64_t*> cp(groups);
  std::vector<int64_t> ranks(groups), items, group_of;
  int64_t max_rank = 1;
  const int64_t* rd = rows.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor& a = as[g];
    const at::Tensor& bt = bts[g];
    TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat && a.is_contiguous() &&
                    bt.is_contiguous() && a.dim() == 2 && bt.dim() == 2 && a.size(1) == in && bt.size(1) == out &&
                    a.size(0) == bt.size(0),
                "lora_add_: A (r, in) and Bt (r, out), fp32 and contiguous");
    TORCH_CHECK(cols[g].scalar_type() == at::kLong && cols[g].is_contiguous() && cols[g].dim() == 2 &&
                    cols[g].size(0) == a.size(0) && cols[g].size(1) == 2,
                "lora_add_: cols (r, 2): the output columns [first, end) each rank row of Bt may be nonzero in");
    cp[g] = cols[g].data_ptr<int64_t>();
    for (int64_t k = 0; k < a.size(0); ++k)
      TORCH_CHECK(0 <= cp[g][2 * k] && cp[g][2 * k] <= cp[g][2 * k + 1] && cp[g][2 * k + 1] <= out,
                  "lora_add_: cols within the output");
    TORCH_CHECK(0 <= bounds[2 * g] && bounds[2 * g] <= bounds[2 * g + 1] && bounds[2 * g + 1] <= n,
                "lora_add_: a range of rows within rows");
    ap[g] = a.data_ptr<float>();
    bp[g] = bt.data_ptr<float>();
    ranks[g] = a.size(0);
    max_rank = std::max(max_rank, ranks[g]);
    for (int64_t i = bounds[2 * g]; i < bounds[2 * g + 1]; ++i) {
      TORCH_CHECK(rd[i] >= 0 && rd[i] < x.size(0), "lora_add_: a row out of range");
      items.push_back(rd[i]);
      group_of.push_back(g);
    }
  }
  const float* xd = x.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  const int64_t m = int64_t(items.size());
  // each group's rows share its weights: read A_g and Bt_g once for all of them, not once a row
  std::vector<int64_t> first(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) first[g + 1] = first[g] + (bounds[2 * g + 1] - bounds[2 * g]);
  std::vector<float> h(std::max<int64_t>(m, 1) * max_rank);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, rank row) pairs of the shrink
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t k = 0; k < ranks[g]; ++k) tasks.emplace_back(g, k);
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {  // h = x A^T
    for (int64_t t = begin; t < end; ++t) {
      const auto [g, k] = tasks[t];
      const float* ak = ap[g] + k * in;
      for (int64_t i = first[g]; i < first[g + 1]; ++i) {
        const float* xr = xd + items[i] * in;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < in; ++j) s += ak[j] * xr[j];
        h[i * max_rank + k] = s;
      }
    }
  });
  at::parallel_for(0, (out + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {  // y += h Bt, by column blocks
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kCols, hi = std::min(out, lo + kCols);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t k = 0; k < ranks[g]; ++k) {
          const int64_t from = std::max(lo, cp[g][2 * k]), to = std::min(hi, cp[g][2 * k + 1]);
          if (from >= to) continue;  // a fused linear's part: zero outside its columns
          const float* bk = bp[g] + k * out;
          for (int64_t i = first[g]; i < first[g + 1]; ++i) {
            const float hk = h[i * max_rank + k];
            float* yr = yd + items[i] * out;
#pragma omp simd
            for (int64_t j = from; j < to; ++j) yr[j] += hk * bk[j];
          }
        }
      }
    }
  });
}

}  // namespace rs
