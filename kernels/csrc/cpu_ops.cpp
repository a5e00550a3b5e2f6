// radixserve's CPU kernels: the small ops of a decode step fused into one call each, and
// decode attention that reads the paged KV pool in place (no per-layer gather). Built on
// first use by kernels/cpu.py (torch.utils.cpp_extension, -O3 -march=native); each op has a
// torch reference it is tested against (kernels/cpu.py names them).
//
// Types: fp32 and bf16 tensors; bf16 is read as raw uint16 and widened to fp32, and every
// sum is accumulated in fp32. A quantized KV pool is int8 or fp8 e4m3 (raw uint8) rows with
// fp32 scales. Threads: at::parallel_for, torch's own OpenMP pool.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const uint16_t* p, int64_t i) {
  uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(uint16_t* p, int64_t i, float v) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = 0x7fc0;  // NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = uint16_t(u >> 16);
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Runs body<float> or body<uint16_t> by the tensor's dtype.
#define DISPATCH_FLOAT_BF16(t, name, ...)                                        \
  do {                                                                           \
    if ((t).scalar_type() == torch::kFloat) {                                    \
      using scalar = float;                                                      \
      __VA_ARGS__();                                                             \
    } else if ((t).scalar_type() == torch::kBFloat16) {                          \
      using scalar = uint16_t;                                                   \
      __VA_ARGS__();                                                             \
    } else {                                                                     \
      TORCH_CHECK(false, name ": float32 or bfloat16 tensors only, got ", (t).scalar_type()); \
    }                                                                            \
  } while (0)

// --- decode attention ----------------------------------------------------------------------
// Each query row of scores (group, n) replaced by exp(score - its max), with the max and the
// sum kept (the caller divides): one pass over the float pool's scores or a quantized one's.
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

// One (request, KV head): scores of the group's scaled queries qf (group, dim) against the
// n slots' keys, softmax, then the weighted sum of their values into acc (group, dim), with
// each query's max and denominator. Scores live in `scores` (group, n).
template <typename T>
void attend_generic(const float* qf, const T* kd, const T* vd, int64_t sk0, int64_t sv0, const int64_t* slots, int64_t n,
                    int64_t group, int64_t dim, float* scores, float* acc, float* mx, float* sum) {
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kd + slots[j] * sk0;
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * ld(kr, d);
      scores[g * n + j] = s;
    }
  }
  softmax_generic(scores, n, group, mx, sum);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vd + slots[j] * sv0;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += scores[g * n + j] * ld(vr, d);
  }
}

#if defined(__AVX512F__)
constexpr int64_t MAX_GROUP = 8, MAX_DV = 8;  // the vector path: up to 8 query heads per KV head, dim <= 128

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // round to nearest even, as torch does
#if defined(__AVX512BF16__)
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}

// exp(x): 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5] by a degree-6 polynomial (relative
// error ~2e-7); x is clamped to [-87, 88] (below: ~0, as exp in fp32; above: ~fp32's max).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline void softmax_avx512(float* scores, int64_t n, int64_t group, float* mx, float* sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, sg + j));
    }
    const float mm = _mm512_reduce_max_ps(m);
    const __m512 mv = _mm512_set1_ps(mm);
    __m512 z = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + j), mv));
      _mm512_mask_storeu_ps(sg + j, k, e);
      z = _mm512_mask_add_ps(z, k, z, e);
    }
    mx[g] = mm;
    sum[g] = _mm512_reduce_add_ps(z);
  }
}

// One head's K or V row (dim elements) on its way into the cache: the slots are scattered, so
// no hardware prefetcher sees the stream coming.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// The sums of 16 vectors, as one vector (out[i] = sum of v[i]'s lanes): a transpose-and-add
// tree, 46 instructions for 16 dot products instead of 16 horizontal reductions of 8.
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // r holds v0 v2 v1 v3 | v8 v10 v9 v11 | v4 v6 v5 v7 | v12 v14 v13 v15
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), r);
}

template <typename T>
void attend_avx512(const float* qf, const T* kd, const T* vd, int64_t sk0, int64_t sv0, const int64_t* slots, int64_t n,
                   int64_t group, int64_t dim, float* scores, float* acc, float* mx, float* sum) {
  const int64_t dv = dim / 16;
  __m512 q[MAX_GROUP * MAX_DV], a[MAX_GROUP * MAX_DV], kv[MAX_DV], part[16];
  for (int64_t i = 0; i < group * dv; ++i) q[i] = _mm512_loadu_ps(qf + 16 * i);
  for (int64_t jj = 0; jj < std::min<int64_t>(n, 16); ++jj) prefetch_row(kd + slots[jj] * sk0, dim * sizeof(T));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // 16 slots at a time, their dot products summed by one tree
    for (int64_t jj = j + 16; jj < std::min(n, j + 32); ++jj) prefetch_row(kd + slots[jj] * sk0, dim * sizeof(T));
    for (int64_t g = 0; g < group; ++g) {
      for (int jj = 0; jj < 16; ++jj) {
        const T* kr = kd + slots[j + jj] * sk0;
        __m512 s = _mm512_mul_ps(q[g * dv], load16(kr));
        for (int64_t c = 1; c < dv; ++c) s = _mm512_fmadd_ps(q[g * dv + c], load16(kr + 16 * c), s);
        part[jj] = s;
      }
      _mm512_storeu_ps(scores + g * n + j, sum16(part));
    }
  }
  for (; j < n; ++j) {
    const T* kr = kd + slots[j] * sk0;
    for (int64_t c = 0; c < dv; ++c) kv[c] = load16(kr + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      __m512 s = _mm512_mul_ps(q[g * dv], kv[0]);
      for (int64_t c = 1; c < dv; ++c) s = _mm512_fmadd_ps(q[g * dv + c], kv[c], s);
      scores[g * n + j] = _mm512_reduce_add_ps(s);
    }
  }
  softmax_avx512(scores, n, group, mx, sum);
  for (int64_t i = 0; i < group * dv; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < std::min<int64_t>(n, 8); ++j) prefetch_row(vd + slots[j] * sv0, dim * sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    if (j + 8 < n) prefetch_row(vd + slots[j + 8] * sv0, dim * sizeof(T));
    const T* vr = vd + slots[j] * sv0;
    for (int64_t c = 0; c < dv; ++c) kv[c] = load16(vr + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + j]);
      for (int64_t c = 0; c < dv; ++c) a[g * dv + c] = _mm512_fmadd_ps(p, kv[c], a[g * dv + c]);
    }
  }
  for (int64_t i = 0; i < group * dv; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

// attend_avx512 for `count` rows of one request at once: row r's queries qf + r*group*dim
// attend to slots[0, n0 + r), its scores at scores + group*(r*n0 + r(r-1)/2) (stride n0 + r),
// its acc at acc + r*group*dim, its max and sum at mx/sum + r*group. Every row goes through
// exactly attend_avx512's operations in its order (a block of 16 slots by the tree while the
// row has all 16, then one slot at a time), so its numbers are the same bit for bit; the K
// rows are read once for all rows and the V rows once per two.
template <typename T>
void attend_rows_avx512(const float* qf, int64_t count, const T* kd, const T* vd, int64_t sk0, int64_t sv0, const int64_t* slots,
                        int64_t n0, int64_t group, int64_t dim, float* scores, float* acc, float* mx, float* sum) {
  const int64_t dv = dim / 16, gd = group * dim, nmax = n0 + count - 1;
  auto row_scores = [&](int64_t r) { return scores + group * (r * n0 + r * (r - 1) / 2); };
  __m512 kv[MAX_DV], part[16];
  for (int64_t jj = 0; jj < std::min<int64_t>(nmax, 16); ++jj) prefetch_row(kd + slots[jj] * sk0, dim * sizeof(T));
  for (int64_t j = 0; j < nmax; j += 16) {
    for (int64_t jj = j + 16; jj < std::min(nmax, j + 32); ++jj) prefetch_row(kd + slots[jj] * sk0, dim * sizeof(T));
    for (int64_t r = 0; r < count; ++r) {
      const int64_t n = n0 + r;
      const float* q = qf + r * gd;
      float* sr = row_scores(r);
      if (j + 16 <= n) {  // attend_avx512's block
        for (int64_t g = 0; g < group; ++g) {
          for (int jj = 0; jj < 16; ++jj) {
            const T* kr = kd + slots[j + jj] * sk0;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q + g * dim), load16(kr));
            for (int64_t c = 1; c < dv; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + 16 * c), load16(kr + 16 * c), s);
            part[jj] = s;
          }
          _mm512_storeu_ps(sr + g * n + j, sum16(part));
        }
        continue;
      }
      for (int64_t jt = j; jt < n; ++jt) {  // its tail
        const T* kr = kd + slots[jt] * sk0;
        for (int64_t c = 0; c < dv; ++c) kv[c] = load16(kr + 16 * c);
        for (int64_t g = 0; g < group; ++g) {
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q + g * dim), kv[0]);
          for (int64_t c = 1; c < dv; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + 16 * c), kv[c], s);
          sr[g * n + jt] = _mm512_reduce_add_ps(s);
        }
      }
    }
  }
  for (int64_t r = 0; r < count; ++r) softmax_avx512(row_scores(r), n0 + r, group, mx + r * group, sum + r * group);
  __m512 a0[MAX_GROUP * MAX_DV], a1[MAX_GROUP * MAX_DV];
  for (int64_t r = 0; r < count; r += 2) {  // two rows per pass over the V rows
    const bool pair = r + 1 < count;
    const int64_t na = n0 + r, nb = na + 1, last = pair ? nb : na;
    const float* sa = row_scores(r);
    const float* sb = pair ? row_scores(r + 1) : nullptr;
    for (int64_t i = 0; i < group * dv; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < std::min<int64_t>(last, 8); ++j) prefetch_row(vd + slots[j] * sv0, dim * sizeof(T));
    for (int64_t j = 0; j < last; ++j) {
      if (j + 8 < last) prefetch_row(vd + slots[j + 8] * sv0, dim * sizeof(T));
      const T* vr = vd + slots[j] * sv0;
      for (int64_t c = 0; c < dv; ++c) kv[c] = load16(vr + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        if (j < na) {
          const __m512 p = _mm512_set1_ps(sa[g * na + j]);
          for (int64_t c = 0; c < dv; ++c) a0[g * dv + c] = _mm512_fmadd_ps(p, kv[c], a0[g * dv + c]);
        }
        if (pair) {
          const __m512 p = _mm512_set1_ps(sb[g * nb + j]);
          for (int64_t c = 0; c < dv; ++c) a1[g * dv + c] = _mm512_fmadd_ps(p, kv[c], a1[g * dv + c]);
        }
      }
    }
    for (int64_t i = 0; i < group * dv; ++i) _mm512_storeu_ps(acc + r * gd + 16 * i, a0[i]);
    if (pair)
      for (int64_t i = 0; i < group * dv; ++i) _mm512_storeu_ps(acc + (r + 1) * gd + 16 * i, a1[i]);
  }
}
#endif

