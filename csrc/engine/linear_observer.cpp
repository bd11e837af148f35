#include "engine/linear_observer.h"

#include <algorithm>
#include <cmath>
#include <thread>

namespace ocria_rt {

LinearObserver::LinearObserver(std::unique_ptr<Backend> inner, int num_threads)
    : inner_(std::move(inner)),
      threads_(num_threads > 0 ? num_threads : int(std::max(1u, std::thread::hardware_concurrency()))),
      on_device_(inner_->device() != DeviceKind::CPU) {}

void LinearObserver::start(bool second_moment) {
  if (!slots_) throw Error(ErrorCode::kInternal, "LinearObserver: no projections to watch");
  slot_of_.clear();
  acc_.assign(slots_->size(), Accumulator{});
  device_arena_.reset();
  if (on_device_) device_arena_ = std::make_unique<Arena>(*inner_);
  for (size_t i = 0; i < slots_->size(); ++i) {
    const LinearSlot& s = (*slots_)[i];
    slot_of_[s.weight] = i;
    Accumulator& a = acc_[i];
    const int64_t K = s.in_features;
    const bool gram = second_moment && K <= LinearInputStats::kMaxSecondMomentFeatures;
    if (on_device_) {
      a.device_abs_max = device_arena_->alloc(DType::F32, {K});
      a.device_sums = device_arena_->alloc(DType::F32, {4, K});
      inner_->fill_zero(a.device_abs_max);
      inner_->fill_zero(a.device_sums);
      if (gram) {
        a.device_gram = device_arena_->alloc(DType::F32, {2, K, K});
        inner_->fill_zero(a.device_gram);
      }
      continue;
    }
    a.abs_max.assign(size_t(K), 0.0f);
    a.abs_sum.assign(size_t(K), 0.0);
    a.square_sum.assign(size_t(K), 0.0);
    if (gram) a.gram.assign(size_t(K * K), 0.0);
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
  if (on_device_) {
    inner_->accumulate_input_stats(x, a.device_abs_max, a.device_sums, a.device_gram);
    a.tokens += T;
    return;
  }
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

LinearInputStats LinearObserver::device_stats(size_t slot) const {
  const LinearSlot& s = (*slots_)[slot];
  const Accumulator& a = acc_[slot];
  const size_t K = size_t(s.in_features);
  const double n = double(std::max<int64_t>(a.tokens, 1));
  // x's statistics times the norm scale (as the checkpoint's modules see it); Kahan sums: sum - compensation
  auto scale = [&](size_t k) { return s.norm_scale.empty() ? 1.0 : double(s.norm_scale[k]); };
  std::vector<float> abs_max(K), sums(4 * K);
  inner_->copy_to_host(abs_max.data(), a.device_abs_max);
  inner_->copy_to_host(sums.data(), a.device_sums);
  LinearInputStats st;
  st.tokens = a.tokens;
  st.abs_max.resize(K);
  st.abs_mean.resize(K);
  st.square_mean.resize(K);
  for (size_t k = 0; k < K; ++k) {
    st.abs_max[k] = float(abs_max[k] * std::fabs(scale(k)));
    st.abs_mean[k] = (double(sums[k]) - double(sums[K + k])) * std::fabs(scale(k)) / n;
    st.square_mean[k] = (double(sums[2 * K + k]) - double(sums[3 * K + k])) * scale(k) * scale(k) / n;
  }
  if (a.device_gram.defined()) {
    std::vector<float> gram(2 * K * K);
    inner_->copy_to_host(gram.data(), a.device_gram);
    st.second_moment.resize(K * K);
    for (size_t i = 0; i < K; ++i)
      for (size_t j = 0; j <= i; ++j)
        st.second_moment[i * K + j] = st.second_moment[j * K + i] =
            (double(gram[i * K + j]) - double(gram[K * K + i * K + j])) * scale(i) * scale(j) / n;
  }
  return st;
}

std::vector<LinearInputStats> LinearObserver::stats() const {
  std::vector<LinearInputStats> out;
  for (size_t slot = 0; slot < acc_.size(); ++slot) {
    if (on_device_) {
      out.push_back(device_stats(slot));
      continue;
    }
    const Accumulator& a = acc_[slot];
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
