// The op interface: every computation of the model goes through a Backend. The CPU backend
// (ops/cpu/) is the readable fp32 reference; the CUDA backend (ops/cuda/) is the fast one. An op's
// CPU and CUDA implementations live in files of the same name (e.g. cpu/gdn.cpp, cuda/gdn.cu).
//
// Conventions
// - Tensors are views (core/tensor.h). Dimension 0 is the token dimension T and may be strided, so a
//   column range of a fused projection can be passed without a copy.
// - Activations (residual stream, projections, KV cache) have the backend's activation_dtype()
//   (F32 on the CPU, BF16 on CUDA); norms, softmax and recurrences compute in fp32. Gated DeltaNet
//   recurrent and conv states are F32 on every backend.
// - Ops are asynchronous on the backend's stream; only copy_to_host and synchronize wait.
// - Nothing that changes between decode steps is passed by value: positions and the sampler's step
//   counter are device tensors, so a captured CUDA graph can replay a decode step unchanged.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ocria_rt {

// The GLU layout of a fused [gate; up] projection: its rows (its output columns) alternate between
// kGluGroup rows of gate and the same kGluGroup rows of up, so that a 16-row tile of the weight
// yields both halves of 8 activations (the CUDA skinny GEMM applies silu(gate) * up as it stores).
constexpr int64_t kGluGroup = 8;

// A linear layer's weight in its storage format, chosen per linear. Quantized formats are weight-only:
// x stays in the activation dtype and the weight is dequantized (on the CPU to fp32, on CUDA in
// registers to BF16) before the product:
//   kDense   W[n, k] = weight[n, k]                                     weight [N, K] backend weight dtype
//   kFp8     W[n, k] = e4m3(weight[n, k]) * row_scale[n]                weight [N, K] F8E4M3
//   kNvfp4   W[n, k] = e2m1(q[n, k]) * e4m3(block_scale[n, k / 16]) * row_scale[n]
//            weight [N, K / 2] U8: element 2j in the low nibble of byte j, 2j + 1 in the high one;
//            e2m1 code: bit 3 sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}; block_scale [N, K / 16] F8E4M3.
// row_scale [N] F32 holds the fp32 tensor scale per output row: FP8's per-tensor or per-channel
// weight_scale, NVFP4's global scale (weight_scale_2); a fused projection whose parts were quantized
// separately keeps each part's scale on its rows. input_scale [K] F32 (optional, quantized formats
// only) multiplies x column-wise before the product: the AWQ pre_quant_scale times the (1 + w) of an
// RMSNorm that cannot be folded into quantized weights:  out = (x * input_scale) · W^T (+ bias).
struct LinearWeight {
  enum class Format { kDense, kFp8, kNvfp4 };
  static constexpr int64_t kNvfp4Block = 16;
  Format format = Format::kDense;
  Tensor weight;       // see above
  Tensor block_scale;  // kNvfp4: [N, K / 16] F8E4M3
  Tensor row_scale;    // kFp8, kNvfp4: [N] F32
  Tensor input_scale;  // optional [K] F32
  Tensor bias;         // optional [N] F32

  bool quantized() const { return format != Format::kDense; }
  int64_t out_features() const { return weight.dim(0); }
  int64_t in_features() const { return format == Format::kNvfp4 ? 2 * weight.dim(1) : weight.dim(1); }
};

struct AttentionParams {
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // leading dims of each head that RoPE rotates, pairs (i, i + rotary_dim/2)
  float rope_theta = 0;
  // Interleaved M-RoPE: frequency j (of rotary_dim/2) turns by the h position if j % 3 == 1 and
  // j < 3 * mrope_section[1], by the w position if j % 3 == 2 and j < 3 * mrope_section[2], else
  // by the t position. {0, 0, 0}: every frequency uses t (plain RoPE).
  int32_t mrope_section[3] = {0, 0, 0};
  float norm_eps = 0;      // q_norm / k_norm epsilon
  float scale = 0;         // softmax scale, head_dim^-0.5
};

