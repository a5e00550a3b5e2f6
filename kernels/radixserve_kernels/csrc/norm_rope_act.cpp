// RMSNorm (with the residual add fused in), rotary embedding, SwiGLU: the small elementwise
// ops of a layer. Torch references: F.rms_norm (after x + residual), models.layers.apply_rope,
// F.silu(x[..., :n]) * x[..., n:].
#include "common.h"

namespace rs {
namespace {

// x (rows, n). With a residual: r = x + residual (rounded to the dtype, as torch's add is),
// returns (norm(r) * w, r); without: (norm(x) * w,).
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, at::Tensor& out,
                   at::Tensor* sum_out, double eps) {
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

}  // namespace

std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(), "rms_norm: contiguous x, weight of x's last dim and dtype");
  auto out = at::empty_like(x);
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual like x");
    auto sum = at::empty_like(x);
    DISPATCH_FLOAT_BF16(x, "rms_norm", [&] { rms_norm_impl<scalar>(x, &*residual, weight, out, &sum, eps); });
    return {out, sum};
  }
  DISPATCH_FLOAT_BF16(x, "rms_norm", [&] { rms_norm_impl<scalar>(x, nullptr, weight, out, nullptr, eps); });
  return {out};
}

namespace {

// --- rotary embedding (neox, rotate-half), in place on q and k ----------------------------
// x (T, heads, D) with any row/head strides; cos/sin (T, D/2) float32 rows (any row stride).
template <typename T>
void rope_impl(at::Tensor& x, const float* cs, const float* sn, int64_t sc) {
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

}  // namespace

void rope_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0) && cos.size(1) * 2 == q.size(2),
              "rope_: float32 (T, D/2) cos/sin with contiguous rows");
  for (at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == cos.size(0), "rope_: (T, heads, D) with contiguous D");
    DISPATCH_FLOAT_BF16(*x, "rope_", [&] { rope_impl<scalar>(*x, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0)); });
  }
}

namespace {

// --- SwiGLU: silu(x[:, :n]) * x[:, n:] ----------------------------------------------------
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = out.size(-1), rows = out.numel() / n;
  const T* xd = ptr<T>(x);
  T* od = ptr<T>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xd + r * 2 * n;
      const T* u = g + n;
      T* o = od + r * n;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        const VecF a = vload(g + i);
        vstore(o + i, a / (vset1(1.f) + vexp(vzero() - a)) * vload(u + i));
      }
      for (; i < n; ++i) {
        const float a = ld(g, i);
        st(o, i, a / (1.f + std::exp(-a)) * ld(u, i));
      }
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: contiguous x with an even last dim");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, x.options());
  DISPATCH_FLOAT_BF16(x, "silu_and_mul", [&] { silu_and_mul_impl<scalar>(x, out); });
  return out;
}

}  // namespace rs