// Runs of rows that are one request's consecutive positions (a draft's rows: row b + 1 reads
// row b's slots and one more), cut into near-equal pieces of at most RUN_ROWS rows (pieces, not
// whole runs, keep both threads busy at batch 1). A piece is one work item per KV head, so its
// rows read the K/V once (attend_rows) instead of once each. join false: every row alone.
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
// of the pools (slots, kv_heads, D). All query heads of one KV head are scored together, so
// each K/V row is read once per group. Writes out[q_rows[b]] and, if given, lse[b, head].
// attend(qf, kv_head, slots, n, scores, acc, mx, sum) reads one KV head's rows of the pool:
// the float pool's (decode_attention_impl) or a quantized one's (decode_attention_quant_impl).
// attend_rows(qf, rows, kv_head, slots, n0, ...) does the same for a run's rows at once (slots:
// the last row's, which begin with every other row's), each row's numbers exactly attend's
// (nullptr: there is none, every row goes alone). Work goes KV head by KV head, the items
// inside, so consecutive items read the same head's rows.
template <typename T, typename Attend, typename AttendRows>
void decode_rows(const torch::Tensor& q, int64_t kv_heads, torch::Tensor& out, float* lse, const int64_t* rows,
                 const int64_t* table, int64_t table_stride, const int64_t* lens, int64_t batch, float scale,
                 const Attend& attend, const AttendRows& attend_rows) {
  constexpr bool can_join = !std::is_same_v<AttendRows, std::nullptr_t>;
  const int64_t heads = q.size(1), dim = q.size(2), group = heads / kv_heads;
  const T* qd = ptr<T>(q);
  T* od = ptr<T>(out);
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  const auto runs = row_runs(table, table_stride, lens, batch, can_join);
  const int64_t items = int64_t(runs.size());
  at::parallel_for(0, items * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, mx, sum;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w / items, b0 = runs[w % items].first, count = runs[w % items].second, n0 = lens[b0];
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
      const int64_t* slots = table + b0 * table_stride;
      if constexpr (can_join) {
        const int64_t* longest = table + (b0 + count - 1) * table_stride;  // every row's slots are its first ones
        if (count > 1) attend_rows(qf.data(), count, h, longest, n0, scores.data(), acc.data(), mx.data(), sum.data());
        else attend(qf.data(), h, slots, n0, scores.data(), acc.data(), mx.data(), sum.data());
      } else {
        attend(qf.data(), h, slots, n0, scores.data(), acc.data(), mx.data(), sum.data());
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

template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& kp, const torch::Tensor& vp, torch::Tensor& out,
                           float* lse, const int64_t* rows, const int64_t* table, int64_t table_stride, const int64_t* lens,
                           int64_t batch, float scale) {
  const int64_t dim = q.size(2), kv_heads = kp.size(1), group = q.size(1) / kv_heads;
  const T* kd = ptr<T>(kp);
  const T* vd = ptr<T>(vp);
  const int64_t sk0 = kp.stride(0), sk1 = kp.stride(1), sv0 = vp.stride(0), sv1 = vp.stride(1);
  auto attend = attend_generic<T>;
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim / 16 <= MAX_DV && group <= MAX_GROUP) attend = attend_avx512<T>;
#endif
  auto one = [&](const float* qf, int64_t h, const int64_t* slots, int64_t n, float* scores, float* acc, float* mx, float* sum) {
    attend(qf, kd + h * sk1, vd + h * sv1, sk0, sv0, slots, n, group, dim, scores, acc, mx, sum);
  };
#if defined(__AVX512F__)
  if (attend == attend_avx512<T>) {
    decode_rows<T>(q, kv_heads, out, lse, rows, table, table_stride, lens, batch, scale, one,
                   [&](const float* qf, int64_t count, int64_t h, const int64_t* slots, int64_t n0, float* scores, float* acc,
                       float* mx, float* sum) {
                     attend_rows_avx512<T>(qf, count, kd + h * sk1, vd + h * sv1, sk0, sv0, slots, n0, group, dim, scores, acc,
                                           mx, sum);
                   });
    return;
  }
#endif
  decode_rows<T>(q, kv_heads, out, lse, rows, table, table_stride, lens, batch, scale, one, nullptr);
}

// The index checks of decode_attention, apart: a bad slot would read outside the pool, so
// every table entry is checked (decode_layers checks its table once, not once per layer).
void check_table(const torch::Tensor& rows, const torch::Tensor& table, const torch::Tensor& lens, int64_t q_rows_bound,
                 int64_t pool_slots) {
  TORCH_CHECK(rows.scalar_type() == torch::kLong && table.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong &&
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

// decode_attention over a table check_table has passed.
void run_decode(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool, torch::Tensor& out,
                float* lse, const torch::Tensor& rows, const torch::Tensor& table, const torch::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3 && out.dim() == 3, "decode_attention: 3-d q/pools/out");
  TORCH_CHECK(q.stride(2) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && out.stride(2) == 1,
              "decode_attention: the head dim must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "decode_attention: q, pools and out share a dtype");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "decode_attention: heads must be a multiple of kv_heads");
  DISPATCH_FLOAT_BF16(q, "decode_attention", [&] {
    decode_attention_impl<scalar>(q, k_pool, v_pool, out, lse, rows.data_ptr<int64_t>(), table.data_ptr<int64_t>(),
                                  table.stride(0), lens.data_ptr<int64_t>(), table.size(0), float(scale));
  });
}

void decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor out,
                      c10::optional<torch::Tensor> lse, torch::Tensor q_rows, torch::Tensor table, torch::Tensor seq_lens,
                      double scale) {
  auto rows = q_rows.contiguous(), lens = seq_lens.contiguous();
  check_table(rows, table, lens, std::min(q.size(0), out.size(0)), std::min(k_pool.size(0), v_pool.size(0)));
  float* lse_p = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == torch::kFloat && lse->is_contiguous() && lse->numel() == table.size(0) * q.size(1),
                "decode_attention: lse is a contiguous float32 (batch, heads)");
    lse_p = lse->data_ptr<float>();
  }
  run_decode(q, k_pool, v_pool, out, lse_p, rows, table, lens, scale);
}

