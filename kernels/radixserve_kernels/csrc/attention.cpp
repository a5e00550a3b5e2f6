// Paged decode attention, reading the KV pool in place (no per-layer gather): float pools
// (fp32 / bf16) and quantized ones (int8 / fp8 e4m3 rows with an fp32 scale per slot and KV
// head). Torch reference: radixserve_kernels.decode_attention.decode_attention_ref.
#include "common.h"

#include <type_traits>
#include <utility>

namespace rs {
namespace {

constexpr int64_t MAX_GROUP = 8, MAX_DV = 128 / W;  // the vector path: up to 8 query heads per KV head, dim <= 128

// A quantized pool's scales for one KV head (k/v: the head's first entry; stride: per slot).
// A K row's scale multiplies its dot product, a V row's its softmax weight, so rows are
// widened to fp32 and never rescaled. Float pools have none (k == nullptr).
struct Scales {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t sk0 = 0, sv0 = 0;
};

// Each query row of scores (group, n) replaced by exp(score - its max), with the max and the
// sum kept (the caller divides).
inline void softmax_generic(float* scores, int64_t n, int64_t group, float* mx, float* sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float m = -std::numeric_limits<float>::infinity(), z = 0.f;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
    for (int64_t j = 0; j < n; ++j) z += (sg[j] = std::exp(sg[j] - m));
    mx[g] = m;
    sum[g] = z;
  }
}

inline void softmax_vec(float* scores, int64_t n, int64_t group, float* mx, float* sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    VecF m = vset1(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + W <= n; j += W) m = vmax(m, vload(sg + j));
    float mm = vhmax(m);
    for (int64_t t = j; t < n; ++t) mm = std::max(mm, sg[t]);
    const VecF mv = vset1(mm);
    VecF z = vzero();
    for (j = 0; j + W <= n; j += W) {
      const VecF e = vexp(vload(sg + j) - mv);
      vstore(sg + j, e);
      z = z + e;
    }
    float zz = vsum(z);
    if (j < n) {
      const VecF e = vexp(vload_part(sg + j, n - j) - mv);
      vstore_part(sg + j, e, n - j);
      float tail[W];
      vstore(tail, e);
      for (int64_t t = 0; t < n - j; ++t) zz += tail[t];
    }
    mx[g] = mm;
    sum[g] = zz;
  }
}

// One (request, KV head), the portable path: scores of the group's scaled queries qf
// (group, dim) against the n slots' keys, softmax, then the weighted sum of their values into
// acc (group, dim), with each query's max and denominator. Scores live in `scores` (group, n).
template <typename E, typename L>
void attend_generic(const float* qf, const E* kd, const E* vd, int64_t sk0, int64_t sv0, const Scales& sc, const int64_t* slots,
                    int64_t n, int64_t group, int64_t dim, float* scores, float* acc, float* mx, float* sum, const L& load) {
  for (int64_t j = 0; j < n; ++j) {
    const E* kr = kd + slots[j] * sk0;
    const float s0 = sc.k ? sc.k[slots[j] * sc.sk0] : 1.f;
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * load(kr, d);
      scores[g * n + j] = sc.k ? s * s0 : s;
    }
  }
  softmax_generic(scores, n, group, mx, sum);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const E* vr = vd + slots[j] * sv0;
    const float s0 = sc.v ? sc.v[slots[j] * sc.sv0] : 1.f;
    for (int64_t g = 0; g < group; ++g) {
      const float p = sc.v ? scores[g * n + j] * s0 : scores[g * n + j];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * load(vr, d);
    }
  }
}

