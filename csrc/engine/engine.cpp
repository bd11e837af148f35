// The engine: owns the backend, the weights, one sequence's caches and the decode loop.
#include "ocria_rt/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>

#include "core/arena.h"
#include "core/safetensors.h"
#include "engine/linear_observer.h"
#include "engine/speculative.h"
#include "model/quant_config.h"
#include "model/dflash.h"
#include "model/qwen35.h"
#include "model/qwen35_vision.h"
#include "model/vision_grid.h"
#include "ops/ops.h"

namespace ocria_rt {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

constexpr int64_t kDefaultMaxContext = 32768;
constexpr int64_t kLogitRows = 16;  // score() computes logits this many rows at a time
// keep_reference() and reference_kl() compute logits this many rows at a time on a GPU (the LM head's
// GEMM is then compute-bound), kLogitRows on the CPU (as score(): the same calls the observer sees)
constexpr int64_t kReferenceRowsGpu = 256;

std::unique_ptr<Backend> make_backend(const EngineOptions& o) {
  if (o.device == "cpu") return make_cpu_backend(o.num_threads);
  if (o.device == "cuda") return make_cuda_backend(0);
  if (o.device.rfind("cuda:", 0) == 0) {
    const std::string idx = o.device.substr(5);
    if (!idx.empty() && idx.size() < 4 && std::all_of(idx.begin(), idx.end(), ::isdigit))
      return make_cuda_backend(std::stoi(idx));
  }
  throw Error(ErrorCode::kInvalidArgument, "device '" + o.device + "' is not one of 'cpu', 'cuda', 'cuda:N'");
}

// The backend, behind a LinearObserver when the options ask for one.
std::unique_ptr<Backend> make_engine_backend(const EngineOptions& o) {
  std::unique_ptr<Backend> be = make_backend(o);
  if (!o.linear_observer) return be;
  return std::make_unique<LinearObserver>(std::move(be), o.num_threads);
}

class EngineImpl final : public Engine {
 public:
  EngineImpl(const std::string& model_dir, const EngineOptions& opt)
      : config_(load_model_config(model_dir)), backend_(make_engine_backend(opt)) {
    if (opt.max_context < 0) throw Error(ErrorCode::kInvalidArgument, "max_context must be >= 0, got " + std::to_string(opt.max_context));
    if (opt.prefill_chunk < 0) throw Error(ErrorCode::kInvalidArgument, "prefill_chunk must be >= 0, got " + std::to_string(opt.prefill_chunk));
    max_context_ = opt.max_context > 0 ? opt.max_context : std::min(config_.max_position_embeddings, kDefaultMaxContext);
    const int64_t default_chunk = backend_->device() == DeviceKind::CPU ? 512 : 2048;
    prefill_chunk_ = std::min(opt.prefill_chunk > 0 ? opt.prefill_chunk : default_chunk, max_context_);

    std::optional<DraftConfig> draft_config;
    if (!opt.drafter.empty()) draft_config = load_draft_config(opt.drafter, config_);
    if (!draft_config && (opt.benchmark_forced_acceptance != 0 || opt.benchmark_phase_timing))
      throw Error(ErrorCode::kInvalidArgument, "benchmark_forced_acceptance and benchmark_phase_timing need a drafter");
    // Verify steps write the target's and the drafter's cache rows past the last token (see
    // SpeculativeDecoder::issue_step).
    const int64_t block = draft_config ? draft_config->block_size : 0;
    const int64_t cache_rows = draft_config ? SpeculativeDecoder::cache_rows(max_context_, block) : max_context_;

    weights_ = std::make_unique<Arena>(*backend_);
    state_arena_ = std::make_unique<Arena>(*backend_);
    work_ = std::make_unique<Arena>(*backend_);
    {
      Checkpoint ck = Checkpoint::open(model_dir);  // mapped only while the weights are loaded
      quant_ = QuantConfig::load(model_dir);
      model_ = std::make_unique<Qwen35Model>(config_, quant_, ck, *backend_, *weights_);
      if (config_.has_vision) {
        if (opt.max_image_patches < config_.vision.merge_unit())
          throw Error(ErrorCode::kInvalidArgument, "max_image_patches must be at least " + std::to_string(config_.vision.merge_unit()));
        vision_ = std::make_unique<Qwen35Vision>(config_, ck, *backend_, *weights_, *work_, opt.max_image_patches);
      }
    }
    state_ = model_->make_state(*state_arena_, cache_rows);
    ws_ = model_->make_workspace(*work_, std::max(prefill_chunk_, block));
    ids_ = work_->alloc(DType::I32, {prefill_chunk_});
    positions_ = work_->alloc(DType::I32, {prefill_chunk_});
    rope_positions_ = work_->alloc(DType::I32, {prefill_chunk_, 3});
    logits_ = work_->alloc(backend_->activation_dtype(), {kLogitRows, config_.vocab_size});
    step_ = work_->alloc(DType::I32, {1});
    if (draft_config)
      spec_ = std::make_unique<SpeculativeDecoder>(*draft_config, opt.drafter, *backend_, *model_, state_, ws_, step_,
                                                   *work_, max_context_, prefill_chunk_, opt);
    token_ = work_->alloc(DType::I32, {1});
    decode_positions_ = work_->alloc(DType::I32, {4});
    decode_position_ = decode_positions_.rows(0, 1);
    decode_rope_position_ = decode_positions_.rows(1, 3).view({1, 3});
    use_graphs_ = opt.cuda_graphs && backend_->supports_graphs();
    observer_ = opt.linear_observer ? static_cast<LinearObserver*>(backend_.get()) : nullptr;
    if (observer_) observer_->watch(&model_->linear_slots());
    edits_ = std::make_unique<Arena>(*backend_);
    backend_->synchronize();
  }

