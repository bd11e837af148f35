// The CPU backend: the readable fp32 reference every other backend is tested against.
// Ops are spread over one file per op family (linear.cpp, attention.cpp, gdn.cpp, ...); this file
// declares the class, backend.cpp holds memory management and the thread setting.
#pragma once
#include <cmath>
#include <vector>

#include "ops/ops.h"

namespace ocria_rt {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads);

  const char* name() const override { return "cpu"; }
  DeviceKind device() const override { return DeviceKind::CPU; }
  DType activation_dtype() const override { return DType::F32; }
  DType weight_dtype() const override { return DType::F32; }
  int num_threads() const { return threads_; }

  void* allocate(size_t bytes) override;
  void release(void* ptr) override;
  void copy_from_host(const Tensor& dst, const void* src, DType src_dtype) override;
  void copy_to_host(void* dst, const Tensor& src) override;
  void fill_zero(const Tensor& t) override;
  void synchronize() override {}

  void embedding(const Tensor& table, const Tensor& ids, const Tensor& out) override;
  void linear(const Tensor& x, const LinearWeight& w, const Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, float eps) override;
  void fold_norm_weight(const Tensor& w, const Tensor& norm_weight) override;
  void add(const Tensor& residual, const Tensor& delta) override;
  void silu_mul(const Tensor& gate_up, const Tensor& out) override;
  void attention_prepare(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, const Tensor& positions,
                         const Tensor& rope_positions, const AttentionParams& p, const Tensor& q_out,
                         const Tensor& k_cache, const Tensor& v_cache) override;
  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                 const Tensor& positions, const AttentionParams& p, const Tensor& out) override;
  void gdn_conv(const Tensor& x, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& out) override;
  void gdn_recurrent(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                     const Tensor& state, const GdnParams& p, const Tensor& out) override;
  void gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                   const Tensor& state, const GdnParams& p, const Tensor& out) override;
  void gdn_gated_norm(const Tensor& o, const Tensor& z, const Tensor& weight, const GdnParams& p,
                      const Tensor& out) override;
  void sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step, const Tensor& tokens) override;
  void kl_divergence(const Tensor& reference, const Tensor& logits, const Tensor& out) override;
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, float eps) override;
  void gelu(const Tensor& x, const Tensor& out, bool tanh_approximation) override;
  void gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x) override;
  void vision_attention(const Tensor& qkv, const Tensor& patch_pos, const Tensor& cu_seqlens, int64_t num_heads,
                        float rope_theta, const Tensor& out) override;
  void increment(const Tensor& counter, int32_t by) override {
    for (int64_t i = 0; i < counter.numel(); ++i) counter.ptr<int32_t>()[i] += by;
  }
  void copy(const Tensor& dst, const Tensor& src) override;

  // speculative decoding (gdn.cpp, sampling.cpp: verification; dflash.cpp: the drafter)
  void gdn_verify(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                  const Tensor& conv_out, const Tensor& o, const Tensor& out, const GdnReplay& replay) override;
  void gdn_commit(const GdnReplay& replay, const Tensor& keep, const GdnParams& p, const Tensor& conv_state,
                  const Tensor& state) override;
  void speculative_accept(const Tensor& logits, const Tensor& draft, const Tensor& cand, const Tensor& cand_prob,
                          const SamplerConfig& config, const Tensor& step, const Tensor& out,
                          const Tensor& count) override;
  void draft_store_kv(const Tensor& kv, const Tensor& k_norm, const Tensor& positions, const AttentionParams& p,
                      const Tensor& k_cache, const Tensor& v_cache) override;
  void draft_attention(const Tensor& q, const Tensor& q_norm, const Tensor& positions, const Tensor& k_cache,
                       const Tensor& v_cache, const AttentionParams& p, const DraftMask& mask,
                       const Tensor& out) override;
  void dynamic_conv(const Tensor& x, const Tensor& dyn, const Tensor& base, int64_t group, const Tensor& out) override;
  void scale_softcap(const Tensor& x, float multiplier, float softcap) override;
  void selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ,
                     const Tensor& anchor, float temperature, uint64_t seed, const Tensor& step, const Tensor& tokens,
                     const Tensor& cand, const Tensor& cand_prob) override;
  void speculative_advance(const Tensor& count, const Tensor& tokens, const Tensor& positions,
                           const Tensor& rope_positions, const Tensor& draft_ids, const Tensor& verify_ids,
                           const Tensor& step) override;  // speculative_step.cpp

 private:
  int threads_;
};

// Row r of a (possibly row-strided) fp32 / int32 tensor.
inline float* row_f32(const Tensor& t, int64_t r) { return t.ptr<float>() + r * t.row_stride; }
inline const int32_t* ids_i32(const Tensor& t) { return t.ptr<const int32_t>(); }

// Throws Error(kInternal) unless t is an F32 tensor on the CPU.
void expect_cpu_f32(const Tensor& t, const char* what);

// y = x * rsqrt(mean(x^2) + eps) * scale(i), over n elements (y may be x).
template <class Scale>
void rms_normalise(const float* x, float* y, int64_t n, float eps, Scale scale) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(float(ss / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * scale(i);
}

// The sampler's view of one row of logits at temperature > 0 (sampling.cpp): softmax(logits / T) in
// `prob`, the tokens sample() may draw in `order[0 : kept]` (descending probability, ties by lower id;
// top-k, then top-p) with their total `prob` in `mass`, and `p`, the distribution draw() follows
// (prob / mass on the kept tokens, 0 elsewhere).
struct SamplerDistribution {
  std::vector<float> prob;
  std::vector<int32_t> order;
  int64_t kept = 0;
  double mass = 0;
  std::vector<double> p;

  int32_t draw(float u) const;  // the token sample() draws for the uniform u
};
SamplerDistribution sampler_distribution(const float* logits, int64_t V, const SamplerConfig& cfg);
int32_t argmax_row(const float* logits, int64_t V);  // the first maximum, as sample() at temperature 0

// attention.cpp: the zero-centred RMSNorm of one head in place, and rotate-half RoPE of its first
// p.rotary_dim dims at the (t, h, w) position pos3.
void head_norm(float* x, const float* w, int64_t n, float eps);
void apply_rope(float* x, const AttentionParams& p, const int32_t* pos3);

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace ocria_rt