// --- decode attention over a quantized pool -----------------------------------------------
// The same attention over int8 or fp8 e4m3 K/V rows (kernels/kv_quant.py), read in place with
// their fp32 scales (one per slot and KV head): a K row's scale multiplies its dot product, a
// V row's scale its softmax weight, so rows are widened to fp32 and never rescaled. fp8 rows
// are their raw bytes (uint8_t), int8 rows int8_t; neither ever holds a NaN.
inline float ldq(const int8_t* p, int64_t i) { return float(p[i]); }
inline float ldq(const uint8_t* p, int64_t i) {  // fp8 e4m3fn: s eeee mmm, exponent bias 7
  const int e = (p[i] >> 3) & 15, m = p[i] & 7;
  const float mag = e ? std::ldexp(float(8 + m), e - 10) : std::ldexp(float(m), -9);
  return (p[i] & 0x80) ? -mag : mag;
}

template <typename E>
void attend_quant_generic(const float* qf, const E* kd, const E* vd, const float* ks, const float* vs, int64_t sk0,
                          int64_t sv0, int64_t sks0, int64_t svs0, const int64_t* slots, int64_t n, int64_t group,
                          int64_t dim, float* scores, float* acc, float* mx, float* sum) {
  for (int64_t j = 0; j < n; ++j) {
    const E* kr = kd + slots[j] * sk0;
    const float sc = ks[slots[j] * sks0];
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * ldq(kr, d);
      scores[g * n + j] = s * sc;
    }
  }
  softmax_generic(scores, n, group, mx, sum);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const E* vr = vd + slots[j] * sv0;
    const float sc = vs[slots[j] * svs0];
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + j] * sc;
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * ldq(vr, d);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
// fp8 e4m3 -> the fp16 of the same sign, exponent and mantissa bits (exponent bias 15, not 7:
// the value / 256, exactly, subnormals included) -> fp32, times 256.
inline __m512 load16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

template <typename E>
void attend_quant_avx512(const float* qf, const E* kd, const E* vd, const float* ks, const float* vs, int64_t sk0,
                         int64_t sv0, int64_t sks0, int64_t svs0, const int64_t* slots, int64_t n, int64_t group,
                         int64_t dim, float* scores, float* acc, float* mx, float* sum) {
  const int64_t dv = dim / 16;
  __m512 q[MAX_GROUP * MAX_DV], a[MAX_GROUP * MAX_DV], kv[MAX_DV], part[16];
  float sc[16];
  for (int64_t i = 0; i < group * dv; ++i) q[i] = _mm512_loadu_ps(qf + 16 * i);
  for (int64_t jj = 0; jj < std::min<int64_t>(n, 16); ++jj) prefetch_row(kd + slots[jj] * sk0, dim);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // 16 slots at a time, their dot products summed by one tree, then scaled
    for (int64_t jj = j + 16; jj < std::min(n, j + 32); ++jj) prefetch_row(kd + slots[jj] * sk0, dim);
    for (int jj = 0; jj < 16; ++jj) sc[jj] = ks[slots[j + jj] * sks0];
    const __m512 scale = _mm512_loadu_ps(sc);
    for (int64_t g = 0; g < group; ++g) {
      for (int jj = 0; jj < 16; ++jj) {
        const E* kr = kd + slots[j + jj] * sk0;
        __m512 s = _mm512_mul_ps(q[g * dv], load16(kr));
        for (int64_t c = 1; c < dv; ++c) s = _mm512_fmadd_ps(q[g * dv + c], load16(kr + 16 * c), s);
        part[jj] = s;
      }
      _mm512_storeu_ps(scores + g * n + j, _mm512_mul_ps(sum16(part), scale));
    }
  }
  for (; j < n; ++j) {
    const E* kr = kd + slots[j] * sk0;
    const float s0 = ks[slots[j] * sks0];
    for (int64_t c = 0; c < dv; ++c) kv[c] = load16(kr + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      __m512 s = _mm512_mul_ps(q[g * dv], kv[0]);
      for (int64_t c = 1; c < dv; ++c) s = _mm512_fmadd_ps(q[g * dv + c], kv[c], s);
      scores[g * n + j] = _mm512_reduce_add_ps(s) * s0;
    }
  }
  softmax_avx512(scores, n, group, mx, sum);
  for (int64_t i = 0; i < group * dv; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < std::min<int64_t>(n, 8); ++j) prefetch_row(vd + slots[j] * sv0, dim);
  for (int64_t j = 0; j < n; ++j) {
    if (j + 8 < n) prefetch_row(vd + slots[j + 8] * sv0, dim);
    const E* vr = vd + slots[j] * sv0;
    const float s0 = vs[slots[j] * svs0];
    for (int64_t c = 0; c < dv; ++c) kv[c] = load16(vr + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + j] * s0);
      for (int64_t c = 0; c < dv; ++c) a[g * dv + c] = _mm512_fmadd_ps(p, kv[c], a[g * dv + c]);
    }
  }
  for (int64_t i = 0; i < group * dv; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

// Runs body with qtype = int8_t (an int8 pool) or uint8_t (the bytes of an fp8 e4m3 pool).
#define DISPATCH_KV_QUANT(t, name, ...)                                                     \
  do {                                                                                       \
    if ((t).scalar_type() == torch::kChar) {                                                 \
      using qtype = int8_t;                                                                  \
      __VA_ARGS__();                                                                         \
    } else if ((t).scalar_type() == c10::ScalarType::Float8_e4m3fn) {                        \
      using qtype = uint8_t;                                                                 \
      __VA_ARGS__();                                                                         \
    } else {                                                                                 \
      TORCH_CHECK(false, name ": an int8 or float8_e4m3fn pool only, got ", (t).scalar_type()); \
    }                                                                                        \
  } while (0)

// decode_attention_impl over a quantized pool: queries and outputs in T, rows in E.
template <typename T, typename E>
void decode_attention_quant_impl(const torch::Tensor& q, const torch::Tensor& kp, const torch::Tensor& vp,
                                 const torch::Tensor& ksc, const torch::Tensor& vsc, torch::Tensor& out, float* lse,
                                 const int64_t* rows, const int64_t* table, int64_t table_stride, const int64_t* lens,
                                 int64_t batch, float scale) {
  const int64_t dim = q.size(2), kv_heads = kp.size(1), group = q.size(1) / kv_heads;
  const E* kd = ptr<E>(kp);
  const E* vd = ptr<E>(vp);
  const float* ks = ksc.data_ptr<float>();
  const float* vs = vsc.data_ptr<float>();
  const int64_t sk0 = kp.stride(0), sk1 = kp.stride(1), sv0 = vp.stride(0), sv1 = vp.stride(1);
  const int64_t sks0 = ksc.stride(0), svs0 = vsc.stride(0);
  auto attend = attend_quant_generic<E>;
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim / 16 <= MAX_DV && group <= MAX_GROUP) attend = attend_quant_avx512<E>;
#endif
  decode_rows<T>(q, kv_heads, out, lse, rows, table, table_stride, lens, batch, scale,
                 [&](const float* qf, int64_t h, const int64_t* slots, int64_t n, float* scores, float* acc, float* mx, float* sum) {
                   attend(qf, kd + h * sk1, vd + h * sv1, ks + h, vs + h, sk0, sv0, sks0, svs0, slots, n, group, dim, scores,
                          acc, mx, sum);
                 },
                 nullptr);
}