  const ModelConfig& config() const override { return config_; }
  int64_t max_context() const override { return max_context_; }

  EngineStats stats() const override {
    EngineStats s;
    s.device = backend_->device() == DeviceKind::CPU ? "cpu" : "cuda";
    s.backend_name = backend_->name();
    s.weight_bytes = int64_t(weights_->bytes_used());
    s.weight_bytes_fp8 = model_->quantized_bytes().fp8;
    s.weight_bytes_nvfp4 = model_->quantized_bytes().nvfp4;
    switch (quant_.producer()) {
      case QuantProducer::kNone: s.quantization = "none"; break;
      case QuantProducer::kModelOpt: s.quantization = "modelopt"; break;
      case QuantProducer::kCompressedTensors: s.quantization = "compressed-tensors"; break;
    }
    s.state_bytes = int64_t(state_arena_->bytes_used());
    s.workspace_bytes = int64_t(work_->bytes_used());
    // Known once a decode step has been captured: its kernels, replayed with one launch.
    s.kernels_per_decode_step = graph_ready_ ? backend_->graph_kernels(kDecodeGraph) : 0;
    s.launches_per_decode_step = graph_ready_ ? 1 : 0;
    if (spec_) {
      s.draft_block_size = spec_->drafter().config().block_size;
      s.drafter_weight_bytes = spec_->weight_bytes();
      s.drafter_state_bytes = spec_->state_bytes();
      s.kernels_per_speculative_step = spec_->kernels_per_step();
      s.launches_per_speculative_step = spec_->launches_per_step();
      const PhaseTimes& t = spec_->phase_times();
      s.timed_speculative_steps = t.steps;
      s.speculative_draft_seconds = t.draft;
      s.speculative_verify_seconds = t.verify;
      s.speculative_commit_seconds = t.commit;
    }
    return s;
  }

  std::vector<float> score(const std::vector<int32_t>& tokens, int64_t chunk, const ImageBatch* images) override {
    validate_tokens(tokens, "score");
    if (chunk < 0) throw Error(ErrorCode::kInvalidArgument, "chunk must be >= 0 (0: the prefill chunk), got " + std::to_string(chunk));
    active_ = false;
    const int64_t V = config_.vocab_size;
    std::vector<float> out(tokens.size() * size_t(V));
    prefill(tokens, chunk > 0 ? std::min(chunk, prefill_chunk_) : prefill_chunk_, images, [&](int64_t c0, int64_t T) {
      for (int64_t r0 = 0; r0 < T; r0 += kLogitRows) {
        const int64_t R = std::min(kLogitRows, T - r0);
        model_->logits(ws_.normed.rows(r0, R), logits_.rows(0, R));
        backend_->copy_to_host(out.data() + (c0 + r0) * V, logits_.rows(0, R));
      }
    });
    return out;
  }