struct GdnParams {
  int64_t num_k_heads = 0;  // HK
  int64_t num_v_heads = 0;  // HV; value head h reads key head h / (HV / HK)
  int64_t k_head_dim = 0;   // dk
  int64_t v_head_dim = 0;   // dv
  int64_t conv_kernel = 0;  // causal conv width (4)
  float norm_eps = 0;       // output RMSNorm epsilon

  int64_t conv_dim() const { return 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim; }
};

// What gdn_verify records per token of a block of up to B tokens for gdn_commit (ReplaySSM): enough
// to advance the committed states past any accepted prefix without the per-position state snapshots.
struct GdnReplay {
  Tensor conv_in;  // [B, C] the conv inputs (the qkv columns of in_proj), activation dtype
  Tensor k;        // [B, HK*dk] F32 the L2-normalised keys
  Tensor g;        // [B, HV] F32 the log decays
  Tensor u;        // [B, HV*dv] F32 the corrected updates beta (v - S^T k), S the decayed state before the token
};

// Which cache rows a drafter query sees (draft_attention).
struct DraftMask {
  bool causal = false;  // false: the block attends bidirectionally
  int64_t window = 0;   // sliding window in positions; 0: none
};

struct SamplerConfig {
  float temperature = 0;  // <= 0: greedy (argmax, lowest index on ties)
  int32_t top_k = 0;      // 0: all
  float top_p = 1;        // 1: all
  uint64_t seed = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual DeviceKind device() const = 0;
  virtual DType activation_dtype() const = 0;
  virtual DType weight_dtype() const = 0;

  // Throws Error(kModelError) naming the dimension if this backend's kernels cannot run a model
  // of these shapes (checked when the model loads, not at its first forward).
  virtual void check_model_shapes(const AttentionParams& attention, const GdnParams& gdn) const {}