// The scales of a quantized pool: fp32 (slots, kv_heads), one per row of the pool.
void check_scales(const torch::Tensor& pool, const torch::Tensor& scales, const char* name) {
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.dim() == 2 && scales.size(0) == pool.size(0) &&
                  scales.size(1) == pool.size(1) && scales.stride(1) == 1,
              name, ": fp32 scales (slots, kv_heads) with contiguous rows, one per pool row");
}

void decode_attention_quant(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor k_scale,
                            torch::Tensor v_scale, torch::Tensor out, c10::optional<torch::Tensor> lse, torch::Tensor q_rows,
                            torch::Tensor table, torch::Tensor seq_lens, double scale) {
  auto rows = q_rows.contiguous(), lens = seq_lens.contiguous();
  check_table(rows, table, lens, std::min(q.size(0), out.size(0)), std::min(k_pool.size(0), v_pool.size(0)));
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3 && out.dim() == 3, "decode_attention_quant: 3-d q/pools/out");
  TORCH_CHECK(q.stride(2) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && out.stride(2) == 1,
              "decode_attention_quant: the head dim must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == q.size(2),
              "decode_attention_quant: pools of one dtype and shape, out in q's dtype");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "decode_attention_quant: heads must be a multiple of kv_heads");
  check_scales(k_pool, k_scale, "decode_attention_quant");
  check_scales(v_pool, v_scale, "decode_attention_quant");
  float* lse_p = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == torch::kFloat && lse->is_contiguous() && lse->numel() == table.size(0) * q.size(1),
                "decode_attention_quant: lse is a contiguous float32 (batch, heads)");
    lse_p = lse->data_ptr<float>();
  }
  DISPATCH_FLOAT_BF16(q, "decode_attention_quant", [&] {
    DISPATCH_KV_QUANT(k_pool, "decode_attention_quant", [&] {
      decode_attention_quant_impl<scalar, qtype>(q, k_pool, v_pool, k_scale, v_scale, out, lse_p, rows.data_ptr<int64_t>(),
                                                 table.data_ptr<int64_t>(), table.stride(0), lens.data_ptr<int64_t>(),
                                                 table.size(0), float(scale));
    });
  });
}

// --- RMSNorm, with the residual add fused in ---------------------------------------------
// x (rows, n). With a residual: r = x + residual (rounded to the dtype, as torch's add is),
// returns (norm(r) * w, r); without: (norm(x) * w,).
template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& w, torch::Tensor& out,
                   torch::Tensor* sum_out, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xd = ptr<T>(x);
  const T* rd = residual ? ptr<T>(*residual) : nullptr;
  const T* wd = ptr<T>(w);
  T* od = ptr<T>(out);
  T* sd = sum_out ? ptr<T>(*sum_out) : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xd + r * n;
      float ss = 0.f;
      if (rd) {
        const T* rr = rd + r * n;
        T* sr = sd + r * n;
        for (int64_t i = 0; i < n; ++i) {
          st(sr, i, ld(xr, i) + ld(rr, i));
          buf[i] = ld(sr, i);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = ld(xr, i);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / float(n) + float(eps));
      T* orow = od + r * n;
      for (int64_t i = 0; i < n; ++i) st(orow, i, buf[i] * inv * ld(wd, i));
    }
  });
}

std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(), "rms_norm: contiguous x, weight of x's last dim and dtype");
  auto out = torch::empty_like(x);
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual like x");
    auto sum = torch::empty_like(x);
    DISPATCH_FLOAT_BF16(x, "rms_norm", [&] { rms_norm_impl<scalar>(x, &*residual, weight, out, &sum, eps); });
    return {out, sum};
  }
  DISPATCH_FLOAT_BF16(x, "rms_norm", [&] { rms_norm_impl<scalar>(x, nullptr, weight, out, nullptr, eps); });
  return {out};
}

// --- rotary embedding (neox, rotate-half), in place on q and k ----------------------------
// x (T, heads, D) with any row/head strides; cos/sin (T, D/2) float32 rows (any row stride).
template <typename T>
void rope_impl(torch::Tensor& x, const float* cs, const float* sn, int64_t sc) {
  const int64_t t_len = x.size(0), heads = x.size(1), half = x.size(2) / 2, s0 = x.stride(0), s1 = x.stride(1);
  T* xd = ptr<T>(x);
  at::parallel_for(0, t_len, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + t * sc;
      const float* s = sn + t * sc;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = xd + t * s0 + h * s1;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = ld(p, i), x2 = ld(p, i + half);
          st(p, i, x1 * c[i] - x2 * s[i]);
          st(p, i + half, x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.dim() == 2 &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0) && cos.size(1) * 2 == q.size(2),
              "rope_: float32 (T, D/2) cos/sin with contiguous rows");
  for (torch::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == cos.size(0), "rope_: (T, heads, D) with contiguous D");
    DISPATCH_FLOAT_BF16(*x, "rope_", [&] { rope_impl<scalar>(*x, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0)); });
  }
}

// --- SwiGLU: silu(x[:, :n]) * x[:, n:] ----------------------------------------------------
template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t n = out.size(-1), rows = out.numel() / n;
  const T* xd = ptr<T>(x);
  T* od = ptr<T>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xd + r * 2 * n;
      const T* u = g + n;
      T* o = od + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m512 a = load16(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
        store16(o + i, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)), load16(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float a = ld(g, i);
        st(o, i, a / (1.f + std::exp(-a)) * ld(u, i));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: contiguous x with an even last dim");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  auto out = torch::empty(sizes, x.options());
  DISPATCH_FLOAT_BF16(x, "silu_and_mul", [&] { silu_and_mul_impl<scalar>(x, out); });
  return out;
}

// --- KV store: k_pool[slots[t]] = k[t], v likewise, in one call ------------------------
template <typename T>
void store_kv_impl(torch::Tensor& kp, torch::Tensor& vp, const int64_t* slots, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t t_len = k.size(0), heads = k.size(1), dim = k.size(2);
  for (int pass = 0; pass < 2; ++pass) {
    const torch::Tensor& src = pass ? v : k;
    torch::Tensor& dst = pass ? vp : kp;
    const T* sd = ptr<T>(src);
    T* dd = ptr<T>(dst);
    const int64_t s0 = src.stride(0), s1 = src.stride(1), d0 = dst.stride(0), d1 = dst.stride(1);
    for (int64_t t = 0; t < t_len; ++t)
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dd + slots[t] * d0 + h * d1, sd + t * s0 + h * s1, dim * sizeof(T));
  }
}

// The slots store_kv writes to, checked against the pool (decode_layers: once, not per layer).
void check_slots(const torch::Tensor& slots, int64_t pool_slots) {
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous(), "store_kv: contiguous int64 slots");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < pool_slots, "store_kv: slot ", sp[t], " out of range");
}

// store_kv after check_slots.
void run_store(torch::Tensor& k_pool, torch::Tensor& v_pool, const torch::Tensor& slots, const torch::Tensor& k,
               const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 && k_pool.stride(2) == 1 &&
                  v_pool.stride(2) == 1 && k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == v_pool.scalar_type() &&
                  slots.numel() == k.size(0),
              "store_kv: (T, kv_heads, D) k/v with contiguous D, the pools' dtype, one slot per row");
  DISPATCH_FLOAT_BF16(k, "store_kv", [&] { store_kv_impl<scalar>(k_pool, v_pool, slots.data_ptr<int64_t>(), k, v); });
}

