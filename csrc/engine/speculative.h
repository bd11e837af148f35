// Speculative decoding of the engine's sequence with a DFlash / DFlash2 drafter: the drafter and its
// context, the block buffers, and the speculative step.
//
// A step is a fixed sequence of ops on device buffers: draft a block after the anchor, verify it with
// one target forward of B tokens, accept, commit the accepted prefix to the target's DeltaNet states
// and the drafter's context, post the emitted tokens (count + tokens, tagged with the step's index)
// to the backend's mailbox, and advance the block's positions and anchor by the count
// (Backend::speculative_advance). Nothing in it comes from the host, so a backend with graphs
// captures it once per sampler setting and replays it with one launch per step; the host reads each
// step's tokens from the mailbox, and on a backend that queues work it issues step k + 1 before it
// waits for step k. With a proposal hook (which needs the host between draft and verify) every step
// runs op by op and the host waits for each.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/dflash.h"
#include "model/qwen35.h"
#include "ocria_rt/engine.h"
#include "ops/ops.h"

namespace ocria_rt {

// The graph slots of the engine's steps (Backend::end_capture).
enum GraphSlot : int {
  kDecodeGraph = 0,
  kSpeculativeGraph = 1,  // the whole speculative step
  kDraftGraph = 1,        // benchmark_phase_timing: the step's three phases, each a graph of its own
  kVerifyGraph = 2,
  kCommitGraph = 3,
};
static_assert(kCommitGraph < Backend::kGraphSlots, "the backend keeps too few graphs");

// Device time of speculative steps by phase (EngineOptions::benchmark_phase_timing).
struct PhaseTimes {
  int64_t steps = 0;
  double draft = 0, verify = 0, commit = 0;  // seconds, summed over the steps
};

class SpeculativeDecoder {
 public:
  // Loads the drafter `dir` (config `dc`) for `model`, whose sequence state and workspace the engine
  // owns (they must outlive this object); `step` is the engine's sampler draw counter. Caches hold
  // `max_context` + 2 B rows (see issue_step). `prefill_chunk`: the most tokens push_context takes.
  SpeculativeDecoder(const DraftConfig& dc, const std::string& dir, Backend& backend, const Qwen35Model& model,
                     SequenceState& state, Workspace& ws, const Tensor& step, Arena& work, int64_t max_context,
                     int64_t prefill_chunk, const EngineOptions& options);

  static int64_t cache_rows(int64_t max_context, int64_t block) { return max_context + 2 * block; }

  const DFlashDrafter& drafter() const { return *drafter_; }
  int64_t weight_bytes() const { return int64_t(weights_->bytes_used()); }
  int64_t state_bytes() const { return int64_t(state_arena_->bytes_used()); }
  // Where the target's prefill leaves the taps of its chunks (Qwen35Model::forward_embedded).
  const HiddenTaps& taps() const { return taps_; }
  // Appends the T tokens of the last prefill chunk, at `positions` (I32 [T]), to the drafter's context.
  void push_context(int64_t T, const Tensor& positions);

  // Starts a generation after its prompt's prefill: `anchor` (the first new token) at sequence index
  // `position`, rotary positions `rope_delta` ahead of sequence indices, up to `max_new` tokens.
  void begin(int32_t anchor, int64_t position, int64_t rope_delta, const SamplerConfig& sampler, int64_t max_new);
  // The greedy proposals of the first block after begin() (Engine::draft).
  std::vector<int32_t> draft();
  // Issues the first step when the host can run ahead of the device (begin() has just run).
  void issue_ahead();
  // Token k >= 1 of the generation (tokens 1 .. k - 1 have been returned).
  int32_t next_token(int64_t k);
  // Tokens returned per verify step so far.
  const std::vector<int64_t>& acceptance_lengths() const { return acceptance_; }

  void set_proposal_hook(ProposalHook hook) { hook_ = std::move(hook); }
  // Captured steps may hold weights that have since changed.
  void drop_graphs() { ready_.assign(ready_.size(), false); }
  // Kernels and launches of a captured step (0 before the first capture).
  int64_t kernels_per_step() const;
  int64_t launches_per_step() const;
  const PhaseTimes& phase_times() const { return times_; }

 private:
  // The step's three phases as ops on device buffers.
  void draft_ops(float temperature, uint64_t seed, bool use_hook);
  void verify_ops();
  void commit_ops();
  void issue_step();
  // `ops` into the graph of `slot` (captured first where needed) and replayed, or run as they are.
  template <class Ops> void run_phase(int slot, bool graphs, Ops&& ops);
  void receive_step(int64_t k);

  Backend& be_;
  const Qwen35Model& model_;
  SequenceState& state_;
  Workspace& ws_;
  Tensor step_;  // the engine's sampler draw counter
  std::unique_ptr<Arena> weights_, state_arena_;
  std::unique_ptr<DFlashDrafter> drafter_;
  DraftState draft_state_;
  DraftWorkspace draft_ws_;
  HiddenTaps taps_;                  // the target's taps of up to max(prefill chunk, B) tokens
  std::vector<GdnReplay> replay_;    // per target layer: the last verify's DeltaNet records
  Tensor draft_ids_;                 // I32 [B]: the anchor, then the mask token
  Tensor verify_ids_;                // I32 [B]: the anchor, then the proposals
  Tensor block_positions_;           // I32 [B]: the block's sequence indices
  Tensor block_rope_;                // I32 [B, 3]: its rotary positions in the target
  Tensor draft_logits_;              // [B-1, V]
  Tensor verify_logits_;             // [B, V]
  Tensor selector_h_;                // DFlash2: [B-1, rank]
  Tensor cand_, cand_prob_;          // the draft distribution: I32 / F32 [B-1, candidates]
  Tensor result_;                    // I32 [1 + B]: what a step posts, the count then the emitted tokens
  Tensor accept_count_, accepted_;   // its rows: I32 [1] how many, I32 [B] the emitted tokens
  Tensor step_index_;                // I32 [1]: the index of the next step, which tags its post
  Tensor draft_step_;                // I32 [1]: the counter of the drafter's argmax (draws nothing)
  Tensor forced_count_;              // I32 [1]: benchmark_forced_acceptance
  int64_t forced_ = 0;               // EngineOptions::benchmark_forced_acceptance
  bool timing_ = false;              // EngineOptions::benchmark_phase_timing
  bool graphs_ = false;              // the backend replays captured steps
  std::vector<bool> ready_;          // per graph slot: captured with graph_sampler_
  SamplerConfig graph_sampler_;
  ProposalHook hook_;

  // The generation
  SamplerConfig sampler_;
  int64_t max_new_ = 0;
  int64_t issued_ = 0, received_ = 0;  // steps queued; steps whose tokens the host has read
  int64_t position_ = 0;             // sequence index of the anchor of step received_
  std::vector<int32_t> emitted_;     // the last received step's tokens
  size_t next_ = 0;                  // the next of them to return
  std::vector<int64_t> acceptance_;  // tokens returned per verify step
  PhaseTimes times_;
};

}  // namespace ocria_rt