  // ---- memory (used at start-up by Arena; never per step) ----
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* ptr) = 0;
  // dst <- host data of src_dtype (F32/BF16/F16/I32), converted to dst.dtype; dst may be strided.
  // U8 and F8E4M3 destinations (quantized weights) take data of their own dtype, copied as raw bytes.
  virtual void copy_from_host(const Tensor& dst, const void* src, DType src_dtype) = 0;
  // host fp32 (or int32 for I32 tensors) <- src; waits for the copy.
  virtual void copy_to_host(void* dst, const Tensor& src) = 0;
  virtual void fill_zero(const Tensor& t) = 0;
  virtual void synchronize() = 0;

  // ---- reading sampled tokens without a copy between steps: post_i32(values, tag) queues a write of
  // the I32 vector values (n <= kMaxPostValues elements, contiguous), stamped with the I32 scalar tag
  // >= 0 (both on the device), into slot tag % kMailboxSlots of a host mailbox; it may be captured
  // into a graph, so a decode step reports its token (a speculative step its count and tokens) itself.
  // wait_post_i32s(tag) waits for that write and returns the values (wait_post_i32 the first); a tag
  // that is not in the mailbox once the queue has drained (never posted, or overwritten) is an error,
  // not a hang. At most kMailboxSlots posts may be waited for at once. clear_posts() drains the queue
  // and empties the mailbox, so that tags (a generation's positions) may repeat. A synchronous backend
  // (queues_work() false) copies at once. ----
  static constexpr int kMailboxSlots = 8;
  static constexpr int kMaxPostValues = 64;
  virtual bool queues_work() const { return false; }
  virtual void post_i32(const Tensor& values, const Tensor& tag) {
    check_post(values, tag);
    Post p;
    p.count = int32_t(values.numel());
    copy_to_host(p.values, values);
    copy_to_host(&p.tag, tag);
    if (p.tag >= 0) mailbox_[p.tag % kMailboxSlots] = p;
  }
  virtual std::vector<int32_t> wait_post_i32s(int32_t tag) {
    const Post& p = mailbox_[unsigned(tag) % kMailboxSlots];
    if (tag < 0 || p.tag != tag) throw missing_post(tag);
    return std::vector<int32_t>(p.values, p.values + p.count);
  }
  int32_t wait_post_i32(int32_t tag) { return wait_post_i32s(tag).at(0); }
  virtual void clear_posts() {
    for (Post& p : mailbox_) p = Post{};
  }

  // ---- the ops of the Qwen3.5 text decoder ----

  // out[t, :] = table[ids[t], :]. ids I32 [T] (already validated against the vocabulary).
  virtual void embedding(const Tensor& table, const Tensor& ids, const Tensor& out) = 0;

  // out[T, N] = x[T, K] · W[N, K]^T (+ bias).
  virtual void linear(const Tensor& x, const LinearWeight& w, const Tensor& out) = 0;

  // Zero-centred RMSNorm over the last dimension: out = x * rsqrt(mean(x^2) + eps) * (1 + w).
  // x, out [R, D] (or any shape whose last dim is D, contiguous except dimension 0). An undefined
  // weight is the unit scale, out = x * rsqrt(mean(x^2) + eps) (a norm whose weight has been folded
  // into the linear after it, fold_norm_weight).
  virtual void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, float eps) = 0;

  // residual += delta.
  virtual void add(const Tensor& residual, const Tensor& delta) = 0;

  // out [T, I] = silu(gate) * up, gate_up [T, 2I] in the GLU layout (kGluGroup): columns
  // [2G j, 2G j + G) hold gate[:, G j .. G j + G) and the next G columns the same columns of up.
  virtual void silu_mul(const Tensor& gate_up, const Tensor& out) = 0;

  // act [T, I] = silu(gate) * up with [gate | up] = x · W^T, W [2I, K] holding the rows of the gate
  // and up projections in the GLU layout (WeightLoader::glu_linear): the MLP's first half. `scratch`
  // [T, 2I] holds x · W^T where it is formed in memory first (this default, the CPU's; CUDA above 16
  // tokens); the CUDA decode path applies the activation as it stores and leaves `scratch` untouched.
  virtual void linear_glu(const Tensor& x, const LinearWeight& w, const Tensor& scratch, const Tensor& act) {
    linear(x, w, scratch);
    silu_mul(scratch, act);
  }

  // ---- a residual block's ends: the decoder's RMSNorms are folded into the projections after them,
  // so a norm and its linear, and a projection and its residual add, can each run as one pass ----

  // W[:, k] *= 1 + norm_weight[k], rounded to W's dtype: the zero-centred RMSNorm weight (F32 [K])
  // moved into the columns of the linear W [N, K] that reads the norm's output, once, at load time.
  // Then rms_norm(x, w) · W^T = rms_norm(x, unit) · W'^T (up to that rounding). Dense weights only:
  // the loader puts (1 + w) into a quantized weight's input_scale instead (WeightLoader::projection).
  virtual void fold_norm_weight(const Tensor& w, const Tensor& norm_weight) = 0;

  // A quantized weight's storage as this backend's linear ops read it: called once, after its tensors
  // hold LinearWeight's layout and before any op reads them. The CUDA backend moves the bits of each
  // NVFP4 word (8 elements) to where its decode GEMM unpacks them with fewest instructions (linear.cu,
  // "NVFP4 device layout"). The CPU reads the checkpoint's layout: nothing to do.
  virtual void prepare_quantized_weight(const LinearWeight& w) {}

  // out [T, N] = rms_norm(x, unit) · W^T (+ bias): an RMSNorm of x [T, K] with its weight folded into W.
  // `normed` [T, K] holds the normed rows where they are formed in memory first (this default; CUDA
  // above 16 tokens); the CUDA decode path scales each token's products by rsqrt(mean(x^2) + eps)
  // instead, and leaves `normed` untouched.
  virtual void rms_norm_linear(const Tensor& x, float eps, const LinearWeight& w, const Tensor& normed,
                               const Tensor& out) {
    rms_norm(x, Tensor(), normed, eps);
    linear(normed, w, out);
  }
  // The same before linear_glu: act [T, I] = silu(gate) * up of rms_norm(x, unit) · W^T.
  virtual void rms_norm_linear_glu(const Tensor& x, float eps, const LinearWeight& w, const Tensor& normed,
                                   const Tensor& scratch, const Tensor& act) {
    rms_norm(x, Tensor(), normed, eps);
    linear_glu(normed, w, scratch, act);
  }
  // residual [T, N] += x [T, K] · W^T, the product rounded to the activation dtype before the add (as
  // linear into `delta` [T, N], then add, which this default does; the CUDA decode path adds as it
  // stores, the same bits, and leaves `delta` untouched).
  virtual void linear_add(const Tensor& x, const LinearWeight& w, const Tensor& delta, const Tensor& residual) {
    linear(x, w, delta);
    add(residual, delta);
  }

  // Gated attention, step 1. qkv [T, Hq*2*hd + 2*Hkv*hd]: per q head [q (hd) | gate (hd)], then the
  // Hkv key heads, then the Hkv value heads. Applies q_norm / k_norm (zero-centred RMSNorm per head)
  // and RoPE at rope_positions[t] (I32 [T, 3]: t, h, w; equal for text) to q and k; writes
  // q_out [T, Hq, hd] and stores k, v into row positions[t] (I32 [T], the cache row = the index in
  // the sequence) of k_cache / v_cache [max_ctx, Hkv, hd].
  virtual void attention_prepare(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                                 const Tensor& positions, const Tensor& rope_positions, const AttentionParams& p,
                                 const Tensor& q_out, const Tensor& k_cache, const Tensor& v_cache) = 0;

  // Gated attention, step 2. Causal attention of q [T, Hq, hd] over cache rows 0..positions[t]
  // (GQA: q head h reads kv head h / (Hq / Hkv)), times sigmoid(gate) read from qkv (layout above);
  // out [T, Hq*hd].
  virtual void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                         const Tensor& positions, const AttentionParams& p, const Tensor& out) = 0;

  // Gated attention, steps 1 and 2 as one op (the model calls it for every T):
  //   attention_prepare(..., q, k_cache, v_cache);  attention(q, k_cache, v_cache, qkv, positions, p, out).
  // q [T, Hq, hd] (activation dtype) is scratch for backends that run the two ops, as this default does.
  // The CUDA backend runs a decode step (T = 1) as one kernel: the same cache rows, an out within BF16
  // rounding of the two ops' (the new row and the splits are added in another order), and q left
  // untouched.
  virtual void attention_decode(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                                const Tensor& positions, const Tensor& rope_positions, const AttentionParams& p,
                                const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out) {
    attention_prepare(qkv, q_norm, k_norm, positions, rope_positions, p, q, k_cache, v_cache);
    attention(q, k_cache, v_cache, qkv, positions, p, out);
  }

  // Gated DeltaNet, step 1: causal depthwise conv (width K, no bias) + SiLU over the conv_dim channels
  // of x [T, C]. conv_state [C, K-1] (F32) holds the previous K-1 inputs and is updated to the last
  // K-1 inputs. out [T, C].
  virtual void gdn_conv(const Tensor& x, const Tensor& conv_weight, const Tensor& conv_state,
                        const Tensor& out) = 0;

  // Gated DeltaNet, step 2. qkv [T, C] (conv output: q (HK*dk) | k (HK*dk) | v (HV*dv)),
  // ba [T, 2*HV] (b | a, raw projections). Per token and value head h (key head h / (HV/HK)):
  //   q, k L2-normalised (x * rsqrt(sum x^2 + 1e-6)), q *= dk^-0.5,
  //   beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias),
  //   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
  // state [HV, dk, dv] F32 is read and updated in place; out [T, HV*dv].
  // gdn_recurrent steps token by token; gdn_chunked computes the same with the chunked (WY/UT) form.
  virtual void gdn_recurrent(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                             const Tensor& state, const GdnParams& p, const Tensor& out) = 0;
  virtual void gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                           const Tensor& state, const GdnParams& p, const Tensor& out) = 0;

  // Gated DeltaNet, step 3: out = weight * rmsnorm(o) * silu(z) per value head (plain weight [dv]).
  // o, z, out [T, HV*dv].
  virtual void gdn_gated_norm(const Tensor& o, const Tensor& z, const Tensor& weight, const GdnParams& p,
                              const Tensor& out) = 0;

  // Gated DeltaNet steps 1-3 for the few tokens of a decode step, from the in_proj output
  // proj [T, C + HV*dv + 2*HV] = qkv (C = conv_dim) | z (HV*dv) | b (HV) | a (HV):
  //   gdn_conv(qkv) -> conv_out;  gdn_recurrent(conv_out, b | a) -> o;  gdn_gated_norm(o, z) -> out [T, HV*dv].
  // conv_out [T, C] and o [T, HV*dv] (activation dtype) are scratch for backends that run the three
  // ops, as this default does. The CUDA backend runs up to 16 tokens as one kernel with the same
  // roundings (so the same bits) and leaves the scratch untouched.
  virtual void gdn_decode(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                          const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                          const Tensor& conv_out, const Tensor& o, const Tensor& out) {
    const int64_t C = p.conv_dim(), vdim = p.num_v_heads * p.v_head_dim;
    gdn_conv(proj.cols(0, C), conv_weight, conv_state, conv_out);
    gdn_recurrent(conv_out, proj.cols(C + vdim, 2 * p.num_v_heads), A_log, dt_bias, state, p, o);
    gdn_gated_norm(o, proj.cols(C, vdim), norm_weight, p, out);
  }

  // Samples one token per row of logits [R, V] (F32 or the activation dtype) into tokens I32 [R].
  // The random draw for row r is uniform_hash(config.seed, step[0] + r) (see ops/sampling_rng.h), so
  // every backend draws the same numbers; step (I32 [1]) is advanced by R.
  virtual void sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step,
                      const Tensor& tokens) = 0;

  // Calibration (quantization): out[r] = KL(softmax(reference[r]) || softmax(logits[r])) in nats, for
  // reference and logits [R, V] of one dtype (F32 or the activation dtype), out F32 [R]. The log-sum-exps
  // and the sum over V run in double, so a KL far below the logits' magnitude keeps its digits.
  virtual void kl_divergence(const Tensor& reference, const Tensor& logits, const Tensor& out) = 0;

  // ---- the ops of the vision encoder ----

  // LayerNorm over the last dimension: out = (x - mean) * rsqrt(var + eps) * weight + bias.
  virtual void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, float eps) = 0;

  // out = gelu(x): the tanh approximation (gelu_pytorch_tanh) or the exact erf form.
  virtual void gelu(const Tensor& x, const Tensor& out, bool tanh_approximation) = 0;

  // x[n, :] += sum_k weights[n, k] * table[rows[n, k], :] (the bilinear resampling of the learned
  // position table, 4 taps per patch). rows I32 [N, K] (each in [0, table rows)) and weights F32
  // [N, K], both contiguous; table [R, D] F32 or the activation dtype; x [N, D] the activation dtype
  // (dimension 0 may be strided). The sum runs in fp32 from 0 in k order and is added to x with one
  // rounding to x's dtype.
  virtual void gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x) = 0;

  // Bidirectional attention inside each image. qkv [N, 3*H*hd] = q | k | v (head-major); images
  // are the row ranges cu_seqlens[i] .. cu_seqlens[i+1] (I32 [images + 1]). q and k first get 2-D
  // RoPE over the whole head (rotate-half pairs (i, i + hd/2)): pair i < hd/4 turns by
  // row * theta^(-4i/hd), pair hd/4 + j by col * theta^(-4j/hd), with (row, col) = patch_pos[n]
  // (I32 [N, 2]). Softmax scale hd^-0.5. out [N, H*hd]. The q and k parts of qkv may be
  // overwritten (the CUDA backend rotates them in place).
  virtual void vision_attention(const Tensor& qkv, const Tensor& patch_pos, const Tensor& cu_seqlens,
                                int64_t num_heads, float rope_theta, const Tensor& out) = 0;

  // counter[i] += by for every element of an I32 device tensor: a captured decode step advances
  // its own position.
  virtual void increment(const Tensor& counter, int32_t by) = 0;

  // dst <- src, both on the device, same dtype and shape (dimension 0 may be strided).
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;

  // ---- speculative decoding: verification of a block of T <= B tokens by the target, with the
  // Gated DeltaNet layers in the ReplaySSM form (verify reads the committed states and writes none,
  // commit replays the accepted prefix), and the ops of the DFlash drafter. A backend that lacks
  // them throws Error(kInvalidArgument) naming the op (these defaults). ----

  // gdn_decode's outputs for the T tokens of proj (layout as gdn_decode) computed from conv_state
  // and state without writing either; rows 0..T-1 of `replay` receive what gdn_commit needs.
  virtual void gdn_verify(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                          const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                          const Tensor& conv_out, const Tensor& o, const Tensor& out, const GdnReplay& replay) {
    throw speculative_unsupported("gdn_verify");
  }
  // Advances conv_state and state past the first keep[0] tokens (I32 [1], 1 <= keep <= T) of the last
  // gdn_verify that filled `replay`: the states gdn_decode of those tokens would have left, per token
  // S = exp(g) S + k u^T and conv_state = the last K-1 rows of [conv_state ; conv_in[0 : keep]].
  virtual void gdn_commit(const GdnReplay& replay, const Tensor& keep, const GdnParams& p, const Tensor& conv_state,
                          const Tensor& state) {
    throw speculative_unsupported("gdn_commit");
  }

  // The drafter's attention (Qwen3: no gate, RoPE over the whole head at sequence positions).
  // draft_store_kv: kv [T, 2*Hkv*hd] = k | v; k gets k_norm (zero-centred RMSNorm per head) and RoPE
  // at positions[t] (I32 [T]); both go to row positions[t] of k_cache / v_cache [rows, Hkv, hd].
  virtual void draft_store_kv(const Tensor& kv, const Tensor& k_norm, const Tensor& positions, const AttentionParams& p,
                              const Tensor& k_cache, const Tensor& v_cache) {
    throw speculative_unsupported("draft_store_kv");
  }
  // q [T, Hq*hd] gets q_norm and RoPE at positions[t]; query t attends to the cache rows r <= last =
  // positions[T-1] that the mask admits: r <= positions[t] when `mask.causal`; with a window W > 0,
  // positions[t] - r < W, and also r - positions[t] < W when not causal. out [T, Hq*hd].
  virtual void draft_attention(const Tensor& q, const Tensor& q_norm, const Tensor& positions, const Tensor& k_cache,
                               const Tensor& v_cache, const AttentionParams& p, const DraftMask& mask,
                               const Tensor& out) {
    throw speculative_unsupported("draft_attention");
  }
  // DFlash2's grouped dynamic causal convolution over one block: with G = C / group,
  // out[t, c] = sum over o < K, o <= t of (base[o, c] + dyn[t, o*G + c/group]) * x[t - o, c]
  // (rows before the block count as zero). x, out [T, C]; dyn [T, K*G] (may be strided); base [K, C] F32.
  virtual void dynamic_conv(const Tensor& x, const Tensor& dyn, const Tensor& base, int64_t group, const Tensor& out) {
    throw speculative_unsupported("dynamic_conv");
  }
  // x = tanh(x * multiplier / softcap) * softcap in place (softcap <= 0: x *= multiplier). x [R, V].
  virtual void scale_softcap(const Tensor& x, float multiplier, float softcap) {
    throw speculative_unsupported("scale_softcap");
  }
  // DFlash2's candidate walk over the R = B-1 drafted positions. logits [R, V] (scale_softcap'ed);
  // h [R, r] = hidden_projection of the drafter's hidden states; pred, succ [V, r] the codebooks;
  // anchor I32 [1]. Per position t: the K = cand.dim(1) largest logits are the candidates (ties: lower
  // id first), scored s(c) = logits[t, c] + sum_j pred[prev, j] h[t, j] succ[c, j], prev the token
  // chosen at t-1 (the anchor at t = 0). temperature <= 0: the highest score (first in candidate
  // order on ties); else a draw from softmax(s / temperature) with uniform_hash(seed, step[0] + t).
  // tokens I32 [R]: the walk; cand I32 [R, K] and cand_prob F32 [R, K]: the draft distribution q_t
  // (one-hot at temperature 0). step is not advanced.
  virtual void selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ,
                             const Tensor& anchor, float temperature, uint64_t seed, const Tensor& step,
                             const Tensor& tokens, const Tensor& cand, const Tensor& cand_prob) {
    throw speculative_unsupported("selector_walk");
  }
  // Acceptance of a verified block [anchor, draft_0 .. draft_{B-2}]. logits [B, V]: the target's, row
  // i predicting the token after block token i; draft I32 [B-1]; q_i: cand_prob [B-1, Kq] (F32) on the
  // token ids cand [B-1, Kq] (I32), zero elsewhere. With a = the number of drafts accepted, out I32
  // [B] receives the a + 1 emitted tokens (draft_0 .. draft_{a-1}, then the correction or bonus) and
  // count I32 [1] = a + 1.
  // - config.temperature <= 0: a = the longest prefix with draft_i == argmax(logits[i]) (the sampler's
  //   argmax); then argmax(logits[a]).
  // - else, p_i = the distribution sample() draws row i from (temperature, top-k, top-p): draft_i is
  //   accepted iff u_i q_i(draft_i) < p_i(draft_i), u_i = uniform_hash(seed, step[0] + i); at the first
  //   rejection the token is drawn from normalize(max(0, p_a - q_a)) (p_a where that is all zero), after
  //   B-1 acceptances from p_{B-1}, with uniform_hash(seed, step[0] + B-1). step advances by B.
  // The emitted tokens are distributed as sample() over the target alone would draw them.
  virtual void speculative_accept(const Tensor& logits, const Tensor& draft, const Tensor& cand, const Tensor& cand_prob,
                                  const SamplerConfig& config, const Tensor& step, const Tensor& out,
                                  const Tensor& count) {
    throw speculative_unsupported("speculative_accept");
  }

  // The bookkeeping that ends a speculative step, after speculative_accept wrote count (I32 [1]) and
  // tokens (I32 [>= count[0]]): the next block starts count[0] positions later and its anchor is the
  // last emitted token. positions (I32 [B]) and rope_positions (I32 [B, 3]) += count[0]; row 0 of
  // draft_ids and of verify_ids (I32 [B] each) = tokens[count[0] - 1]; step (I32 [1]) += 1 (the
  // index that tags the step's post). count[0] must be in 1..B; all contiguous.
  virtual void speculative_advance(const Tensor& count, const Tensor& tokens, const Tensor& positions,
                                   const Tensor& rope_positions, const Tensor& draft_ids, const Tensor& verify_ids,
                                   const Tensor& step) {
    throw speculative_unsupported("speculative_advance");
  }

  // ---- calibration on a GPU (engine/linear_observer.cpp): the statistics of the projections' inputs
  // stay on the device. A backend that lacks them throws Error(kInvalidArgument) (this default). ----

  // Adds x [T, K] (F32 or the activation dtype) to accumulators on the device, all F32: abs_max [K] =
  // max(abs_max, |x| over the rows); sums [4, K]: sum |x|, its compensation, sum x^2, its compensation
  // (Kahan sums: the value is sum - compensation, so that many tokens keep fp32's digits); and where
  // gram is defined, gram [2, K, K] (sum, compensation) += X^T X on and below the diagonal (i >= j).
  virtual void accumulate_input_stats(const Tensor& x, const Tensor& abs_max, const Tensor& sums, const Tensor& gram) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("accumulate_input_stats: the ") + name() + " backend keeps no statistics on a device");
  }

  // ---- step graphs: the ops issued between begin_capture() and end_capture(slot) are recorded (not
  // run) and replay(slot) runs them all with one launch. A backend keeps one graph per slot (0 ..
  // kGraphSlots - 1; an engine keeps its decode step in one, its speculative step in another).
  // Backends without graphs return false. ----
  static constexpr int kGraphSlots = 4;
  virtual bool supports_graphs() const { return false; }
  virtual void begin_capture() {}
  virtual void end_capture(int slot) {}  // keeps the graph in `slot`, replacing the one there
  virtual void replay(int slot) {}
  virtual int64_t graph_kernels(int slot) const { return 0; }  // kernel nodes in the graph of `slot`

  // ---- timing (benchmarks): mark_time(i) records the moment the work queued so far completes, in mark
  // i (0 .. kTimeMarks - 1); seconds_between_marks(i, j) waits for both and returns the time from i
  // to j. This default, for backends that run ops as they are issued, reads the host clock. ----
  static constexpr int kTimeMarks = 8;
  virtual void mark_time(int i) { time_marks_[check_mark(i)] = std::chrono::steady_clock::now(); }
  virtual double seconds_between_marks(int i, int j) {
    return std::chrono::duration<double>(time_marks_[check_mark(j)] - time_marks_[check_mark(i)]).count();
  }

 protected:
  struct Post {
    int32_t tag = -1, count = 0;  // written values first, tag last
    int32_t values[kMaxPostValues] = {};
  };
  static Error missing_post(int32_t tag) {
    return Error(ErrorCode::kInternal, "wait_post_i32: no post tagged " + std::to_string(tag) +
                                           " is in the mailbox (never posted, or overwritten by a later one)");
  }
  static void check_post(const Tensor& values, const Tensor& tag) {
    if (values.dtype != DType::I32 || tag.dtype != DType::I32 || tag.numel() != 1 || values.numel() < 1 ||
        values.numel() > kMaxPostValues || !values.contiguous())
      throw Error(ErrorCode::kInternal, "post_i32: expected 1.." + std::to_string(kMaxPostValues) +
                                            " contiguous I32 values and one I32 tag, got " + values.shape_str() + " " +
                                            dtype_name(values.dtype) + " and " + tag.shape_str() + " " +
                                            dtype_name(tag.dtype));
  }
  static int check_mark(int i) {
    if (i < 0 || i >= kTimeMarks)
      throw Error(ErrorCode::kInternal, "time mark " + std::to_string(i) + " outside 0.." + std::to_string(kTimeMarks - 1));
    return i;
  }
  Error speculative_unsupported(const char* op) const {
    return Error(ErrorCode::kInvalidArgument, std::string(op) + ": speculative decoding is not yet implemented on the " +
                                                  name() + " backend");
  }

 private:
  Post mailbox_[kMailboxSlots];
  std::chrono::steady_clock::time_point time_marks_[kTimeMarks];
};

std::unique_ptr<Backend> make_cpu_backend(int num_threads);
// Throws Error(kDeviceError) when CUDA support was not compiled in or no device is usable.
std::unique_ptr<Backend> make_cuda_backend(int device_index);

}  // namespace ocria_rt