  std::vector<float> hidden_states(const std::vector<int32_t>& tokens, const std::vector<int64_t>& layers,
                                   const ImageBatch* images) override {
    validate_tokens(tokens, "hidden_states");
    if (layers.empty()) throw Error(ErrorCode::kInvalidArgument, "hidden_states: no layers given");
    for (int64_t l : layers)
      if (l < 0 || l >= config_.num_layers)
        throw Error(ErrorCode::kInvalidArgument, "hidden_states: layer " + std::to_string(l) + " is not one of the model's " +
                                                     std::to_string(config_.num_layers) + " decoder layers (0.." +
                                                     std::to_string(config_.num_layers - 1) + ")");
    active_ = false;
    const int64_t width = int64_t(layers.size()) * config_.hidden_size;
    Arena scratch(*backend_, 0);  // for this call only, of the taps' size
    HiddenTaps taps{layers, scratch.alloc(backend_->activation_dtype(), {prefill_chunk_, width})};
    std::vector<float> out(tokens.size() * size_t(width));
    prefill(tokens, prefill_chunk_, images, [&](int64_t c0, int64_t T) {
      backend_->copy_to_host(out.data() + c0 * width, taps.out.rows(0, T));
    }, &taps);
    return out;
  }

  void start(const std::vector<int32_t>& prompt, const SamplingParams& sp, const ImageBatch* images) override {
    validate_tokens(prompt, "prompt");
    if (sp.max_new_tokens <= 0)
      throw Error(ErrorCode::kInvalidArgument, "max_new_tokens must be positive, got " + std::to_string(sp.max_new_tokens));
    if (int64_t(prompt.size()) + sp.max_new_tokens > max_context_)
      throw Error(ErrorCode::kInvalidArgument, "prompt (" + std::to_string(prompt.size()) + " tokens) + max_new_tokens (" +
                                                   std::to_string(sp.max_new_tokens) + ") exceeds the context limit of " +
                                                   std::to_string(max_context_) + " tokens");
    if (!(sp.temperature >= 0) || !std::isfinite(sp.temperature))
      throw Error(ErrorCode::kInvalidArgument, "temperature must be a finite number >= 0");
    if (sp.top_k < 0) throw Error(ErrorCode::kInvalidArgument, "top_k must be >= 0 (0: no limit)");
    if (!(sp.top_p > 0 && sp.top_p <= 1)) throw Error(ErrorCode::kInvalidArgument, "top_p must be in (0, 1]");
    for (int32_t t : sp.stop_token_ids)
      if (t < 0 || t >= config_.vocab_size)
        throw Error(ErrorCode::kInvalidArgument, "stop token id " + std::to_string(t) + " is outside the vocabulary");

    const auto t0 = Clock::now();
    active_ = false;
    max_new_ = sp.max_new_tokens;
    begin_sequence(prompt, images, {sp.temperature, int32_t(std::min<int64_t>(sp.top_k, config_.vocab_size)), sp.top_p, sp.seed},
                   spec_ && sp.speculative);
    const int32_t n = int32_t(prompt.size());
    const int32_t rope_n = int32_t(n + rope_delta_), rope3[3] = {rope_n, rope_n, rope_n};
    backend_->copy_from_host(decode_position_, &n, DType::I32);
    backend_->copy_from_host(decode_rope_position_, rope3, DType::I32);
    backend_->clear_posts();
    active_ = true;
    returned_ = issued_ = 0;
    prefill_seconds_ = seconds_since(t0);
    if (speculative_) spec_->issue_ahead();
    else if (backend_->queues_work()) issue_steps_through(std::min<int64_t>(1, max_new_ - 1));
  }