// The vector path for `count` rows of one request at once (count 1: a row alone): row r's
// queries qf + r*group*dim attend to slots[0, n0 + r), its scores at
// scores + group*(r*n0 + r(r-1)/2) (stride n0 + r), its acc at acc + r*group*dim, its max and
// sum at mx/sum + r*group. Every row goes through the same operations in the same order
// whatever `count` is (a block of W slots by one transpose-and-add tree while the row has all
// W, then one slot at a time), so a row's numbers do not depend on the rows beside it; the K
// rows are read once for all rows and the V rows once per two.
template <typename E>
void attend_rows_vec(const float* qf, int64_t count, const E* kd, const E* vd, int64_t sk0, int64_t sv0, const Scales& sc,
                     const int64_t* slots, int64_t n0, int64_t group, int64_t dim, float* scores, float* acc, float* mx,
                     float* sum) {
  const int64_t dv = dim / W, gd = group * dim, nmax = n0 + count - 1, row_bytes = dim * sizeof(E);
  auto row_scores = [&](int64_t r) { return scores + group * (r * n0 + r * (r - 1) / 2); };
  VecF kv[MAX_DV], part[W];
  for (int64_t jj = 0; jj < std::min<int64_t>(nmax, W); ++jj) prefetch_row(kd + slots[jj] * sk0, row_bytes);
  for (int64_t j = 0; j < nmax; j += W) {
    for (int64_t jj = j + W; jj < std::min<int64_t>(nmax, j + 2 * W); ++jj) prefetch_row(kd + slots[jj] * sk0, row_bytes);
    VecF kscale = vset1(1.f);
    if (sc.k && j + W <= nmax) {
      float s[W];
      for (int jj = 0; jj < W; ++jj) s[jj] = sc.k[slots[j + jj] * sc.sk0];
      kscale = vload(s);
    }
    for (int64_t r = 0; r < count; ++r) {
      const int64_t n = n0 + r;
      const float* q = qf + r * gd;
      float* sr = row_scores(r);
      if (j + W <= n) {  // the block, by one tree
        for (int64_t g = 0; g < group; ++g) {
          for (int jj = 0; jj < W; ++jj) {
            const E* kr = kd + slots[j + jj] * sk0;
            VecF s = vload(q + g * dim) * vload(kr);
            for (int64_t c = 1; c < dv; ++c) s = vfma(vload(q + g * dim + W * c), vload(kr + W * c), s);
            part[jj] = s;
          }
          const VecF t = vsums(part);
          vstore(sr + g * n + j, sc.k ? t * kscale : t);
        }
        continue;
      }
      for (int64_t jt = j; jt < n; ++jt) {  // its tail, one slot at a time
        const E* kr = kd + slots[jt] * sk0;
        const float s0 = sc.k ? sc.k[slots[jt] * sc.sk0] : 1.f;
        for (int64_t c = 0; c < dv; ++c) kv[c] = vload(kr + W * c);
        for (int64_t g = 0; g < group; ++g) {
          VecF s = vload(q + g * dim) * kv[0];
          for (int64_t c = 1; c < dv; ++c) s = vfma(vload(q + g * dim + W * c), kv[c], s);
          sr[g * n + jt] = sc.k ? vsum(s) * s0 : vsum(s);
        }
      }
    }
  }
  for (int64_t r = 0; r < count; ++r) softmax_vec(row_scores(r), n0 + r, group, mx + r * group, sum + r * group);
  VecF a0[MAX_GROUP * MAX_DV], a1[MAX_GROUP * MAX_DV];
  for (int64_t r = 0; r < count; r += 2) {  // two rows per pass over the V rows
    const bool pair = r + 1 < count;
    const int64_t na = n0 + r, nb = na + 1, last = pair ? nb : na;
    const float* sa = row_scores(r);
    const float* sb = pair ? row_scores(r + 1) : nullptr;
    for (int64_t i = 0; i < group * dv; ++i) a0[i] = a1[i] = vzero();
    for (int64_t j = 0; j < std::min<int64_t>(last, 8); ++j) prefetch_row(vd + slots[j] * sv0, row_bytes);
    for (int64_t j = 0; j < last; ++j) {
      if (j + 8 < last) prefetch_row(vd + slots[j + 8] * sv0, row_bytes);
      const E* vr = vd + slots[j] * sv0;
      const float s0 = sc.v ? sc.v[slots[j] * sc.sv0] : 1.f;
      for (int64_t c = 0; c < dv; ++c) kv[c] = vload(vr + W * c);
      for (int64_t g = 0; g < group; ++g) {
        if (j < na) {
          const VecF p = vset1(sc.v ? sa[g * na + j] * s0 : sa[g * na + j]);
          for (int64_t c = 0; c < dv; ++c) a0[g * dv + c] = vfma(p, kv[c], a0[g * dv + c]);
        }
        if (pair) {
          const VecF p = vset1(sc.v ? sb[g * nb + j] * s0 : sb[g * nb + j]);
          for (int64_t c = 0; c < dv; ++c) a1[g * dv + c] = vfma(p, kv[c], a1[g * dv + c]);
        }
      }
    }
    for (int64_t i = 0; i < group * dv; ++i) vstore(acc + r * gd + W * i, a0[i]);
    if (pair)
      for (int64_t i = 0; i < group * dv; ++i) vstore(acc + (r + 1) * gd + W * i, a1[i]);
  }
}

