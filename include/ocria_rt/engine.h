// ocria_rt public C++ API: load a Qwen3.5 checkpoint directory and score or generate tokens.
//
//   auto engine = ocria_rt::Engine::create("/models/OCRia-1", {.device = "cuda"});
//   ocria_rt::SamplingParams sp;  sp.max_new_tokens = 64;
//   ocria_rt::GenerationResult r = engine->generate(prompt_ids, sp);
//
// Everything reports failures as ocria_rt::Error (see error.h). An Engine serves one sequence at a
// time; it is not thread-safe.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ocria_rt/config.h"
#include "ocria_rt/error.h"

namespace ocria_rt {

struct EngineOptions {
  std::string device = "cpu";   // "cpu" or "cuda" / "cuda:N"
  int64_t max_context = 0;      // tokens per sequence (prompt + generated); 0: min(model max, 32768)
  int64_t prefill_chunk = 0;    // tokens per prefill forward; 0: backend default
  int num_threads = 0;          // CPU backend threads; 0: all cores
  bool cuda_graphs = true;      // CUDA backend: replay the decode step as one captured graph
  int64_t max_image_patches = 16384;  // VLMs: vision-encoder patches per call (16384 = a 2048 x 2048 page)
  // Speculative decoding: a DFlash or DFlash2 drafter directory in z-lab's format (config.json with
  // dflash_config, model.safetensors) trained for this target; "" for none. The C++ engine loads only
  // the drafter named here; the Python Engine names a model directory's own drafter/ by default.
  std::string drafter;
  // Calibration (ocria_rt.quantize): the backend's ops pass through an observer that can collect
  // statistics of the decoder linears' inputs (Engine::observe_linear_inputs). Such an engine replays
  // no CUDA graphs; off (the default), nothing is in the way of the ops.
  bool linear_observer = false;
  // ---- for benchmarks only (both need a drafter) ----
  // tau > 0: every speculative step emits exactly tau tokens (at most the drafter's block size): the
  // first tau - 1 drafts as if the model had accepted them, then the model's own token after them.
  // NOT lossless: the output is no longer what the model generates; it times steps at a chosen
  // acceptance length (random drafters accept next to nothing). Applied on the device, inside the step.
  int64_t benchmark_forced_acceptance = 0;
  // Time each speculative step's phases (draft, verify, commit; EngineStats) with device events
  // between them: each phase is replayed as a graph of its own and the host waits for every step.
  bool benchmark_phase_timing = false;
};

// Images as the image processor emits them (ocria_rt.preprocess_image, or transformers'
// Qwen2VLImageProcessor): patches in spatial-merge-window order. The pixels are borrowed, not
// copied: they must stay valid during the call that the batch is passed to.
struct ImageBatch {
  const float* pixel_values = nullptr;           // row-major [sum of t*h*w, channels * temporal_patch * patch^2]
  int64_t pixel_count = 0;                       // floats at pixel_values
  std::vector<std::array<int64_t, 3>> grid_thw;  // per image: (t, h, w) in patches
};

struct SamplingParams {
  int64_t max_new_tokens = 64;
  float temperature = 0.0f;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
  std::vector<int32_t> stop_token_ids;  // generation stops after emitting one of these
  // With a drafter loaded: draft blocks and verify them (false: plain decoding for this call). Either
  // way the tokens follow the same distribution (greedy: the same tokens).
  bool speculative = true;
};

struct GenerationResult {
  std::vector<int32_t> token_ids;  // the new tokens (a stop token, if hit, is included)
  std::string finish_reason;       // "length", "stop" or "cancelled"
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;       // time for tokens after the first
  // Speculative decoding: the tokens each verify step contributed (accepted drafts + 1; the last
  // step's cut where a stop token or max_new_tokens ends the generation). Empty without it.
  std::vector<int64_t> acceptance_lengths;
  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0; }
  double decode_tokens_per_second() const {
    return decode_seconds > 0 && token_ids.size() > 1 ? (token_ids.size() - 1) / decode_seconds : 0;
  }
};

// One projection of the decoder as the model runs it, named as the checkpoint stores it: the modules
// fused into it (e.g. q_proj, k_proj, v_proj) read the same input.
struct LinearGroupInfo {
  std::vector<std::string> modules;  // checkpoint module names, without ".weight"
  std::vector<int64_t> rows;         // each module's output features
  int64_t in_features = 0;
  std::string format;                // "dense", "fp8" or "nvfp4"
};

