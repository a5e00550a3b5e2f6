// LoRA adapters' deltas over a linear's output (radixserve/models/lora.py): every row rows[i] with i in
// group g's range [bounds[2g], bounds[2g+1]) gets y[row] += (A_g x[row]) Bt_g, A_g (r, in) and
// Bt_g (r, out) fp32 or bf16 (an adapter's weights, --lora-dtype), each rank row k of Bt_g read only in
// its columns [cols_g[k][0], cols_g[k][1]) (a fused linear's parts: zero elsewhere). One call a linear
// for the whole batch, each group's weights read once for all its rows: the shrink in parallel over
// each group's blocks of 4 rank rows (4 dot products a row share each x load), the expand over
// blocks of 4 vectors of output columns (4 rows' accumulators share each Bt load, y read and written
// once a block). Sums in fp32. Torch reference: radixserve_kernels.lora.lora_add_ref.
#include "common.h"

namespace rs {

namespace {

constexpr int64_t KR = 4;  // rank rows per shrink task; rows per expand tile
constexpr int64_t NV = 4;  // vectors of output columns per expand block
constexpr int64_t PFD = 2;  // expand blocks ahead whose rank rows the first rows' pass prefetches

template <typename W>
std::vector<const W*> cast_all(const std::vector<at::Tensor>& ts) {
  std::vector<const W*> out;
  for (const auto& t : ts) out.push_back(reinterpret_cast<const W*>(t.data_ptr()));
  return out;
}

// h[i][k] = A_g[k] . x[items[i]] for every row i of every group, 4 rank rows a task.
template <typename W>
void shrink(const float* xd, int64_t in, const std::vector<int64_t>& items, const std::vector<int64_t>& first,
            const std::vector<int64_t>& ranks, int64_t max_rank, const std::vector<const W*>& ap, std::vector<float>& h) {
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, first rank row)
  for (size_t g = 0; g < ranks.size(); ++g)
    if (first[g + 1] > first[g])
      for (int64_t k = 0; k < ranks[g]; k += KR) tasks.emplace_back(g, k);
  constexpr int64_t L = VecF::W;
  const int64_t body = in / L * L;
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    auto block_of = [&](int64_t t) { return ap[tasks[t].first] + tasks[t].second * in; };
    auto rows_of = [&](int64_t t) { return std::min(KR, ranks[tasks[t].first] - tasks[t].second); };
    prefetch_row(block_of(begin), rows_of(begin) * in * int64_t(sizeof(W)));
    for (int64_t t = begin; t < end; ++t) {
      const auto [g, k0] = tasks[t];
      const int64_t kn = rows_of(t);
      const W* a = block_of(t);
      if (t + 1 < end)  // the next task's rank rows come off memory while these are summed
        prefetch_row(block_of(t + 1), rows_of(t + 1) * in * int64_t(sizeof(W)));
      for (int64_t i = first[g]; i < first[g + 1]; ++i) {
        const float* xr = xd + items[i] * in;
        VecF acc[KR] = {vzero(), vzero(), vzero(), vzero()};
        for (int64_t j = 0; j < body; j += L) {
          const VecF xv = vload(xr + j);
          for (int64_t q = 0; q < kn; ++q) acc[q] = vfma(vload(a + q * in + j), xv, acc[q]);
        }
        for (int64_t q = 0; q < kn; ++q) {
          float s = vsum(acc[q]);
          for (int64_t j = body; j < in; ++j) s += ld(a + q * in, j) * xr[j];
          h[i * max_rank + k0 + q] = s;
        }
      }
    }
  });
}