// Runs of rows that are one request's consecutive positions (a draft's rows: row b + 1 reads
// row b's slots and one more), cut into near-equal pieces of at most RUN_ROWS rows (pieces, not
// whole runs, keep both threads busy at batch 1). A piece is one work item per KV head, so its
// rows read the K/V once (attend_rows_vec) instead of once each. join false: every row alone.
constexpr int64_t RUN_ROWS = 4;

std::vector<std::pair<int64_t, int64_t>> row_runs(const int64_t* table, int64_t stride, const int64_t* lens, int64_t batch,
                                                  bool join) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  for (int64_t b = 0; b < batch;) {
    int64_t e = b + 1;
    while (join && e < batch && lens[e] == lens[e - 1] + 1 &&
           std::memcmp(table + e * stride, table + (e - 1) * stride, lens[e - 1] * sizeof(int64_t)) == 0)
      ++e;
    const int64_t r = e - b, pieces = (r + RUN_ROWS - 1) / RUN_ROWS;
    for (int64_t c = 0, first = b; c < pieces; ++c) {
      const int64_t len = r / pieces + (c < r % pieces ? 1 : 0);
      runs.emplace_back(first, len);
      first += len;
    }
    b = e;
  }
  return runs;
}

// For request b: query row q[q_rows[b]] (heads, D) attends to the KV slots table[b, :lens[b]]
// of the pools (slots, kv_heads, D) of element type E. All query heads of one KV head are
// scored together, so each K/V row is read once per group. Writes out[q_rows[b]] and, if
// given, lse[b, head]. Where items share slots (a fork's prefix, a draft's pieces) work goes KV
// head by KV head, the items inside, so consecutive items read the same head's rows from cache;
// otherwise item by item, its heads inside: a pool row holds every head's (slots, kv_heads, D),
// and a head-major pass over distinct rows fetched each row from memory once per head (the
// prefetchers bring its neighbours' lines too). Shapes off the vector path (dim not a multiple
// of W or over 128, more than 8 query heads per KV head) take the portable path, one row at a time.
template <typename T, typename E>
void decode_impl(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor* ksc,
                 const at::Tensor* vsc, at::Tensor& out, float* lse, const int64_t* rows, const int64_t* table,
                 int64_t table_stride, const int64_t* lens, int64_t batch, float scale) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = kp.size(1), group = heads / kv_heads;
  const E* kd = ptr<E>(kp);
  const E* vd = ptr<E>(vp);
  const int64_t sk0 = kp.stride(0), sk1 = kp.stride(1), sv0 = vp.stride(0), sv1 = vp.stride(1);
  const bool vec = dim % W == 0 && dim / W <= MAX_DV && group <= MAX_GROUP;
  const T* qd = ptr<T>(q);
  T* od = ptr<T>(out);
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  const auto runs = row_runs(table, table_stride, lens, batch, vec);
  const int64_t items = int64_t(runs.size());
  bool shared = false;
  for (int64_t i = 1; i < items && !shared; ++i) {
    const int64_t a = runs[i - 1].first, b = runs[i].first;
    shared = lens[a] > 0 && lens[b] > 0 && table[a * table_stride] == table[b * table_stride];
  }
  at::parallel_for(0, items * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, mx, sum;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = shared ? w / items : w % kv_heads, item = shared ? w % items : w / kv_heads;
      const int64_t b0 = runs[item].first, count = runs[item].second, n0 = lens[b0];
      qf.resize(count * group * dim);
      acc.resize(count * group * dim);
      mx.resize(count * group);
      sum.resize(count * group);
      scores.resize(group * (count * n0 + count * (count - 1) / 2));
      for (int64_t r = 0; r < count; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const T* qr = qd + rows[b0 + r] * sq0 + (h * group + g) * sq1;
          for (int64_t d = 0; d < dim; ++d) qf[(r * group + g) * dim + d] = ld(qr, d) * scale;
        }
      Scales sc;
      if (ksc) sc = {ksc->data_ptr<float>() + h, vsc->data_ptr<float>() + h, ksc->stride(0), vsc->stride(0)};
      // every row's slots are the first of the run's last row's
      const int64_t* slots = table + (b0 + count - 1) * table_stride;
      if (vec) {
        attend_rows_vec<E>(qf.data(), count, kd + h * sk1, vd + h * sv1, sk0, sv0, sc, slots, n0, group, dim, scores.data(),
                           acc.data(), mx.data(), sum.data());
      } else if constexpr (std::is_same_v<E, T>) {
        attend_generic(qf.data(), kd + h * sk1, vd + h * sv1, sk0, sv0, sc, slots, n0, group, dim, scores.data(), acc.data(),
                       mx.data(), sum.data(), [](const E* p, int64_t i) { return ld(p, i); });
      } else {
        attend_generic(qf.data(), kd + h * sk1, vd + h * sv1, sk0, sv0, sc, slots, n0, group, dim, scores.data(), acc.data(),
                       mx.data(), sum.data(), [](const E* p, int64_t i) { return ldq(p, i); });
      }
      for (int64_t r = 0; r < count; ++r) {
        const int64_t b = b0 + r, n = lens[b];
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = h * group + g, at = r * group + g;
          T* orow = od + rows[b] * so0 + head * so1;
          const float inv = n > 0 ? 1.f / sum[at] : 0.f;
          for (int64_t d = 0; d < dim; ++d) st(orow, d, acc[at * dim + d] * inv);
          if (lse) lse[b * heads + head] = n > 0 ? mx[at] + std::log(sum[at]) : -std::numeric_limits<float>::infinity();
        }
      }
    }
  });
}