// Statistics of the inputs x [tokens, K] of one projection over the observed tokens, as its checkpoint
// modules see them (times the (1 + w) of an RMSNorm that the engine folded into the weights).
struct LinearInputStats {
  // X^T X is kept for projections of at most this many inputs (K * K doubles each); wider ones get the
  // per-channel statistics only.
  static constexpr int64_t kMaxSecondMomentFeatures = 4096;
  int64_t tokens = 0;
  std::vector<float> abs_max;          // [K] max over tokens of |x[t, k]|
  std::vector<double> abs_mean;        // [K] mean of |x[t, k]|
  std::vector<double> square_mean;     // [K] mean of x[t, k]^2
  std::vector<double> second_moment;   // [K, K] row-major X^T X / tokens; empty unless asked for (and K <= the max)
};

struct EngineStats {
  std::string device;
  std::string backend_name;
  int64_t weight_bytes = 0;     // weights resident on the device
  // Of weight_bytes, those of quantized linears (their weights and scales) by format; the rest is
  // unquantized (embeddings, norms, the vision tower, layers the checkpoint keeps dense).
  int64_t weight_bytes_fp8 = 0;
  int64_t weight_bytes_nvfp4 = 0;
  std::string quantization;     // the checkpoint's quantization: "none", "modelopt" or "compressed-tensors"
  int64_t state_bytes = 0;      // KV cache + Gated DeltaNet state
  int64_t workspace_bytes = 0;
  int64_t launches_per_decode_step = 0;  // GPU launches the host issues per decode step (1 with graphs)
  int64_t kernels_per_decode_step = 0;   // kernels in one decode step
  int64_t draft_block_size = 0;          // the drafter's block B (0: no drafter)
  int64_t drafter_weight_bytes = 0;      // its weights (it shares the target's embedding and LM head)
  int64_t drafter_state_bytes = 0;       // its context K/V cache
  // Known once a speculative step has been captured (0 before): host launches per step (1; 3 with
  // benchmark_phase_timing) and the kernels they run.
  int64_t launches_per_speculative_step = 0;
  int64_t kernels_per_speculative_step = 0;
  // benchmark_phase_timing: the current or last generation's speculative steps timed, and their device
  // time by phase, summed: draft (the drafter's block, its logits, the proposals), verify (the
  // target's forward of the block, its logits, the acceptance), commit (the DeltaNet states, the
  // drafter's context, the post of the tokens and the advance to the next block).
  int64_t timed_speculative_steps = 0;
  double speculative_draft_seconds = 0;
  double speculative_verify_seconds = 0;
  double speculative_commit_seconds = 0;
};

// Called with each speculative step's proposals (the B - 1 drafted tokens) and the sequence index of
// the anchor before they are verified; it may replace them (tests force acceptance lengths this way).
// Replaced or not, while a hook is set every proposal counts as a deterministic draft (q one-hot).
using ProposalHook = std::function<void(int64_t anchor_position, std::vector<int32_t>& proposals)>;

class Engine {
 public:
  virtual ~Engine() = default;
  static std::unique_ptr<Engine> create(const std::string& model_dir, const EngineOptions& options = {});

  virtual const ModelConfig& config() const = 0;
  virtual int64_t max_context() const = 0;
  virtual EngineStats stats() const = 0;

  // Logits at every position of `token_ids`, row-major [n, vocab], fp32. Starts a fresh sequence.
  // The tokens go through the model `chunk` at a time (0: the prefill chunk; 1: token by token,
  // exactly as decoding does), so the prefill and decode paths can be checked against each other.
  // VLMs: `images` fill the runs of image tokens in order (one run of t*h*w/merge^2 tokens each).
  virtual std::vector<float> score(const std::vector<int32_t>& token_ids, int64_t chunk = 0,
                                   const ImageBatch* images = nullptr) = 0;