void store_kv(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  auto s = slots.contiguous();
  check_slots(s, std::min(k_pool.size(0), v_pool.size(0)));
  run_store(k_pool, v_pool, s, k, v);
}

// --- quantized KV store: int8 or fp8 e4m3 values and an fp32 scale per (token, KV head) ----
// As kernels/kv_quant.py's quantize, bit for bit: scale = max(absmax / QMAX, FLT_MIN), each
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
void store_kv_quant_impl(torch::Tensor& kp, torch::Tensor& vp, torch::Tensor& ksc, torch::Tensor& vsc, const int64_t* slots,
                         const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t t_len = k.size(0), heads = k.size(1), dim = k.size(2);
  const float qm = qmax(static_cast<const E*>(nullptr));
  for (int pass = 0; pass < 2; ++pass) {
    const torch::Tensor& src = pass ? v : k;
    torch::Tensor& dst = pass ? vp : kp;
    torch::Tensor& sc = pass ? vsc : ksc;
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

void store_kv_quant(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor k_scale, torch::Tensor v_scale,
                    torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  auto s = slots.contiguous();
  check_slots(s, std::min(k_pool.size(0), v_pool.size(0)));
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 && k_pool.stride(2) == 1 &&
                  v_pool.stride(2) == 1 && v.scalar_type() == k.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type() &&
                  k_pool.size(1) == k.size(1) && k_pool.size(2) == k.size(2) && v_pool.sizes() == k_pool.sizes() &&
                  s.numel() == k.size(0),
              "store_kv_quant: (T, kv_heads, D) k/v with contiguous D, pools of their shape, one slot per row");
  check_scales(k_pool, k_scale, "store_kv_quant");
  check_scales(v_pool, v_scale, "store_kv_quant");
  DISPATCH_FLOAT_BF16(k, "store_kv_quant", [&] {
    DISPATCH_KV_QUANT(k_pool, "store_kv_quant", [&] {
      store_kv_quant_impl<scalar, qtype>(k_pool, v_pool, k_scale, v_scale, s.data_ptr<int64_t>(), k, v);
    });
  });
}

// --- linears for decode batches ---------------------------------------------------------
// y (M, N) = x (M, K) W^T + b for few rows M: the weight streams from memory once per call
// and every row reuses it. W is packed once (pack_linear) into panels of NR * 16 outputs,
// one contiguous stream each:
//   bf16 (AVX512-BF16): [panel][K/2][NR][16 outputs x 2 k]: one vdpbf16ps multiplies a
//                       broadcast pair of x by 16 outputs' pairs of W, fp32 accumulation;
//   fp32 (AVX-512):     [panel][K][NR][16 outputs]: one FMA per broadcast x and 16 outputs.
// MR rows x NR blocks of accumulators live in registers. y is x's dtype, or fp32 (logits).
#if defined(__AVX512F__)
constexpr int64_t NR = 4, MR_MAX = 6, PANEL = NR * 16, PF = 8;  // PF: k steps of W prefetched ahead

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_DP = true;
#else
constexpr bool HAS_BF16_DP = false;
#endif

bool linear_supports(torch::ScalarType t) { return t == torch::kFloat || (t == torch::kBFloat16 && HAS_BF16_DP); }

torch::Tensor pack_linear(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && linear_supports(w.scalar_type()), "pack_linear: a 2-d float32 (or bf16, with AVX512-BF16) weight");
  auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), panels = (n + PANEL - 1) / PANEL;
  const int64_t pair = wc.scalar_type() == torch::kBFloat16 ? 2 : 1, kp = (k + pair - 1) / pair;
  auto out = torch::zeros({panels, kp, NR, 16 * pair}, wc.options());
  const int64_t esize = wc.element_size();
  const char* src = static_cast<const char*>(wc.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = p * PANEL; r < std::min(n, (p + 1) * PANEL); ++r) {
        const int64_t blk = (r % PANEL) / 16, lane = r % 16;
        for (int64_t c = 0; c < k; ++c) {
          const int64_t at = ((p * kp + c / pair) * NR + blk) * 16 * pair + lane * pair + c % pair;
          std::memcpy(dst + at * esize, src + (r * k + c) * esize, esize);
        }
      }
  });
  return out;
}

inline void prefetch_panel(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int i = 0; i < 4; ++i) _mm_prefetch(c + 64 * i, _MM_HINT_T0);
}

template <int MR, typename O>
inline void store_tile(__m512 (&acc)[MR][NR], const float* bias, O* y, int64_t ldy, int64_t n0, int64_t n) {
  for (int j = 0; j < NR; ++j) {
    const int64_t c0 = n0 + j * 16;
    if (c0 >= n) break;
    const __mmask16 mask = n - c0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - c0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = _mm512_add_ps(acc[m][j], b);
      if constexpr (std::is_same_v<O, float>) {
        _mm512_mask_storeu_ps(y + m * ldy + c0, mask, v);
      } else {
        alignas(64) uint16_t tmp[16];
        store16(tmp, v);
        _mm256_mask_storeu_epi16(y + m * ldy + c0, mask, _mm256_load_si256((const __m256i*)tmp));
      }
    }
  }
}

#if defined(__AVX512BF16__)
template <int MR, typename O>
void tile(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* panel, int64_t kp, const float* bias, O* y, int64_t ldy,
          int64_t n0, int64_t n) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
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
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, (__m512bh)w[j]);
    }
  }
  store_tile<MR>(acc, bias, y, ldy, n0, n);
}
#endif

template <int MR, typename O>
void tile(const float* x, int64_t ldx, int64_t k, const float* panel, int64_t, const float* bias, O* y, int64_t ldy,
          int64_t n0, int64_t n) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    const float* wp = panel + c * NR * 16;
    if (MR <= 2) prefetch_panel(wp + PF * NR * 16);
    __m512 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_ps(wp + j * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + c]);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  store_tile<MR>(acc, bias, y, ldy, n0, n);
}

template <typename W, typename O>
void linear_impl(const W* xd, int64_t ldx, int64_t m, int64_t k, const W* wd, int64_t kp, int64_t panels, const float* bias,
                 O* yd, int64_t n) {
  const int64_t panel_size = kp * NR * 16 * (std::is_same_v<W, float> ? 1 : 2);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = wd + p * panel_size;
      for (int64_t m0 = 0; m0 < m; m0 += MR_MAX) {
        const W* xr = xd + m0 * ldx;
        O* yr = yd + m0 * n;
        switch (std::min<int64_t>(MR_MAX, m - m0)) {
          case 1: tile<1>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 2: tile<2>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 3: tile<3>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 4: tile<4>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          case 5: tile<5>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
          default: tile<6>(xr, ldx, k, panel, kp, bias, yr, n, p * PANEL, n); break;
        }
      }
    }
  });
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias, bool float_out) {
  const auto t = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == t && x.stride(1) == 1 && linear_supports(t),
              "linear: 2-d x of the packed weight's dtype, rows contiguous");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), kp = packed.size(1);
  const int64_t pair = t == torch::kBFloat16 ? 2 : 1;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && kp == (k + pair - 1) / pair && panels * PANEL >= n &&
                  packed.size(2) == NR && packed.size(3) == 16 * pair, "linear: a weight packed by pack_linear for this k and n");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == n,
                "linear: a contiguous float32 bias of n (the caller converts it once)");
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({m, n}, x.options().dtype(float_out ? torch::kFloat : t));
  if (m == 0) return y;
#if defined(__AVX512BF16__)
  if (t == torch::kBFloat16) {
    if (float_out) linear_impl(ptr<uint16_t>(x), x.stride(0), m, k, ptr<uint16_t>(packed), kp, panels, bd, y.data_ptr<float>(), n);
    else linear_impl(ptr<uint16_t>(x), x.stride(0), m, k, ptr<uint16_t>(packed), kp, panels, bd, ptr<uint16_t>(y), n);
    return y;
  }