void check_shapes(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& out,
                  const char* name) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3 && out.dim() == 3, name, ": 3-d q/pools/out");
  TORCH_CHECK(q.stride(2) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && out.stride(2) == 1, name,
              ": the head dim must be contiguous");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, name, ": heads must be a multiple of kv_heads");
}

float* lse_ptr(const c10::optional<at::Tensor>& lse, const at::Tensor& table, const at::Tensor& q, const char* name) {
  if (!lse.has_value()) return nullptr;
  TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->numel() == table.size(0) * q.size(1), name,
              ": lse is a contiguous float32 (batch, heads)");
  return lse->data_ptr<float>();
}

}  // namespace

// The index checks of decode_attention, apart: a bad slot would read outside the pool, so
// every table entry is checked (decode_layers checks its table once, not once per layer).
void check_table(const at::Tensor& rows, const at::Tensor& table, const at::Tensor& lens, int64_t q_rows_bound,
                 int64_t pool_slots) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  rows.is_contiguous() && lens.is_contiguous() && table.stride(1) == 1,
              "decode_attention: contiguous int64 q_rows/seq_lens, an int64 table with contiguous rows");
  TORCH_CHECK(rows.numel() == table.size(0) && lens.numel() == table.size(0), "decode_attention: one q row and length per table row");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < table.size(0); ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < q_rows_bound, "decode_attention: q row ", rp[b], " out of range");
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= table.size(1), "decode_attention: length ", lp[b], " exceeds the table's width");
    const int64_t* row = tp + b * table.stride(0);
    for (int64_t j = 0; j < lp[b]; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < pool_slots, "decode_attention: slot ", row[j], " out of range");
  }
}