  std::vector<int32_t> draft(const std::vector<int32_t>& prompt, const ImageBatch* images) override {
    if (!spec_) throw Error(ErrorCode::kInvalidArgument, "draft(): no drafter is loaded (create the engine with a drafter)");
    validate_tokens(prompt, "prompt");
    active_ = false;
    begin_sequence(prompt, images, SamplerConfig{}, true);
    return spec_->draft();
  }

  std::vector<int64_t> acceptance_lengths() const override {
    return speculative_ ? spec_->acceptance_lengths() : std::vector<int64_t>{};
  }
  void set_proposal_hook(ProposalHook hook) override {
    if (spec_) spec_->set_proposal_hook(std::move(hook));
  }

  int32_t next_token() override {
    if (!active_) throw Error(ErrorCode::kInvalidArgument, "next_token() called without start() or after the sequence ended");
    const int64_t k = returned_;  // token 0 comes from the prefill, token k >= 1 from decode step k
    if (speculative_) {
      if (k > 0) pending_ = spec_->next_token(k);  // tokens 1.. come from verify steps, each emitting one or more
    } else if (k > 0) {
      // A backend that queues work has step k in flight already and gets step k + 1 before the wait
      // for token k, so the device never idles on the host between steps (a generation that stops
      // early has computed one step more than it returns). Each step posts its token, tagged with
      // its sequence index, from inside the graph.
      issue_steps_through(backend_->queues_work() ? std::min(k + 1, max_new_ - 1) : k);
      pending_ = backend_->wait_post_i32(int32_t(prompt_tokens_ + k - 1));
    }
    if (++returned_ == max_new_) active_ = false;
    return pending_;
  }

  double last_prefill_seconds() const override { return prefill_seconds_; }

  std::vector<LinearGroupInfo> linear_groups() const override {
    std::vector<LinearGroupInfo> out;
    for (const LinearSlot& s : model_->linear_slots()) {
      LinearGroupInfo g;
      g.modules = s.modules;
      g.rows = s.rows;
      g.in_features = s.in_features;
      switch (s.weight->format) {
        case LinearWeight::Format::kDense: g.format = "dense"; break;
        case LinearWeight::Format::kFp8: g.format = "fp8"; break;
        case LinearWeight::Format::kNvfp4: g.format = "nvfp4"; break;
      }
      out.push_back(std::move(g));
    }
    return out;
  }

  void observe_linear_inputs(bool on, bool second_moment) override {
    if (!observer_)
      throw Error(ErrorCode::kInvalidArgument, "observe_linear_inputs: the engine was created without linear_observer");
    if (on) {
      observer_->start(second_moment);
    } else {
      observer_->stop();
    }
  }

  std::vector<LinearInputStats> linear_input_stats() const override {
    if (!observer_)
      throw Error(ErrorCode::kInvalidArgument, "linear_input_stats: the engine was created without linear_observer");
    return observer_->stats();
  }

  void set_linear_weight(const std::string& module, const float* weight, int64_t count) override {
    model_->set_linear_rows(module, weight, count, *edits_);
    drop_graphs();  // a captured step may hold the old LM head
  }

  void restore_linear_weights() override {
    model_->restore_linears();
    edits_ = std::make_unique<Arena>(*backend_);
    drop_graphs();
  }

  int64_t keep_reference(const std::vector<int32_t>& tokens, int64_t begin, int64_t end, const ImageBatch* images,
                         const float* logits) override {
    validate_tokens(tokens, "keep_reference");
    if (begin < 0 || begin >= end || end > int64_t(tokens.size()))
      throw Error(ErrorCode::kInvalidArgument, "keep_reference: rows [" + std::to_string(begin) + ", " +
                                                   std::to_string(end) + ") are not a non-empty range of the " +
                                                   std::to_string(tokens.size()) + " tokens");
    if (!references_) references_ = std::make_unique<Arena>(*backend_);
    Reference ref;
    ref.tokens = tokens;
    ref.begin = begin;
    ref.end = end;
    if (images) {  // the encoder output stays with the reference: the vision tower is never edited
      ref.grids = checked_grids(*images);
      const Tensor features = vision_->encode(images->pixel_values, ref.grids);
      ref.features = references_->alloc(features.dtype, {features.dim(0), features.dim(1)});
      backend_->copy(ref.features, features);
    }
    ref.logits = references_->alloc(backend_->activation_dtype(), {end - begin, config_.vocab_size});
    if (logits) {
      backend_->copy_from_host(ref.logits, logits, DType::F32);
    } else {
      active_ = false;
      prefill_encoded(tokens, prefill_chunk_, ref.grids, ref.features, [&](int64_t c0, int64_t T) {
        for_reference_rows(ref, c0, T, [&](int64_t r, int64_t R, const Tensor& hidden) {
          model_->logits(hidden, ref.logits.rows(r - begin, R));
        });
      });
    }
    references_list_.push_back(std::move(ref));
    return int64_t(references_list_.size()) - 1;
  }