#endif
  linear_impl(x.data_ptr<float>(), x.stride(0), m, k, packed.data_ptr<float>(), kp, panels, bd, y.data_ptr<float>(), n);
  return y;
}
#else
bool linear_supports(torch::ScalarType) { return false; }
torch::Tensor pack_linear(torch::Tensor) { TORCH_CHECK(false, "pack_linear: built without AVX-512"); }
torch::Tensor linear(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>, bool) {
  TORCH_CHECK(false, "linear: built without AVX-512");
}
#endif

bool linear_supports_dtype(torch::Tensor w) { return linear_supports(w.scalar_type()); }

// --- quantized linears (GGUF Q4_0 / Q4_1 / Q8_0, and radixserve's own int4 / int8) ---------
// Weights stay in their blocks of 32 along k, each with fp16 scales, repacked once
// (pack_quant) into panels of 16 outputs so one 64-byte load feeds 16 outputs:
//   4-bit, 320 bytes per (panel, block): 256 bytes of nibbles, then 16 fp16 d, then 16 fp16 m.
//           Byte 64c + 4n + r holds output n's weight 4c + r (low nibble) and 16 + 4c + r
//           (high nibble), q in [0, 15]: w = d*q + m (Q4_0 becomes m = -8d, exactly).
//   8-bit, 544 bytes: 512 bytes q + 128 (byte 64c + 4n + r: weight 4c + r), then 16 fp16 d:
//           w = d*q.
// The block bytes are GGUF's own, so the repack is exact and dequant_quant reproduces
// gguf-py's dequantization bit for bit (d*q is exact in fp32, then one rounding for + m).
// A linear of few rows (qlinear) works in integers, as llama.cpp does on CPU: each row's
// activations are quantized per block of 32 (to 16 bits, see QuantRows), and every block's dot
// product is an integer sum of u8 x s8 products (vpdpbusd), scaled by d * dx. Many rows (prefill) dequantize the weight once per call instead
// and run fp32 GEMM: exactly the dequantized model's numbers.
constexpr int64_t QPANEL = 16, QBLOCK = 32, Q4_BYTES = 320, Q8_BYTES = 544;

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

inline uint16_t float_to_half_exact(float f) {  // only for values fp16 holds exactly (-8 * an fp16 d)
  return at::Half(f).x;
}

int64_t quant_bits(const std::string& kind) {
  if (kind == "q4_0" || kind == "q4_1") return 4;
  if (kind == "q8_0") return 8;
  TORCH_CHECK(false, "pack_quant: kind must be q4_0, q4_1 or q8_0, got ", kind);
}

// GGUF blocks (n, k/32 * block bytes) -> panels (ceil(n/16), k/32, 320 or 544).
torch::Tensor pack_quant(torch::Tensor raw, const std::string& kind, int64_t n, int64_t k) {
  const int64_t bits = quant_bits(kind);
  TORCH_CHECK(k % QBLOCK == 0, "pack_quant: k must be a multiple of 32, got ", k);
  const int64_t kb = k / QBLOCK, src_block = kind == "q4_0" ? 18 : kind == "q4_1" ? 20 : 34;
  auto rc = raw.contiguous();
  TORCH_CHECK(rc.scalar_type() == torch::kByte && rc.numel() == n * kb * src_block,
              "pack_quant: ", n, " rows of ", kb, " ", kind, " blocks (", n * kb * src_block, " bytes), got ", rc.numel());
  const int64_t panels = (n + QPANEL - 1) / QPANEL, bytes = bits == 4 ? Q4_BYTES : Q8_BYTES;
  auto out = torch::zeros({panels, kb, bytes}, rc.options());
  const uint8_t* src = rc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (bits == 8) {  // padding rows: q + 128 = 128 (and d = 0)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t b = 0; b < kb; ++b) std::memset(dst + (p * kb + b) * bytes, 128, 512);
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = r / QPANEL, lane = r % QPANEL;
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* s = src + (r * kb + b) * src_block;
        uint8_t* o = dst + (p * kb + b) * bytes;
        uint16_t d;
        std::memcpy(&d, s, 2);
        if (bits == 8) {
          for (int j = 0; j < 32; ++j) o[(j / 4) * 64 + lane * 4 + j % 4] = uint8_t(int(int8_t(s[2 + j])) + 128);
          std::memcpy(o + 512 + 2 * lane, &d, 2);
          continue;
        }
        uint16_t m;
        const uint8_t* qs = s + (kind == "q4_1" ? 4 : 2);
        if (kind == "q4_1") std::memcpy(&m, s + 2, 2);
        else m = float_to_half_exact(-8.f * half_to_float(d));
        for (int j = 0; j < 16; ++j)  // qs[j]: weight j (low nibble) and j + 16 (high)
          o[(j / 4) * 64 + lane * 4 + j % 4] = qs[j];
        std::memcpy(o + 256 + 2 * lane, &d, 2);
        std::memcpy(o + 288 + 2 * lane, &m, 2);
      }
    }
  });
  return out;
}

void check_quant(const torch::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  (packed.size(2) == Q4_BYTES || packed.size(2) == Q8_BYTES) && packed.size(0) * QPANEL >= n &&
                  packed.size(1) * QBLOCK >= k && (packed.size(1) - 1) * QBLOCK < k,
              "a weight packed by pack_quant for this n and k");
}

// The fp32 weight rows `rows` (all when empty) of a packed weight: gguf-py's numbers.
torch::Tensor dequant_quant(torch::Tensor packed, int64_t n, int64_t k, c10::optional<torch::Tensor> rows) {
  check_quant(packed, n, k);
  const int64_t kb = packed.size(1), bytes = packed.size(2);
  torch::Tensor idx = rows.has_value() ? rows->contiguous() : torch::arange(n, torch::kLong);
  TORCH_CHECK(idx.scalar_type() == torch::kLong, "dequant_quant: int64 rows");
  const int64_t count = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "dequant_quant: row ", ip[i], " out of range");
  auto out = torch::empty({count, k}, torch::kFloat);
  float* od = out.data_ptr<float>();
  const uint8_t* pd = packed.data_ptr<uint8_t>();
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = ip[i], p = r / QPANEL, lane = r % QPANEL;
      float* orow = od + i * k;
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* blk = pd + (p * kb + b) * bytes;
        uint16_t dh;
        std::memcpy(&dh, blk + (bytes == Q4_BYTES ? 256 : 512) + 2 * lane, 2);
        const float d = half_to_float(dh);
        const int64_t lim = std::min<int64_t>(QBLOCK, k - b * QBLOCK);
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // the scalar loops below, 16 weights at a time: row `lane`'s 4 bytes of each 64-byte
        // chunk are its next 4 weights (and, in the high nibbles, the 4 after the first 16)
        const __mmask16 m0 = lim >= 16 ? __mmask16(0xffff) : __mmask16((1u << lim) - 1);
        const __mmask16 m1 = lim >= 32 ? __mmask16(0xffff) : lim > 16 ? __mmask16((1u << (lim - 16)) - 1) : __mmask16(0);
        auto quads = [&](int c0) {  // the 16 bytes at 64c + 4*lane, c = c0 .. c0 + 3
          int32_t q[4];
          for (int c = 0; c < 4; ++c) std::memcpy(&q[c], blk + 64 * (c0 + c) + 4 * lane, 4);
          return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
        };
        const __m512 dv = _mm512_set1_ps(d);
        if (bytes == Q8_BYTES) {
          for (int half = 0; half < 2; ++half) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(quads(4 * half), _mm512_set1_epi32(128)));
            _mm512_mask_storeu_ps(orow + b * QBLOCK + 16 * half, half ? m1 : m0, _mm512_mul_ps(dv, q));
          }
          continue;
        }
        uint16_t mbits;
        std::memcpy(&mbits, blk + 288 + 2 * lane, 2);
        const __m512 mv = _mm512_set1_ps(half_to_float(mbits));
        const __m512i bytes16 = quads(0);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes16, _mm512_set1_epi32(0xf)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes16, 4));
        _mm512_mask_storeu_ps(orow + b * QBLOCK, m0, _mm512_add_ps(_mm512_mul_ps(dv, lo), mv));  // d*q exact, then one rounding
        _mm512_mask_storeu_ps(orow + b * QBLOCK + 16, m1, _mm512_add_ps(_mm512_mul_ps(dv, hi), mv));
        continue;