// The scales of a quantized pool: fp32 (slots, kv_heads), one per row of the pool.
void check_scales(const at::Tensor& pool, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == pool.size(0) &&
                  scales.size(1) == pool.size(1) && scales.stride(1) == 1,
              name, ": fp32 scales (slots, kv_heads) with contiguous rows, one per pool row");
}

// decode_attention over a table check_table has passed.
void run_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                float* lse, const at::Tensor& rows, const at::Tensor& table, const at::Tensor& lens, double scale) {
  check_shapes(q, k_pool, v_pool, out, "decode_attention");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "decode_attention: q, pools and out share a dtype");
  DISPATCH_FLOAT_BF16(q, "decode_attention", [&] {
    decode_impl<scalar, scalar>(q, k_pool, v_pool, nullptr, nullptr, out, lse, rows.data_ptr<int64_t>(), table.data_ptr<int64_t>(),
                                table.stride(0), lens.data_ptr<int64_t>(), table.size(0), float(scale));
  });
}

// decode_attention_quant over a table check_table has passed and scales check_scales has.
void run_decode_quant(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& k_scale, const at::Tensor& v_scale, at::Tensor& out, float* lse,
                      const at::Tensor& rows, const at::Tensor& table, const at::Tensor& lens, double scale) {
  DISPATCH_FLOAT_BF16(q, "decode_attention_quant", [&] {
    DISPATCH_KV_QUANT(k_pool, "decode_attention_quant", [&] {
      decode_impl<scalar, qtype>(q, k_pool, v_pool, &k_scale, &v_scale, out, lse, rows.data_ptr<int64_t>(),
                                 table.data_ptr<int64_t>(), table.stride(0), lens.data_ptr<int64_t>(), table.size(0), float(scale));
    });
  });
}

void decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor out,
                      c10::optional<at::Tensor> lse, at::Tensor q_rows, at::Tensor table, at::Tensor seq_lens,
                      double scale) {
  auto rows = q_rows.contiguous(), lens = seq_lens.contiguous();
  check_table(rows, table, lens, std::min(q.size(0), out.size(0)), std::min(k_pool.size(0), v_pool.size(0)));
  run_decode(q, k_pool, v_pool, out, lse_ptr(lse, table, q, "decode_attention"), rows, table, lens, scale);
}

void decode_attention_quant(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale,
                            at::Tensor v_scale, at::Tensor out, c10::optional<at::Tensor> lse, at::Tensor q_rows,
                            at::Tensor table, at::Tensor seq_lens, double scale) {
  auto rows = q_rows.contiguous(), lens = seq_lens.contiguous();
  check_table(rows, table, lens, std::min(q.size(0), out.size(0)), std::min(k_pool.size(0), v_pool.size(0)));
  check_shapes(q, k_pool, v_pool, out, "decode_attention_quant");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == q.size(2),
              "decode_attention_quant: pools of one dtype and shape, out in q's dtype");
  check_scales(k_pool, k_scale, "decode_attention_quant");
  check_scales(v_pool, v_scale, "decode_attention_quant");
  run_decode_quant(q, k_pool, v_pool, k_scale, v_scale, out, lse_ptr(lse, table, q, "decode_attention_quant"), rows, table, lens,
                   scale);
}

}  // namespace rs
