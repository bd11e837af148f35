#include "engine/linear_observer.h"

#include <algorithm>
#include <cmath>
#include <thread>

namespace ocria_rt {

LinearObserver::LinearObserver(std::unique_ptr<Backend> inner, int num_threads)
    : inner_(std::move(inner)),
      threads_(num_threads > 0 ? num_threads : int(std::max(1u, std::thread::hardware_concurrency()))) {}

void LinearObserver::start(bool second_moment) {
  if (!slots_) throw Error(ErrorCode::kInternal, "LinearObserver: no projections to watch");
  slot_of_.clear();
  acc_.assign(slots_->size(), Accumulator{});
  for (size_t i = 0; i < slots_->size(); ++i) {
    const LinearSlot& s = (*slots_)[i];
    slot_of_[s.weight] = i;
    Accumulator& a = acc_[i];
    const size_t K = size_t(s.in_features);
    a.abs_max.assign(K, 0.0f);
    a.abs_sum.assign(K, 0.0);
    a.square_sum.assign(K, 0.0);
    if (second_moment && s.in_features <= kMaxSecondMomentFeatures) a.gram.assign(K * K, 0.0);
  }
  active_ = true;
}

void LinearObserver::linear(const Tensor& x, const LinearWeight& w, const Tensor& out) {
  if (active_) {
    auto it = slot_of_.find(&w);
    if (it != slot_of_.end()) observe(x, it->second);  // not the vision encoder's linears
  }
  inner_->linear(x, w, out);
}

void LinearObserver::observe(const Tensor& x, size_t slot) {
  const LinearSlot& s = (*slots_)[slot];
  Accumulator& a = acc_[slot];
  const int64_t T = x.dim(0), K = x.dim(1);
  if (K != s.in_features) throw Error(ErrorCode::kInternal, "LinearObserver: input " + x.shape_str() + " for a projection of " +
                                                                std::to_string(s.in_features) + " inputs");
  std::vector<float> h(size_t(T * K));
  inner_->copy_to_host(h.data(), x);
  if (!s.norm_scale.empty())  // the input of the checkpoint's modules, before the norm was folded
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) h[t * K + k] *= s.norm_scale[k];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const float v = h[t * K + k];
      a.abs_max[k] = std::max(a.abs_max[k], std::fabs(v));
      a.abs_sum[k] += std::fabs(v);
      a.square_sum[k] += double(v) * v;
    }
  a.tokens += T;
  if (a.gram.empty()) return;
  // gram[i, j] += sum_t x[t, i] x[t, j] for j <= i: dot products of the transposed columns.
  std::vector<float> xt(size_t(K * T));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) xt[k * T + t] = h[t * K + k];
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 4)
  for (int64_t i = 0; i < K; ++i) {
    const float* xi = xt.data() + i * T;
    double* row = a.gram.data() + i * K;
    for (int64_t j = 0; j <= i; ++j) {
      const float* xj = xt.data() + j * T;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t t = 0; t < T; ++t) dot += xi[t] * xj[t];
      row[j] += dot;
    }
  }
}

std::vector<LinearInputStats> LinearObserver::stats() const {
  std::vector<LinearInputStats> out;
  for (const Accumulator& a : acc_) {
    LinearInputStats st;
    const size_t K = a.abs_max.size();
    const double n = double(std::max<int64_t>(a.tokens, 1));
    st.tokens = a.tokens;
    st.abs_max = a.abs_max;
    st.abs_mean.resize(K);
    st.square_mean.resize(K);
    for (size_t k = 0; k < K; ++k) {
      st.abs_mean[k] = a.abs_sum[k] / n;
      st.square_mean[k] = a.square_sum[k] / n;
    }
    if (!a.gram.empty()) {
      st.second_moment.resize(K * K);
      for (size_t i = 0; i < K; ++i)
        for (size_t j = 0; j <= i; ++j) st.second_moment[i * K + j] = st.second_moment[j * K + i] = a.gram[i * K + j] / n;
    }
    out.push_back(std::move(st));
  }
  return out;
}

}  // namespace ocria_rt