  // The hidden states at every position of `token_ids` (a fresh sequence; `images` as in score()) after
  // decoder layers `layers` (from 0; the last layer's after the final norm, as transformers numbers
  // hidden_states[id + 1]): row-major [n, layers.size() * hidden], layer layers[i] in columns
  // [i * hidden, (i + 1) * hidden), fp32 -- the "taps" a DFlash drafter reads, in its layout.
  virtual std::vector<float> hidden_states(const std::vector<int32_t>& token_ids, const std::vector<int64_t>& layers,
                                           const ImageBatch* images = nullptr) = 0;

  // Incremental generation: start() prefills a fresh sequence; each next_token() returns one new
  // token (the first comes from the prompt's logits). generate() is the loop over both.
  virtual void start(const std::vector<int32_t>& prompt, const SamplingParams& params,
                     const ImageBatch* images = nullptr) = 0;
  virtual int32_t next_token() = 0;
  virtual double last_prefill_seconds() const = 0;

  // Speculative decoding (a drafter loaded): the greedy proposals of the first step after `prompt`,
  // i.e. the B - 1 tokens drafted after the target's greedy first token. Starts a fresh sequence.
  virtual std::vector<int32_t> draft(const std::vector<int32_t>& prompt, const ImageBatch* images = nullptr) = 0;
  // The acceptance lengths of the current or last generation (see GenerationResult).
  virtual std::vector<int64_t> acceptance_lengths() const = 0;
  virtual void set_proposal_hook(ProposalHook hook) = 0;  // nullptr removes it

  // VLMs: the vision encoder's merged output for `images`, row-major [patches / merge^2, hidden].
  virtual std::vector<float> encode_images(const ImageBatch& images) = 0;

  // ---- calibration (quantization) ----
  // The decoder's projections, layer by layer, then the LM head.
  virtual std::vector<LinearGroupInfo> linear_groups() const = 0;
  // on: starts collecting LinearInputStats of every projection of linear_groups() over the tokens that
  // the following score() / generate() calls run, dropping earlier ones; second_moment adds X^T X
  // (LinearInputStats::kMaxSecondMomentFeatures). off: stops. Needs EngineOptions::linear_observer.
  virtual void observe_linear_inputs(bool on, bool second_moment = false) = 0;
  virtual std::vector<LinearInputStats> linear_input_stats() const = 0;  // in linear_groups() order
  // Replaces, in memory, the weight of the dense decoder module `module` (a name of linear_groups())
  // by `weight` [out, in] fp32 in the checkpoint's layout; an RMSNorm folded into it at load is
  // applied to it as to the original (e.g. a trial quantization, dequantized); `count` floats at
  // `weight`, read during the call. A tied LM head gets a weight of its own; the embeddings stay.
  // restore_linear_weights() puts every original back.
  virtual void set_linear_weight(const std::string& module, const float* weight, int64_t count) = 0;
  virtual void restore_linear_weights() = 0;
  // Reference distributions kept on the device, and the KL divergence from them: how much a change of
  // weights moves the model's next-token distributions, with only one number per row read back.
  // keep_reference() runs token_ids as a fresh sequence (as score(); `images` as there) and keeps the
  // logits of rows [begin, end) -- the predictions of tokens begin + 1 .. end -- with the tokens and
  // the images' encoder output; given `logits` (row-major [end - begin, vocab], e.g. another engine's
  // reference_logits()) it keeps those instead and runs only the vision encoder. Returns its index.
  virtual int64_t keep_reference(const std::vector<int32_t>& token_ids, int64_t begin, int64_t end,
                                 const ImageBatch* images = nullptr, const float* logits = nullptr) = 0;
  // Runs reference `index`'s tokens again with the weights as they are now (its image features as
  // kept) and returns, per kept row, KL(reference || model) in nats.
  virtual std::vector<double> reference_kl(int64_t index) = 0;
  virtual std::vector<float> reference_logits(int64_t index) const = 0;  // [rows, vocab] fp32
  virtual void clear_references() = 0;

  // on_token returns false to stop early (finish_reason "cancelled").
  GenerationResult generate(const std::vector<int32_t>& prompt, const SamplingParams& params,
                            const std::function<bool(int32_t)>& on_token = nullptr, const ImageBatch* images = nullptr);
};

// Library version and build facts.
std::string version();
bool built_with_cuda();
// Number of usable CUDA devices (0 when built without CUDA or none is visible).
int cuda_device_count();

}  // namespace ocria_rt