  std::vector<double> reference_kl(int64_t index) override {
    const Reference& ref = reference(index);
    const int64_t rows = ref.end - ref.begin;
    if (!reference_logits_.defined())
      reference_logits_ = references_->alloc(backend_->activation_dtype(), {reference_rows(), config_.vocab_size});
    if (!kl_out_.defined() || kl_out_.numel() < rows)  // grows to the longest reference
      kl_out_ = references_->alloc(DType::F32, {rows});
    active_ = false;
    prefill_encoded(ref.tokens, prefill_chunk_, ref.grids, ref.features, [&](int64_t c0, int64_t T) {
      for_reference_rows(ref, c0, T, [&](int64_t r, int64_t R, const Tensor& hidden) {
        model_->logits(hidden, reference_logits_.rows(0, R));
        backend_->kl_divergence(ref.logits.rows(r - ref.begin, R), reference_logits_.rows(0, R),
                                kl_out_.rows(r - ref.begin, R));
      });
    });
    std::vector<float> kl(static_cast<size_t>(rows));
    backend_->copy_to_host(kl.data(), kl_out_.rows(0, rows));
    return std::vector<double>(kl.begin(), kl.end());
  }

  std::vector<float> reference_logits(int64_t index) const override {
    const Reference& ref = reference(index);
    std::vector<float> out(size_t(ref.logits.numel()));
    backend_->copy_to_host(out.data(), ref.logits);
    return out;
  }

  void clear_references() override {
    references_list_.clear();
    reference_logits_ = kl_out_ = Tensor();
    references_.reset();
  }

  std::vector<float> encode_images(const ImageBatch& images) override {
    Tensor out = vision_->encode(images.pixel_values, checked_grids(images));
    std::vector<float> host(size_t(out.numel()));
    backend_->copy_to_host(host.data(), out);
    return host;
  }

