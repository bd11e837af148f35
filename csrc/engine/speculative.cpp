#include "engine/speculative.h"

#include <algorithm>

#include "core/safetensors.h"
#include "ops/sampling_rng.h"

namespace ocria_rt {

namespace {
// The drafter's own draws (DFlash2's walk at temperature > 0) use a seed of their own, so that they
// are independent of the acceptance tests that use the sampler's seed with the same counters.
uint64_t draft_seed(uint64_t seed) { return splitmix64(seed ^ 0x6472616674ull); }

bool same_sampler(const SamplerConfig& a, const SamplerConfig& b) {
  return a.temperature == b.temperature && a.top_k == b.top_k && a.top_p == b.top_p && a.seed == b.seed;
}
}  // namespace

SpeculativeDecoder::SpeculativeDecoder(const DraftConfig& dc, const std::string& dir, Backend& backend,
                                       const Qwen35Model& model, SequenceState& state, Workspace& ws, const Tensor& step,
                                       Arena& work, int64_t max_context, int64_t prefill_chunk,
                                       const EngineOptions& options)
    : be_(backend), model_(model), state_(state), ws_(ws), step_(step) {
  const int64_t B = dc.block_size, V = model.config().vocab_size, H = model.config().hidden_size;
  const int64_t candidates = dc.dflash2 ? dc.selector_top_k : 1;
  if (B + 1 > Backend::kMaxPostValues)
    throw Error(ErrorCode::kModelError, dc.path + ": dflash_config.block_size is " + std::to_string(B) +
                                            "; blocks of at most " + std::to_string(Backend::kMaxPostValues - 1) +
                                            " tokens are supported");
  if (options.benchmark_forced_acceptance < 0 || options.benchmark_forced_acceptance > B)
    throw Error(ErrorCode::kInvalidArgument, "benchmark_forced_acceptance must be in 0 .. the drafter's block size (" +
                                                 std::to_string(B) + "), got " +
                                                 std::to_string(options.benchmark_forced_acceptance));
  forced_ = options.benchmark_forced_acceptance;
  timing_ = options.benchmark_phase_timing;
  graphs_ = options.cuda_graphs && be_.supports_graphs();
  ready_.assign(Backend::kGraphSlots, false);

  weights_ = std::make_unique<Arena>(be_);
  state_arena_ = std::make_unique<Arena>(be_);
  {
    Checkpoint ck = Checkpoint::open(dir);
    drafter_ = std::make_unique<DFlashDrafter>(dc, ck, be_, *weights_);
  }
  draft_state_ = drafter_->make_state(*state_arena_, cache_rows(max_context, B));
  draft_ws_ = drafter_->make_workspace(work, std::max(prefill_chunk, B));
  replay_ = model.make_replay(work, B);
  taps_.layers = dc.target_layer_ids;
  taps_.out = work.alloc(be_.activation_dtype(), {std::max(prefill_chunk, B), int64_t(taps_.layers.size()) * H});
  draft_ids_ = work.alloc(DType::I32, {B});
  verify_ids_ = work.alloc(DType::I32, {B});
  block_positions_ = work.alloc(DType::I32, {B});
  block_rope_ = work.alloc(DType::I32, {B, 3});
  draft_logits_ = work.alloc(be_.activation_dtype(), {B - 1, V});
  verify_logits_ = work.alloc(be_.activation_dtype(), {B, V});
  if (dc.dflash2) selector_h_ = work.alloc(be_.activation_dtype(), {B - 1, dc.selector_rank});
  cand_ = work.alloc(DType::I32, {B - 1, candidates});
  cand_prob_ = work.alloc(DType::F32, {B - 1, candidates});
  result_ = work.alloc(DType::I32, {1 + B});
  accept_count_ = result_.rows(0, 1);
  accepted_ = result_.rows(1, B);
  step_index_ = work.alloc(DType::I32, {1});
  draft_step_ = work.alloc(DType::I32, {1});
  forced_count_ = work.alloc(DType::I32, {1});
  const int32_t forced = int32_t(forced_);
  be_.copy_from_host(forced_count_, &forced, DType::I32);
  const std::vector<int32_t> masks(size_t(B), dc.mask_token_id);
  be_.copy_from_host(draft_ids_, masks.data(), DType::I32);
  // DFlash drafts greedily at every temperature: q is one-hot on each proposal.
  if (!dc.dflash2) {
    const std::vector<float> ones(size_t(B - 1), 1.0f);
    be_.copy_from_host(cand_prob_, ones.data(), DType::F32);
  }
}

void SpeculativeDecoder::push_context(int64_t T, const Tensor& positions) {
  drafter_->push_context(taps_.out.rows(0, T), positions, draft_state_, draft_ws_);
}

void SpeculativeDecoder::begin(int32_t anchor, int64_t position, int64_t rope_delta, const SamplerConfig& sampler,
                               int64_t max_new) {
  const int64_t B = drafter_->config().block_size;
  std::vector<int32_t> pos(static_cast<size_t>(B)), rope(static_cast<size_t>(3 * B));
  for (int64_t i = 0; i < B; ++i) {
    pos[i] = int32_t(position + i);
    for (int a = 0; a < 3; ++a) rope[3 * i + a] = int32_t(position + i + rope_delta);
  }
  const int32_t zero = 0;
  be_.copy_from_host(block_positions_, pos.data(), DType::I32);
  be_.copy_from_host(block_rope_, rope.data(), DType::I32);
  be_.copy_from_host(draft_ids_.rows(0, 1), &anchor, DType::I32);
  be_.copy_from_host(verify_ids_.rows(0, 1), &anchor, DType::I32);
  be_.copy_from_host(step_index_, &zero, DType::I32);
  be_.copy_from_host(draft_step_, &zero, DType::I32);
  sampler_ = sampler;
  max_new_ = max_new;
  issued_ = received_ = 0;
  position_ = position;
  emitted_.clear();
  next_ = 0;
  acceptance_.clear();
  times_ = PhaseTimes{};
}

std::vector<int32_t> SpeculativeDecoder::draft() {
  draft_ops(0.0f, 0, /*use_hook=*/false);
  std::vector<int32_t> proposals(size_t(drafter_->config().block_size - 1));
  be_.copy_to_host(proposals.data(), verify_ids_.rows(1, int64_t(proposals.size())));
  return proposals;
}

// The drafter's proposals for the block [anchor, mask x (B-1)] at block_positions_ into
// verify_ids_[1:B], with their draft distribution in cand_ / cand_prob_. Rows 1.. of draft_ids_ hold
// the mask token throughout.
void SpeculativeDecoder::draft_ops(float temperature, uint64_t seed, bool use_hook) {
  const DraftConfig& dc = drafter_->config();
  const int64_t B = dc.block_size;
  drafter_->forward_block(draft_ids_, block_positions_, model_.embedding_table(), draft_state_, draft_ws_);
  const Tensor hidden = draft_ws_.hidden.rows(1, B - 1), proposals = verify_ids_.rows(1, B - 1);
  model_.logits(hidden, draft_logits_);
  if (dc.output_multiplier != 1.0f || dc.final_logit_softcapping > 0)
    be_.scale_softcap(draft_logits_, dc.output_multiplier, dc.final_logit_softcapping);
  if (dc.dflash2) {
    drafter_->selector_projection(hidden, selector_h_);
    be_.selector_walk(draft_logits_, selector_h_, drafter_->predecessor_codebook(), drafter_->successor_codebook(),
                      draft_ids_.rows(0, 1), temperature, draft_seed(seed), step_, proposals, cand_, cand_prob_);
  } else {
    be_.sample(draft_logits_, SamplerConfig{}, draft_step_, proposals);
  }
  if (use_hook && hook_) {
    std::vector<int32_t> host(size_t(B - 1));
    be_.copy_to_host(host.data(), proposals);
    hook_(position_, host);
    if (int64_t(host.size()) != B - 1)
      throw Error(ErrorCode::kInvalidArgument, "the proposal hook returned " + std::to_string(host.size()) +
                                                   " proposals; the block needs " + std::to_string(B - 1));
    const int64_t V = model_.config().vocab_size;
    for (size_t i = 0; i < host.size(); ++i)
      if (host[i] < 0 || host[i] >= V)
        throw Error(ErrorCode::kInvalidArgument, "the proposal hook's proposals: token id " + std::to_string(host[i]) +
                                                     " at index " + std::to_string(i) + " is outside the vocabulary [0, " +
                                                     std::to_string(V) + ")");
    be_.copy_from_host(proposals, host.data(), DType::I32);
    if (dc.dflash2) {  // one-hot q on the hook's tokens
      const int64_t K = cand_.dim(1);
      std::vector<int32_t> cand(size_t((B - 1) * K), -1);
      std::vector<float> prob(size_t((B - 1) * K), 0.0f);
      for (int64_t t = 0; t < B - 1; ++t) {
        cand[t * K] = host[t];
        prob[t * K] = 1.0f;
      }
      be_.copy_from_host(cand_, cand.data(), DType::I32);
      be_.copy_from_host(cand_prob_, prob.data(), DType::F32);
    }
  }
  if (!dc.dflash2) be_.copy(cand_, proposals.view({B - 1, 1}));
}

// The target's verification of [anchor, proposals] and the acceptance: result_ = count, tokens.
void SpeculativeDecoder::verify_ops() {
  const int64_t B = drafter_->config().block_size;
  model_.verify(verify_ids_, block_positions_, block_rope_, state_, ws_, replay_, &taps_);
  model_.logits(ws_.normed.rows(0, B), verify_logits_);
  be_.speculative_accept(verify_logits_, verify_ids_.rows(1, B - 1), cand_, cand_prob_, sampler_, step_, accepted_,
                         accept_count_);
  if (forced_ > 0) {
    // Benchmarks: the first forced_ - 1 drafts as if accepted, then the target's token after them
    // (what the acceptance would emit had exactly those drafts matched).
    if (forced_ > 1) be_.copy(accepted_.rows(0, forced_ - 1), verify_ids_.rows(1, forced_ - 1));
    be_.sample(verify_logits_.rows(forced_ - 1, 1), sampler_, step_, accepted_.rows(forced_ - 1, 1));
    be_.copy(accept_count_, forced_count_);
  }
}

// The accepted prefix into the target's DeltaNet states and the drafter's context, the step's
// tokens to the mailbox, the next block's positions and anchor.
void SpeculativeDecoder::commit_ops() {
  const int64_t B = drafter_->config().block_size;
  model_.commit(state_, replay_, accept_count_);
  // Every row's context goes in; rows past the accepted prefix are rewritten by the next block.
  drafter_->push_context(taps_.out.rows(0, B), block_positions_, draft_state_, draft_ws_);
  be_.post_i32(result_, step_index_);
  be_.speculative_advance(accept_count_, accepted_, block_positions_, block_rope_, draft_ids_, verify_ids_, step_index_);
}

template <class Ops> void SpeculativeDecoder::run_phase(int slot, bool graphs, Ops&& ops) {
  if (!graphs) return ops();
  if (!ready_[size_t(slot)]) {
    be_.begin_capture();
    try {
      ops();
    } catch (...) {  // the stream must leave capture mode; the partial graph is never replayed
      try {
        be_.end_capture(slot);
      } catch (...) {
      }
      throw;
    }
    be_.end_capture(slot);
    ready_[size_t(slot)] = true;
  }
  be_.replay(slot);
}

// Queues step issued_. A step that the host issues ahead may end up past the generation's last
// token (the generation stops inside the step before it): its block then starts up to B - 1 rows
// after the last needed one and writes B rows from there, which the caches' 2 B spare rows hold.
void SpeculativeDecoder::issue_step() {
  const bool graphs = graphs_ && !hook_;
  if (graphs && !same_sampler(graph_sampler_, sampler_)) {
    drop_graphs();
    graph_sampler_ = sampler_;
  }
  const float temperature = sampler_.temperature;
  const uint64_t seed = sampler_.seed;
  auto draft = [&] { draft_ops(temperature, seed, /*use_hook=*/true); };
  auto verify = [&] { verify_ops(); };
  auto commit = [&] { commit_ops(); };
  if (!timing_) {
    run_phase(kSpeculativeGraph, graphs, [&] {
      draft();
      verify();
      commit();
    });
  } else {
    be_.mark_time(0);
    run_phase(kDraftGraph, graphs, draft);
    be_.mark_time(1);
    run_phase(kVerifyGraph, graphs, verify);
    be_.mark_time(2);
    run_phase(kCommitGraph, graphs, commit);
    be_.mark_time(3);
  }
  ++issued_;
}

void SpeculativeDecoder::issue_ahead() {
  if (be_.queues_work() && !hook_ && !timing_ && max_new_ > 1 && issued_ == 0) issue_step();
}

void SpeculativeDecoder::receive_step(int64_t k) {
  if (issued_ == received_) issue_step();
  // Step received_ emits at least token k; the next step is needed unless token k is the last one.
  // The host issues it before waiting, so that the device never idles on the host between steps.
  if (be_.queues_work() && !hook_ && !timing_ && issued_ == received_ + 1 && k + 1 < max_new_) issue_step();
  const std::vector<int32_t> posted = be_.wait_post_i32s(int32_t(received_));
  const int64_t B = drafter_->config().block_size;
  const int32_t count = posted.at(0);
  if (count < 1 || count > B || int64_t(posted.size()) != 1 + B)
    throw Error(ErrorCode::kInternal, "speculative step " + std::to_string(received_) + " posted " +
                                          std::to_string(posted.size()) + " values with count " + std::to_string(count));
  emitted_.assign(posted.begin() + 1, posted.begin() + 1 + count);
  next_ = 0;
  ++received_;
  position_ += count;
  acceptance_.push_back(0);
  if (timing_) {
    times_.draft += be_.seconds_between_marks(0, 1);
    times_.verify += be_.seconds_between_marks(1, 2);
    times_.commit += be_.seconds_between_marks(2, 3);
    ++times_.steps;
  }
}

int32_t SpeculativeDecoder::next_token(int64_t k) {
  if (next_ == emitted_.size()) receive_step(k);
  ++acceptance_.back();
  return emitted_[next_++];
}

int64_t SpeculativeDecoder::kernels_per_step() const {
  if (!timing_) return ready_[kSpeculativeGraph] ? be_.graph_kernels(kSpeculativeGraph) : 0;
  if (!(ready_[kDraftGraph] && ready_[kVerifyGraph] && ready_[kCommitGraph])) return 0;
  return be_.graph_kernels(kDraftGraph) + be_.graph_kernels(kVerifyGraph) + be_.graph_kernels(kCommitGraph);
}

int64_t SpeculativeDecoder::launches_per_step() const {
  if (kernels_per_step() == 0) return 0;
  return timing_ ? 3 : 1;
}

}  // namespace ocria_rt