#endif
        if (bytes == Q8_BYTES) {
          for (int64_t j = 0; j < lim; ++j) orow[b * QBLOCK + j] = d * float(int(blk[(j / 4) * 64 + lane * 4 + j % 4]) - 128);
          continue;
        }
        uint16_t mh;
        std::memcpy(&mh, blk + 288 + 2 * lane, 2);
        const float m = half_to_float(mh);
        for (int64_t j = 0; j < lim; ++j) {
          const uint8_t byte = blk[((j % 16) / 4) * 64 + lane * 4 + j % 4];
          const float q = float(j < 16 ? byte & 0xf : byte >> 4);
          const float dq = d * q;  // exact; then one rounding, as gguf-py's (d * q) + m
          orow[b * QBLOCK + j] = dq + m;
        }
      }
    }
  });
  return out;
}

// Activations of `m` rows, quantized per block of 32 to 16 bits: xi = round(x / dx) with
// dx = amax / 32639, held as two int8 halves xi = 256*hi + lo (hi in -127..127, lo in
// -128..127), so u8 x s8 products (vpdpbusd) make each block's exact integer sum in two passes.
// 16 bits, not llama.cpp's 8: the activations' rounding error (~1.5e-5 of a block's largest)
// stays far below bf16's, and on SmolLM2 greedy output then agrees with the dequantized fp32
// model as closely as fp32 kernels agree with each other (scripts/quant_check.py).
// sq: the sum of a block's xi; sx = dx * sq, the sum of the values they stand for (Q4's m term
// multiplies it: the result is then the exact dot product of the weights with the quantized
// activations).
constexpr float QSTEPS = 32639.f;  // 127 * 256 + 127: hi = (xi + 128) >> 8 stays in -127..127

struct QuantRows {
  std::vector<int8_t> hi, lo;
  std::vector<float> dx, sx;
  std::vector<int32_t> sq;
};

// One block of row r: xi, its halves, and the block's scale and sums (see QuantRows).
inline void finish_block(QuantRows& out, int64_t at, float d, int32_t sq) {
  out.dx[at] = d;
  out.sx[at] = d * float(sq);
  out.sq[at] = sq;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t kb, QuantRows& out) {
  out.hi.assign(m * kb * QBLOCK, 0);
  out.lo.assign(m * kb * QBLOCK, 0);
  out.dx.resize(m * kb);
  out.sx.resize(m * kb);
  out.sq.resize(m * kb);
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < kb; ++b) {
        const int64_t lim = std::min<int64_t>(QBLOCK, k - b * QBLOCK), at = r * kb + b;
        const T* xr = x + r * ldx + b * QBLOCK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // the scalar loop below, 32 lanes at a time (the same roundings, so the same numbers)
        const __mmask16 m0 = lim >= 16 ? __mmask16(0xffff) : __mmask16((1u << lim) - 1);
        const __mmask16 m1 = lim >= 32 ? __mmask16(0xffff) : lim > 16 ? __mmask16((1u << (lim - 16)) - 1) : __mmask16(0);
        const __m512 v0 = load16_masked(xr, m0), v1 = load16_masked(xr + 16, m1);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? QSTEPS / amax : 0.f), hi_q = _mm512_set1_ps(QSTEPS), lo_q = _mm512_set1_ps(-QSTEPS);
        const __m512i x0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, inv), lo_q), hi_q));
        const __m512i x1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, inv), lo_q), hi_q));
        const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(x0, _mm512_set1_epi32(128)), 8);
        const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(x1, _mm512_set1_epi32(128)), 8);
        int8_t* hp = out.hi.data() + at * QBLOCK;
        int8_t* lp = out.lo.data() + at * QBLOCK;
        _mm_storeu_si128((__m128i*)hp, _mm512_cvtepi32_epi8(h0));
        _mm_storeu_si128((__m128i*)(hp + 16), _mm512_cvtepi32_epi8(h1));
        _mm_storeu_si128((__m128i*)lp, _mm512_cvtepi32_epi8(_mm512_sub_epi32(x0, _mm512_slli_epi32(h0, 8))));
        _mm_storeu_si128((__m128i*)(lp + 16), _mm512_cvtepi32_epi8(_mm512_sub_epi32(x1, _mm512_slli_epi32(h1, 8))));
        finish_block(out, at, amax / QSTEPS, _mm512_reduce_add_epi32(_mm512_add_epi32(x0, x1)));
#else
        float v[QBLOCK];
        float amax = 0.f;
        for (int64_t j = 0; j < QBLOCK; ++j) {
          v[j] = j < lim ? ld(xr, j) : 0.f;
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float inv = amax > 0.f ? QSTEPS / amax : 0.f;
        int32_t sq = 0;
        for (int64_t j = 0; j < QBLOCK; ++j) {
          const int32_t xi = int32_t(std::nearbyint(std::clamp(v[j] * inv, -QSTEPS, QSTEPS)));
          const int32_t h = (xi + 128) >> 8;
          out.hi[at * QBLOCK + j] = int8_t(h);
          out.lo[at * QBLOCK + j] = int8_t(xi - 256 * h);
          sq += xi;
        }
        finish_block(out, at, amax / QSTEPS, sq);
#endif
      }
  });
}

template <typename O>
inline void store_row16(O* y, int64_t n0, int64_t n, const float* v, const float* bias) {
  for (int64_t i = 0; i < QPANEL && n0 + i < n; ++i) st(y, n0 + i, v[i] + (bias ? bias[n0 + i] : 0.f));
}

// One panel's outputs for rows [m0, m0 + mr): the portable path (and the reference the AVX-512
// path is checked against in tests, through qlinear on machines without VNNI).
template <typename O>
void qtile_generic(const uint8_t* panel, int64_t kb, int64_t bytes, const QuantRows& xr, int64_t m0, int64_t mr, const float* bias,
                   O* y, int64_t ldy, int64_t n0, int64_t n) {
  for (int64_t r = m0; r < m0 + mr; ++r) {
    float acc[QPANEL] = {0};
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t* blk = panel + b * bytes;
      const int8_t* hi = xr.hi.data() + (r * kb + b) * QBLOCK;
      const int8_t* lo = xr.lo.data() + (r * kb + b) * QBLOCK;
      int32_t q[QBLOCK];
      for (int j = 0; j < QBLOCK; ++j) q[j] = 256 * hi[j] + lo[j];
      const float dx = xr.dx[r * kb + b], sx = xr.sx[r * kb + b];
      for (int64_t lane = 0; lane < QPANEL; ++lane) {
        int32_t isum = 0;
        uint16_t dh;
        if (bytes == Q8_BYTES) {
          for (int j = 0; j < 32; ++j) isum += int32_t(blk[(j / 4) * 64 + lane * 4 + j % 4]) * q[j];
          isum -= 128 * xr.sq[r * kb + b];
          std::memcpy(&dh, blk + 512 + 2 * lane, 2);
          acc[lane] += float(isum) * (half_to_float(dh) * dx);
        } else {
          for (int j = 0; j < 32; ++j) {
            const uint8_t byte = blk[((j % 16) / 4) * 64 + lane * 4 + j % 4];
            isum += int32_t(j < 16 ? byte & 0xf : byte >> 4) * q[j];
          }
          uint16_t mh;
          std::memcpy(&dh, blk + 256 + 2 * lane, 2);
          std::memcpy(&mh, blk + 288 + 2 * lane, 2);
          acc[lane] += float(isum) * (half_to_float(dh) * dx) + half_to_float(mh) * sx;
        }
      }
    }
    store_row16(y + r * ldy, n0, n, acc, bias);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t QMR = 4;  // rows per tile: 8 weight registers + 2 per row

template <int MR, int BITS, typename O>
void qtile(const uint8_t* panel, int64_t kb, const QuantRows& xr, int64_t m0, const float* bias, O* y, int64_t ldy, int64_t n0,
           int64_t n) {
  constexpr int64_t bytes = BITS == 4 ? Q4_BYTES : Q8_BYTES;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk = panel + b * bytes;
    prefetch_row(blk + 12 * bytes, bytes);  // ~4 KB ahead: DRAM's latency (at 3-4 rows too: without it a 4-row tile waited on memory, 1.7x slower)
    __m512i w[8];
    __m512 d, mv = _mm512_setzero_ps();
    if constexpr (BITS == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * c);
        w[c] = _mm512_and_si512(v, low);
        w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 256)));
      mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 288)));
    } else {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(blk + 64 * c);
      d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 512)));
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * kb + b;
      const int32_t* hi = reinterpret_cast<const int32_t*>(xr.hi.data() + at * QBLOCK);
      const int32_t* lo = reinterpret_cast<const int32_t*>(xr.lo.data() + at * QBLOCK);
      __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
      for (int c = 0; c < 4; ++c) {  // four chains, so the sums overlap
        h0 = _mm512_dpbusd_epi32(h0, w[c], _mm512_set1_epi32(hi[c]));
        h1 = _mm512_dpbusd_epi32(h1, w[4 + c], _mm512_set1_epi32(hi[4 + c]));
        l0 = _mm512_dpbusd_epi32(l0, w[c], _mm512_set1_epi32(lo[c]));
        l1 = _mm512_dpbusd_epi32(l1, w[4 + c], _mm512_set1_epi32(lo[4 + c]));
      }
      __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
      if constexpr (BITS == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * xr.sq[at]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xr.dx[at])), acc[m]);
      if constexpr (BITS == 4) acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xr.sx[at]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float v[QPANEL];
    _mm512_store_ps(v, acc[m]);
    store_row16(y + (m0 + m) * ldy, n0, n, v, bias);
  }
}