 private:
  void validate_tokens(const std::vector<int32_t>& tokens, const char* what) const {
    if (tokens.empty()) throw Error(ErrorCode::kInvalidArgument, std::string(what) + " is empty: at least one token is needed");
    if (int64_t(tokens.size()) > max_context_)
      throw Error(ErrorCode::kInvalidArgument, std::string(what) + " has " + std::to_string(tokens.size()) +
                                                   " tokens, more than the context limit of " + std::to_string(max_context_));
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] < 0 || tokens[i] >= config_.vocab_size)
        throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": token id " + std::to_string(tokens[i]) + " at index " +
                                                     std::to_string(i) + " is outside the vocabulary [0, " +
                                                     std::to_string(config_.vocab_size) + ")");
  }

  // The images' grids, after checking them against the vision config and the pixel data.
  std::vector<ImageGrid> checked_grids(const ImageBatch& images) const {
    if (!vision_) throw Error(ErrorCode::kInvalidArgument, "images given but this model has no vision encoder");
    const VisionConfig& v = config_.vision;
    if (images.grid_thw.empty()) throw Error(ErrorCode::kInvalidArgument, "images: grid_thw is empty");
    std::vector<ImageGrid> grids;
    int64_t patches = 0;
    for (size_t i = 0; i < images.grid_thw.size(); ++i) {
      const auto& g = images.grid_thw[i];
      if (g[0] <= 0 || g[1] <= 0 || g[2] <= 0 || g[1] % v.spatial_merge_size || g[2] % v.spatial_merge_size)
        throw Error(ErrorCode::kInvalidArgument, "image " + std::to_string(i) + ": grid (" + std::to_string(g[0]) + ", " +
                                                     std::to_string(g[1]) + ", " + std::to_string(g[2]) +
                                                     ") must be positive with h and w multiples of " +
                                                     std::to_string(v.spatial_merge_size));
      grids.push_back({g[0], g[1], g[2]});
      patches += g[0] * g[1] * g[2];
    }
    if (!images.pixel_values) throw Error(ErrorCode::kInvalidArgument, "images: pixel_values is null");
    if (images.pixel_count != patches * v.patch_dim())
      throw Error(ErrorCode::kInvalidArgument, "images: pixel_values holds " + std::to_string(images.pixel_count) +
                                                   " values but the grids need " + std::to_string(patches) + " patches x " +
                                                   std::to_string(v.patch_dim()));
    return grids;
  }

  // Runs `tokens` as a fresh sequence, `step` tokens per forward. With images, their encoder
  // output replaces the embeddings of the image-token runs and the rotary positions follow M-RoPE.
  // after_chunk(c0, T) sees each chunk's final hidden rows in ws_.normed. Returns the rotary
  // position offset of the tokens that follow (0 without images).
  // With `taps`, the chunks' hidden-state taps are left in taps->out for after_chunk.
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t step, const ImageBatch* images,
                  const std::function<void(int64_t, int64_t)>& after_chunk, const HiddenTaps* taps = nullptr) {
    std::vector<ImageGrid> grids;
    Tensor features;  // merged image features, one row per image token
    if (images) {
      grids = checked_grids(*images);
      features = vision_->encode(images->pixel_values, grids);
    }
    return prefill_encoded(tokens, step, grids, features, after_chunk, taps);
  }

  // prefill() of images already encoded: `features` for the images of `grids` (none: a text sequence).
  int64_t prefill_encoded(const std::vector<int32_t>& tokens, int64_t step, const std::vector<ImageGrid>& grids,
                          const Tensor& features, const std::function<void(int64_t, int64_t)>& after_chunk,
                          const HiddenTaps* taps = nullptr) {
    const int64_t n = int64_t(tokens.size());
    const bool images = !grids.empty();
    int64_t delta = 0;
    std::vector<int32_t> rope;  // [n, 3]
    if (images) {
      rope = mrope_positions(tokens, config_.image_token_id, grids, config_.vision.spatial_merge_size, &delta);
    } else {
      if (config_.has_vision && std::find(tokens.begin(), tokens.end(), config_.image_token_id) != tokens.end())
        throw Error(ErrorCode::kInvalidArgument, "the tokens hold image tokens (id " + std::to_string(config_.image_token_id) +
                                                     ") but no images were given");
      rope.resize(size_t(3 * n));
      for (int64_t i = 0; i < 3 * n; ++i) rope[i] = int32_t(i / 3);
    }
    model_->reset(state_);
    int64_t feature_row = 0;
    std::vector<int32_t> pos(static_cast<size_t>(step));
    for (int64_t c0 = 0; c0 < n; c0 += step) {
      const int64_t T = std::min(step, n - c0);
      for (int64_t i = 0; i < T; ++i) pos[i] = int32_t(c0 + i);
      backend_->copy_from_host(ids_.rows(0, T), tokens.data() + c0, DType::I32);
      backend_->copy_from_host(positions_.rows(0, T), pos.data(), DType::I32);
      backend_->copy_from_host(rope_positions_.rows(0, T), rope.data() + 3 * c0, DType::I32);
      model_->embed(ids_.rows(0, T), ws_);
      if (images) {
        for (int64_t i = 0; i < T;) {  // each run of image tokens in this chunk takes the next feature rows
          if (tokens[c0 + i] != config_.image_token_id) {
            ++i;
            continue;
          }
          int64_t len = 0;
          while (i + len < T && tokens[c0 + i + len] == config_.image_token_id) ++len;
          backend_->copy(ws_.residual.rows(i, len), features.rows(feature_row, len));
          feature_row += len;
          i += len;
        }
      }
      model_->forward_embedded(T, positions_.rows(0, T), rope_positions_.rows(0, T), state_, ws_, /*chunked_gdn=*/T > 1,
                               taps);
      if (after_chunk) after_chunk(c0, T);
    }
    return delta;
  }

  // Prefills `prompt` as a fresh sequence and samples its first token into token_ and pending_ with
  // `sampler` (its draw counter restarted). `speculative`: the prompt's taps fill the drafter's
  // context and the next verify step starts at the end of the prompt.
  void begin_sequence(const std::vector<int32_t>& prompt, const ImageBatch* images, const SamplerConfig& sampler,
                      bool speculative) {
    sampler_ = sampler;
    speculative_ = speculative;
    const int32_t zero = 0, n = int32_t(prompt.size());
    backend_->copy_from_host(step_, &zero, DType::I32);
    auto push_context = [&](int64_t, int64_t T) { spec_->push_context(T, positions_.rows(0, T)); };
    if (speculative) rope_delta_ = prefill(prompt, prefill_chunk_, images, push_context, &spec_->taps());
    else rope_delta_ = prefill(prompt, prefill_chunk_, images, nullptr);
    // The first new token comes from the prompt's last position; decode steps continue at sequence
    // index n, rotary position n + delta (delta < 0 after images, whose positions are compressed).
    sample_into_token(ws_.normed.rows((n - 1) % prefill_chunk_, 1));
    backend_->copy_to_host(&pending_, token_);
    prompt_tokens_ = n;
    if (speculative) spec_->begin(pending_, n, rope_delta_, sampler_, max_new_);
  }

  // A sequence kept by keep_reference(): its tokens, images (grids and encoder output) and the logits
  // of rows [begin, end).
  struct Reference {
    std::vector<int32_t> tokens;
    std::vector<ImageGrid> grids;
    Tensor features;
    int64_t begin = 0, end = 0;
    Tensor logits;
  };

  const Reference& reference(int64_t index) const {
    if (index < 0 || index >= int64_t(references_list_.size()))
      throw Error(ErrorCode::kInvalidArgument, "reference " + std::to_string(index) + " was not kept (" +
                                                   std::to_string(references_list_.size()) + " are)");
    return references_list_[size_t(index)];
  }

  int64_t reference_rows() const { return backend_->device() == DeviceKind::CPU ? kLogitRows : kReferenceRowsGpu; }

  // Calls f(first row, rows, their final hidden rows) for the reference's rows in a prefill chunk
  // [c0, c0 + T), reference_rows() at a time.
  template <class F>
  void for_reference_rows(const Reference& ref, int64_t c0, int64_t T, F&& f) {
    const int64_t lo = std::max(ref.begin, c0), hi = std::min(ref.end, c0 + T);
    for (int64_t r = lo; r < hi; r += reference_rows()) {
      const int64_t R = std::min(reference_rows(), hi - r);
      f(r, R, ws_.normed.rows(r - c0, R));
    }
  }

  void drop_graphs() {
    graph_ready_ = false;
    if (spec_) spec_->drop_graphs();
  }

  // logits of one hidden row -> token_ (on the device; nothing is read back here).
  void sample_into_token(const Tensor& hidden_row) {
    model_->logits(hidden_row, logits_.rows(0, 1));
    backend_->sample(logits_.rows(0, 1), sampler_, step_, token_);
  }

  // One decode step, driven entirely by device buffers: the last sampled token goes in, the next
  // one comes out in token_, the position advances. Nothing here differs between steps, so a
  // backend with graphs captures it once (per sampler setting) and replays it with one launch.
  void decode_ops() {
    model_->forward(token_, decode_position_, decode_rope_position_, state_, ws_, /*chunked_gdn=*/false);
    sample_into_token(ws_.normed.rows(0, 1));
    backend_->post_i32(token_, decode_position_);
    backend_->increment(decode_positions_, 1);
  }

  // Queues decode steps issued_ + 1 .. step.
  void issue_steps_through(int64_t step) {
    for (; issued_ < step; ++issued_) decode_step();
  }

  void decode_step() {
    if (!use_graphs_) return decode_ops();
    const bool same_sampler = graph_sampler_.temperature == sampler_.temperature && graph_sampler_.top_k == sampler_.top_k &&
                              graph_sampler_.top_p == sampler_.top_p && graph_sampler_.seed == sampler_.seed;
    if (!graph_ready_ || !same_sampler) {
      graph_ready_ = false;
      backend_->begin_capture();
      try {
        decode_ops();
      } catch (...) {  // the stream must leave capture mode; the partial graph is never replayed
        try {
          backend_->end_capture(kDecodeGraph);
        } catch (...) {
        }
        throw;
      }
      backend_->end_capture(kDecodeGraph);
      graph_ready_ = true;
      graph_sampler_ = sampler_;
    }
    backend_->replay(kDecodeGraph);
  }

  ModelConfig config_;
  std::unique_ptr<Backend> backend_;
  QuantConfig quant_;
  std::unique_ptr<Arena> weights_, state_arena_, work_;
  std::unique_ptr<Qwen35Model> model_;
  std::unique_ptr<Qwen35Vision> vision_;  // VLMs only
  LinearObserver* observer_ = nullptr;    // backend_, when it observes projections
  std::unique_ptr<Arena> edits_;          // weights set_linear_weight needed (a tied LM head's own copy)
  std::unique_ptr<Arena> references_;     // keep_reference()'s sequences, and reference_kl()'s buffers
  std::vector<Reference> references_list_;
  Tensor reference_logits_, kl_out_;
  SequenceState state_;
  Workspace ws_;
  Tensor ids_, positions_, rope_positions_, logits_;
  Tensor step_;             // I32 [1]: the sampler's draw counter
  Tensor token_;            // I32 [1]: the last sampled token, input of the next decode step
  Tensor decode_positions_;      // I32 [4]: the next two, one buffer so that one kernel advances both
  Tensor decode_position_;       // I32 [1]: sequence index (cache row) of the next decode step
  Tensor decode_rope_position_;  // I32 [1, 3]: its (t, h, w) rotary position
  bool use_graphs_ = false, graph_ready_ = false;
  SamplerConfig graph_sampler_;
  int64_t max_context_ = 0, prefill_chunk_ = 0;

  SamplerConfig sampler_;
  bool active_ = false;
  int32_t pending_ = 0;
  int64_t max_new_ = 0, prompt_tokens_ = 0;
  int64_t returned_ = 0, issued_ = 0;  // tokens of this generation returned; decode steps queued
  double prefill_seconds_ = 0;
  int64_t rope_delta_ = 0;  // rotary position - sequence index after the prompt

  std::unique_ptr<SpeculativeDecoder> spec_;  // with a drafter
  bool speculative_ = false;                  // the current sequence drafts and verifies
};

}  // namespace

std::unique_ptr<Engine> Engine::create(const std::string& model_dir, const EngineOptions& options) {
  return std::make_unique<EngineImpl>(model_dir, options);
}

GenerationResult Engine::generate(const std::vector<int32_t>& prompt, const SamplingParams& params,
                                  const std::function<bool(int32_t)>& on_token, const ImageBatch* images) {
  GenerationResult r;
  start(prompt, params, images);
  r.prompt_tokens = int64_t(prompt.size());
  r.prefill_seconds = last_prefill_seconds();
  r.finish_reason = "length";
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < params.max_new_tokens; ++i) {
    const int32_t tok = next_token();
    r.token_ids.push_back(tok);
    const bool stop = std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), tok) != params.stop_token_ids.end();
    if (on_token && !on_token(tok)) {
      r.finish_reason = "cancelled";
      break;
    }
    if (stop) {
      r.finish_reason = "stop";
      break;
    }
  }
  r.decode_seconds = seconds_since(t0);
  r.acceptance_lengths = acceptance_lengths();
  return r;
}

std::string version() { return OCRIA_RT_VERSION; }

bool built_with_cuda() {
#ifdef OCRIA_RT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace ocria_rt
