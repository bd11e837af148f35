// A Backend that hands every op to another backend and, while observing, collects statistics of the
// inputs of the decoder's projections: the calibration behind quantization (ocria_rt.quantize), on any
// backend. The ops that join a projection with other work (rms_norm_linear, linear_glu, linear_add and
// their GLU forms) run as the Backend defaults here, so that every projection's input passes through
// linear(): on the CPU it is read there (in double, X^T X per call in float), on a GPU the wrapped
// backend adds it to accumulators on the device (Backend::accumulate_input_stats), read back once by
// stats(). All other ops go straight to the wrapped backend. It captures no graphs. An engine wraps
// its backend in one only when asked (EngineOptions::linear_observer).
#pragma once
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "model/qwen35.h"
#include "ocria_rt/engine.h"
#include "ops/ops.h"

namespace ocria_rt {

class LinearObserver final : public Backend {
 public:
  // num_threads: host threads for the statistics (0: all cores).
  LinearObserver(std::unique_ptr<Backend> inner, int num_threads);

  // The projections whose inputs are observed (the model's slots; they must outlive the observer).
  void watch(const std::vector<LinearSlot>* slots) { slots_ = slots; }
  // Starts collecting (earlier statistics are dropped); second_moment adds X^T X per projection.
  void start(bool second_moment);
  void stop() { active_ = false; }
  // The statistics so far, one per watched slot in order.
  std::vector<LinearInputStats> stats() const;

  const char* name() const override { return inner_->name(); }
  DeviceKind device() const override { return inner_->device(); }
  DType activation_dtype() const override { return inner_->activation_dtype(); }
  DType weight_dtype() const override { return inner_->weight_dtype(); }
  void check_model_shapes(const AttentionParams& a, const GdnParams& g) const override { inner_->check_model_shapes(a, g); }

  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void release(void* ptr) override { inner_->release(ptr); }
  void copy_from_host(const Tensor& dst, const void* src, DType src_dtype) override {
    inner_->copy_from_host(dst, src, src_dtype);
  }
  void copy_to_host(void* dst, const Tensor& src) override { inner_->copy_to_host(dst, src); }
  void fill_zero(const Tensor& t) override { inner_->fill_zero(t); }
  void synchronize() override { inner_->synchronize(); }

  bool queues_work() const override { return inner_->queues_work(); }
  void post_i32(const Tensor& values, const Tensor& tag) override { inner_->post_i32(values, tag); }
  std::vector<int32_t> wait_post_i32s(int32_t tag) override { return inner_->wait_post_i32s(tag); }
  void clear_posts() override { inner_->clear_posts(); }
  void mark_time(int i) override { inner_->mark_time(i); }
  double seconds_between_marks(int i, int j) override { return inner_->seconds_between_marks(i, j); }