// y[items[i]] += h[i] Bt_g over blocks of NV vectors of columns; a rank row's columns outside
// [cols[k][0], cols[k][1]) are skipped (a block it covers in part: one column at a time).
template <typename W>
void expand(float* yd, int64_t out, const std::vector<int64_t>& items, const std::vector<int64_t>& first,
            const std::vector<int64_t>& ranks, int64_t max_rank, const std::vector<const int64_t*>& cp,
            const std::vector<const W*>& bp, const std::vector<float>& h) {
  constexpr int64_t L = VecF::W, BC = NV * L;
  at::parallel_for(0, (out + BC - 1) / BC, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * BC, hi = std::min(out, lo + BC);
      const bool whole = hi - lo == BC;
      for (size_t g = 0; g < ranks.size(); ++g) {
        const int64_t* cols = cp[g];
        for (int64_t i0 = first[g]; i0 < first[g + 1]; i0 += KR) {
          const int64_t rn = std::min(KR, first[g + 1] - i0);
          auto covers = [&](int64_t k) { return whole && cols[2 * k] <= lo && hi <= cols[2 * k + 1]; };
          if (whole) {  // the rank rows that cover the whole block: NV vectors of each row's accumulators
            VecF acc[KR][NV];
            for (int64_t r = 0; r < rn; ++r)
              for (int64_t v = 0; v < NV; ++v) acc[r][v] = vload(yd + items[i0 + r] * out + lo + v * L);
            for (int64_t k = 0; k < ranks[g]; ++k) {
              if (!covers(k)) continue;
              const W* bk = bp[g] + k * out;
              if (i0 == first[g] && lo + (PFD + 1) * BC <= out)  // (48-192 rank rows: more streams than the prefetcher follows)
                prefetch_row(bk + lo + PFD * BC, BC * int64_t(sizeof(W)));
              VecF b[NV];
              for (int64_t v = 0; v < NV; ++v) b[v] = vload(bk + lo + v * L);
              for (int64_t r = 0; r < rn; ++r) {
                const VecF hk = vset1(h[(i0 + r) * max_rank + k]);
                for (int64_t v = 0; v < NV; ++v) acc[r][v] = vfma(hk, b[v], acc[r][v]);
              }
            }
            for (int64_t r = 0; r < rn; ++r)
              for (int64_t v = 0; v < NV; ++v) vstore(yd + items[i0 + r] * out + lo + v * L, acc[r][v]);
          }
          for (int64_t k = 0; k < ranks[g]; ++k) {  // the rest (a part's edge, the last block): column by column
            const int64_t from = std::max(lo, cols[2 * k]), to = std::min(hi, cols[2 * k + 1]);
            if (from >= to || covers(k)) continue;  // (a fused linear's part: zero outside its columns)
            const W* bk = bp[g] + k * out;
            for (int64_t r = 0; r < rn; ++r) {
              const float hk = h[(i0 + r) * max_rank + k];
              float* yr = yd + items[i0 + r] * out;
              for (int64_t j = from; j < to; ++j) yr[j] = std::fma(hk, ld(bk, j), yr[j]);
            }
          }
        }
      }
    }
  });
}

template <typename W>
void lora_impl(const float* xd, float* yd, int64_t in, int64_t out, const std::vector<int64_t>& items,
               const std::vector<int64_t>& first, const std::vector<int64_t>& ranks, int64_t max_rank,
               const std::vector<const int64_t*>& cp, const std::vector<const W*>& ap, const std::vector<const W*>& bp,
               std::vector<float>& h) {
  shrink(xd, in, items, first, ranks, max_rank, ap, h);
  expand(yd, out, items, first, ranks, max_rank, cp, bp, h);
}

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
  std::vector<const int64_t*> cp(groups);
  std::vector<int64_t> ranks(groups), items;
  int64_t max_rank = 1;
  const int64_t* rd = rows.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor& a = as[g];
    const at::Tensor& bt = bts[g];
    TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                    a.scalar_type() == as[0].scalar_type() && bt.scalar_type() == a.scalar_type() && a.is_contiguous() &&
                    bt.is_contiguous() && a.dim() == 2 && bt.dim() == 2 && a.size(1) == in && bt.size(1) == out &&
                    a.size(0) == bt.size(0),
                "lora_add_: A (r, in) and Bt (r, out), contiguous, all fp32 or all bf16");
    TORCH_CHECK(cols[g].scalar_type() == at::kLong && cols[g].is_contiguous() && cols[g].dim() == 2 &&
                    cols[g].size(0) == a.size(0) && cols[g].size(1) == 2,
                "lora_add_: cols (r, 2): the output columns [first, end) each rank row of Bt may be nonzero in");
    cp[g] = cols[g].data_ptr<int64_t>();
    for (int64_t k = 0; k < a.size(0); ++k)
      TORCH_CHECK(0 <= cp[g][2 * k] && cp[g][2 * k] <= cp[g][2 * k + 1] && cp[g][2 * k + 1] <= out,
                  "lora_add_: cols within the output");
    TORCH_CHECK(0 <= bounds[2 * g] && bounds[2 * g] <= bounds[2 * g + 1] && bounds[2 * g + 1] <= n,
                "lora_add_: a range of rows within rows");
    ranks[g] = a.size(0);
    max_rank = std::max(max_rank, ranks[g]);
    for (int64_t i = bounds[2 * g]; i < bounds[2 * g + 1]; ++i) {
      TORCH_CHECK(rd[i] >= 0 && rd[i] < x.size(0), "lora_add_: a row out of range");
      items.push_back(rd[i]);
    }
  }
  if (items.empty()) return;
  const float* xd = x.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  std::vector<int64_t> first(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) first[g + 1] = first[g] + (bounds[2 * g + 1] - bounds[2 * g]);
  std::vector<float> h(std::max<int64_t>(first[groups], 1) * max_rank);
  if (as[0].scalar_type() == at::kFloat)
    lora_impl(xd, yd, in, out, items, first, ranks, max_rank, cp, cast_all<float>(as), cast_all<float>(bts), h);
  else
    lora_impl(xd, yd, in, out, items, first, ranks, max_rank, cp, cast_all<uint16_t>(as), cast_all<uint16_t>(bts), h);
}

}  // namespace rs