template <int BITS, typename O>
void qpanel(const uint8_t* panel, int64_t kb, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t n0, int64_t n) {
  for (int64_t m0 = 0; m0 < m; m0 += QMR) {
    switch (std::min<int64_t>(QMR, m - m0)) {
      case 1: qtile<1, BITS>(panel, kb, xr, m0, bias, y, n, n0, n); break;
      case 2: qtile<2, BITS>(panel, kb, xr, m0, bias, y, n, n0, n); break;
      case 3: qtile<3, BITS>(panel, kb, xr, m0, bias, y, n, n0, n); break;
      default: qtile<4, BITS>(panel, kb, xr, m0, bias, y, n, n0, n); break;
    }
  }
}
constexpr bool HAS_VNNI = true;
#else
constexpr bool HAS_VNNI = false;
#endif

template <typename O>
void qlinear_impl(const torch::Tensor& packed, const QuantRows& xr, int64_t m, const float* bias, O* y, int64_t n, bool vector) {
  const int64_t kb = packed.size(1), bytes = packed.size(2), panels = (n + QPANEL - 1) / QPANEL;
  const uint8_t* pd = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = pd + p * kb * bytes;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (vector) {
        if (bytes == Q4_BYTES) qpanel<4>(panel, kb, xr, m, bias, y, p * QPANEL, n);
        else qpanel<8>(panel, kb, xr, m, bias, y, p * QPANEL, n);
        continue;
      }
#endif
      qtile_generic(panel, kb, bytes, xr, 0, m, bias, y, n, p * QPANEL, n);
    }
  });
}

// y (M, n) = x (M, k) W^T + bias over a pack_quant weight; y is x's dtype, or fp32.
// generic: the portable C++ path even where AVX512-VNNI is built (tests compare the two).
torch::Tensor qlinear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias, bool float_out,
                      bool generic) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "qlinear: 2-d float32 or bfloat16 x, rows contiguous");
  const int64_t m = x.size(0), k = x.size(1);
  check_quant(packed, n, k);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == n,
                "qlinear: a contiguous float32 bias of n");
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({m, n}, x.options().dtype(float_out ? torch::kFloat : x.scalar_type()));
  if (m == 0) return y;
  QuantRows xr;
  DISPATCH_FLOAT_BF16(x, "qlinear", [&] { quantize_rows(ptr<scalar>(x), x.stride(0), m, k, packed.size(1), xr); });
  const bool vector = HAS_VNNI && !generic;
  if (float_out) qlinear_impl(packed, xr, m, bd, y.data_ptr<float>(), n, vector);
  else DISPATCH_FLOAT_BF16(y, "qlinear", [&] { qlinear_impl(packed, xr, m, bd, ptr<scalar>(y), n, vector); });
  return y;
}

// Either kind of packed weight: a float/bf16 panel (pack_linear) or a quantized one (pack_quant).
torch::Tensor any_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n, bool float_out) {
  if (w.scalar_type() == torch::kByte) return qlinear(x, w, n, c10::nullopt, float_out, false);
  return linear(x, w, n, c10::nullopt, float_out);
}

// --- a whole decode step's layers in one call ---------------------------------------------
// For a batch of decode rows only (one token each, no shared-prefix group), every decoder
// layer of a Llama-family model without biases or q/k norms, run here instead of from
// Python: the same kernels as the per-op path (so the same numbers), without the ~100 us of
// Python and dispatch per layer. Returns (x, residual) before the final norm.
std::vector<torch::Tensor> decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_pools,
                                         std::vector<torch::Tensor> v_pools, torch::Tensor slots, torch::Tensor q_rows,
                                         torch::Tensor table, torch::Tensor lens, std::vector<torch::Tensor> in_norm,
                                         std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o_proj,
                                         std::vector<torch::Tensor> post_norm, std::vector<torch::Tensor> gate_up,
                                         std::vector<torch::Tensor> down, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t inter, double eps, double scale, std::vector<torch::Tensor> k_scales,
                                         std::vector<torch::Tensor> v_scales) {
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
  torch::Tensor residual;
  for (size_t i = 0; i < layers; ++i) {
    torch::Tensor h;
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
    auto attn = torch::empty({rows, heads, head_dim}, x.options());
    if (quantized) {  // store_kv_quant and decode_attention_quant, past their (once-only) checks
      DISPATCH_FLOAT_BF16(x, "decode_layers", [&] {
        DISPATCH_KV_QUANT(k_pools[i], "decode_layers", [&] {
          store_kv_quant_impl<scalar, qtype>(k_pools[i], v_pools[i], k_scales[i], v_scales[i], out_slots.data_ptr<int64_t>(), k, v);
          decode_attention_quant_impl<scalar, qtype>(q, k_pools[i], v_pools[i], k_scales[i], v_scales[i], attn, nullptr,
                                                     rows_c.data_ptr<int64_t>(), table.data_ptr<int64_t>(), table.stride(0),
                                                     lens_c.data_ptr<int64_t>(), table.size(0), float(scale));
        });
      });
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention, in place on the pool");
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional fused residual add");
  m.def("rope_", &rope_, "neox rotary embedding of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation");
  m.def("store_kv", &store_kv, "write K/V rows into the pool");
  m.def("decode_attention_quant", &decode_attention_quant, "paged decode attention over an int8/fp8 pool, in place");
  m.def("store_kv_quant", &store_kv_quant, "quantize K/V rows into an int8/fp8 pool and its scales");
  m.def("linear_supports", &linear_supports_dtype, "whether `linear` is built for this weight's dtype");
  m.def("pack_linear", &pack_linear, "pack a weight (N, K) for `linear`");
  m.def("decode_layers", &decode_layers, "every decoder layer of a decode-only batch, in one call");
  m.def("pack_quant", &pack_quant, "repack GGUF Q4_0/Q4_1/Q8_0 blocks (raw, kind, n, k) for qlinear");
  m.def("dequant_quant", &dequant_quant, "fp32 rows of a pack_quant weight (packed, n, k, rows)");
  m.def("qlinear", &qlinear, "a linear of a few rows over a pack_quant weight (x, packed, n, bias, float_out, generic)");
  m.def("linear", &linear, "a linear of a few rows over a packed weight (x, packed, n, bias, float_out)");
}