  void embedding(const Tensor& table, const Tensor& ids, const Tensor& out) override { inner_->embedding(table, ids, out); }
  void linear(const Tensor& x, const LinearWeight& w, const Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, float eps) override {
    inner_->rms_norm(x, weight, out, eps);
  }
  void add(const Tensor& residual, const Tensor& delta) override { inner_->add(residual, delta); }
  void silu_mul(const Tensor& gate_up, const Tensor& out) override { inner_->silu_mul(gate_up, out); }
  void fold_norm_weight(const Tensor& w, const Tensor& norm_weight) override { inner_->fold_norm_weight(w, norm_weight); }
  void prepare_quantized_weight(const LinearWeight& w) override { inner_->prepare_quantized_weight(w); }
  void attention_prepare(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, const Tensor& positions,
                         const Tensor& rope_positions, const AttentionParams& p, const Tensor& q_out,
                         const Tensor& k_cache, const Tensor& v_cache) override {
    inner_->attention_prepare(qkv, q_norm, k_norm, positions, rope_positions, p, q_out, k_cache, v_cache);
  }
  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                 const Tensor& positions, const AttentionParams& p, const Tensor& out) override {
    inner_->attention(q, k_cache, v_cache, qkv, positions, p, out);
  }
  void attention_decode(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, const Tensor& positions,
                        const Tensor& rope_positions, const AttentionParams& p, const Tensor& q, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& out) override {
    inner_->attention_decode(qkv, q_norm, k_norm, positions, rope_positions, p, q, k_cache, v_cache, out);
  }
  void gdn_conv(const Tensor& x, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& out) override {
    inner_->gdn_conv(x, conv_weight, conv_state, out);
  }
  void gdn_recurrent(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                     const Tensor& state, const GdnParams& p, const Tensor& out) override {
    inner_->gdn_recurrent(qkv, ba, A_log, dt_bias, state, p, out);
  }
  void gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                   const Tensor& state, const GdnParams& p, const Tensor& out) override {
    inner_->gdn_chunked(qkv, ba, A_log, dt_bias, state, p, out);
  }
  void gdn_gated_norm(const Tensor& o, const Tensor& z, const Tensor& weight, const GdnParams& p,
                      const Tensor& out) override {
    inner_->gdn_gated_norm(o, z, weight, p, out);
  }
  void gdn_decode(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                  const Tensor& conv_out, const Tensor& o, const Tensor& out) override {
    inner_->gdn_decode(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, p, conv_out, o, out);
  }
  void sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step, const Tensor& tokens) override {
    inner_->sample(logits, config, step, tokens);
  }
  void kl_divergence(const Tensor& reference, const Tensor& logits, const Tensor& out) override {
    inner_->kl_divergence(reference, logits, out);
  }
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, float eps) override {
    inner_->layer_norm(x, weight, bias, out, eps);
  }
  void gelu(const Tensor& x, const Tensor& out, bool tanh_approximation) override { inner_->gelu(x, out, tanh_approximation); }
  void gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x) override {
    inner_->gather_blend_add(table, rows, weights, x);
  }
  void vision_attention(const Tensor& qkv, const Tensor& patch_pos, const Tensor& cu_seqlens, int64_t num_heads,
                        float rope_theta, const Tensor& out) override {
    inner_->vision_attention(qkv, patch_pos, cu_seqlens, num_heads, rope_theta, out);
  }
  void increment(const Tensor& counter, int32_t by) override { inner_->increment(counter, by); }
  void copy(const Tensor& dst, const Tensor& src) override { inner_->copy(dst, src); }
  void gdn_verify(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                  const Tensor& conv_out, const Tensor& o, const Tensor& out, const GdnReplay& replay) override {
    inner_->gdn_verify(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, p, conv_out, o, out, replay);
  }
  void gdn_commit(const GdnReplay& replay, const Tensor& keep, const GdnParams& p, const Tensor& conv_state,
                  const Tensor& state) override {
    inner_->gdn_commit(replay, keep, p, conv_state, state);
  }
  void draft_store_kv(const Tensor& kv, const Tensor& k_norm, const Tensor& positions, const AttentionParams& p,
                      const Tensor& k_cache, const Tensor& v_cache) override {
    inner_->draft_store_kv(kv, k_norm, positions, p, k_cache, v_cache);
  }
  void draft_attention(const Tensor& q, const Tensor& q_norm, const Tensor& positions, const Tensor& k_cache,
                       const Tensor& v_cache, const AttentionParams& p, const DraftMask& mask, const Tensor& out) override {
    inner_->draft_attention(q, q_norm, positions, k_cache, v_cache, p, mask, out);
  }
  void dynamic_conv(const Tensor& x, const Tensor& dyn, const Tensor& base, int64_t group, const Tensor& out) override {
    inner_->dynamic_conv(x, dyn, base, group, out);
  }
  void scale_softcap(const Tensor& x, float multiplier, float softcap) override {
    inner_->scale_softcap(x, multiplier, softcap);
  }
  void selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ, const Tensor& anchor,
                     float temperature, uint64_t seed, const Tensor& step, const Tensor& tokens, const Tensor& cand,
                     const Tensor& cand_prob) override {
    inner_->selector_walk(logits, h, pred, succ, anchor, temperature, seed, step, tokens, cand, cand_prob);
  }
  void speculative_accept(const Tensor& logits, const Tensor& draft, const Tensor& cand, const Tensor& cand_prob,
                          const SamplerConfig& config, const Tensor& step, const Tensor& out,
                          const Tensor& count) override {
    inner_->speculative_accept(logits, draft, cand, cand_prob, config, step, out, count);
  }
  void speculative_advance(const Tensor& count, const Tensor& tokens, const Tensor& positions,
                           const Tensor& rope_positions, const Tensor& draft_ids, const Tensor& verify_ids,
                           const Tensor& step) override {
    inner_->speculative_advance(count, tokens, positions, rope_positions, draft_ids, verify_ids, step);
  }

 private:
  struct Accumulator {
    int64_t tokens = 0;
    // on the host (a CPU backend)
    std::vector<float> abs_max;
    std::vector<double> abs_sum, square_sum;
    std::vector<double> gram;  // [K, K] sum of x x^T; the lower triangle is accumulated
    // on the device (Backend::accumulate_input_stats): of x before the slot's norm scale
    Tensor device_abs_max, device_sums, device_gram;
  };
  void observe(const Tensor& x, size_t slot);
  LinearInputStats device_stats(size_t slot) const;

  std::unique_ptr<Backend> inner_;
  int threads_;
  bool on_device_;                       // the statistics are kept on the wrapped backend's device
  std::unique_ptr<Arena> device_arena_;  // their accumulators
  const std::vector<LinearSlot>* slots_ = nullptr;
  std::unordered_map<const LinearWeight*, size_t> slot_of_;
  std::vector<Accumulator> acc_;
  bool active_ = false;
};

}  // namespace ocria_rt
