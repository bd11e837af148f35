// The CUDA backend: one device, one stream, BF16 activations and weights, fp32 math inside kernels.
//
// Every op is asynchronous on stream() and capturable in a CUDA graph: no host synchronisation, no
// allocation, no host-side reads of device data inside an op. Scratch memory comes from one workspace
// allocated in the constructor (reserve_workspace() may grow it before capture). Failures of the CUDA
// runtime become ocria_rt::Error(kDeviceError) naming what failed; bad arguments (dtype, shape)
// become Error(kInternal), as they are bugs of the caller inside ocria_rt.
//
// The class is declared here; its methods are defined in the file of their op family
// (embedding.cu, linear.cu, norm.cu, activation.cu, attention.cu, gdn.cu, sampling.cu, dflash.cu) and the
// memory / stream methods in backend.cu.
//
// Programmatic dependent launch (PDL, sm_90). The kernels of the decode path are launched with
// launch_pdl(), which lets a kernel start while the kernel before it on the stream still runs: its
// blocks become resident early, and it can fetch weights during its predecessor's tail instead of
// after a full drain and launch gap. Such a kernel
//  - calls pdl_launch_dependents() (at entry), allowing the next kernel to be scheduled in turn;
//  - calls pdl_wait() in every thread, before its first read of anything an earlier kernel wrote
//    and before its first global write (a write could race with a predecessor still reading the
//    buffer). Before the wait it may only read data no kernel of the stream writes: weights, norm
//    weights, constants.
// The compiler may load through a const __restrict__ pointer as invariant memory (LDG.CONSTANT) and
// schedule such a load above the wait, which the wait's "memory" clobber does not prevent: where it
// does, the pointer must be plain. tests/test_pdl_sass.py checks the compiled kernels for it.
// pdl_wait() returns once the predecessor has completed and its memory is visible; since that
// predecessor only completed after its own wait returned, everything earlier has completed too.
// Weights handed to ops must therefore never be written by ops' kernels (they are uploaded with
// copy_from_host, which synchronises before returning). Kernels launched the ordinary way (prefill-only kernels,
// CUTLASS) wait for all earlier work as usual. OCRIA_RT_PDL=0 in the environment, read when a
// backend is constructed, launches everything the ordinary way (pdl_wait() and
// pdl_launch_dependents() are then no-ops), for comparison and debugging.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ops/ops.h"

namespace ocria_rt {
namespace cuda {

// ---- error handling ----

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what);

// Checks a CUDA runtime call; `what` names the operation for the error message.
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw_cuda_error(err, what);
}
// Checks the launch of the kernel named `what` (configuration errors; asynchronous faults surface at
// the next synchronising call).
inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// Throws Error(kInternal) with `op: message` unless cond holds. A macro, so that the message (often
// built from shape strings) is only formed when the check fails, not on every op call.
[[noreturn]] void require_failed(const char* op, const std::string& message);
#define OCRIA_RT_REQUIRE(cond, op, message)                                  \
  do {                                                                       \
    if (!(cond)) ::ocria_rt::cuda::require_failed((op), (message));          \
  } while (0)
// The tensor lives on the CUDA device and has the given dtype.
void require_tensor(const Tensor& t, DType dtype, const char* op, const char* name);
// Same, F32 or BF16.
void require_float(const Tensor& t, const char* op, const char* name);

// ---- programmatic dependent launch (see the top of this file) ----

// Where an op launches its kernels: the backend's stream, and whether launch_pdl() uses PDL.
struct LaunchCtx {
  cudaStream_t stream = nullptr;
  bool pdl = false;
};

// What the decode GEMM (linear.cu's skinny GEMM) takes from the backend: the launch context, the SM
// count, the switches read when the backend was constructed, and the split-K scratch.
struct SkinnySettings {
  LaunchCtx ctx;
  int sm_count = 0;
  int ksplit = 0, cluster = 0, persistent = 0;  // OCRIA_RT_SKINNY_KSPLIT, _CLUSTER, _PERSISTENT
  int rows = -1;                                // OCRIA_RT_SKINNY_ROWS (-1: CudaBackend::kSkinnyAuto)
  int64_t prefetch_bytes = 0;                   // OCRIA_RT_L2_PREFETCH_MB
  void* splitk_scratch = nullptr;
};

// kernel<<<grid, block, smem, ctx.stream>>>(args...), as a programmatic dependent launch when
// ctx.pdl, in thread block clusters of `cluster` consecutive blocks along x when cluster > 0 (it
// must divide grid.x; at most 8). `what` names the kernel in the error message. The kernel must
// follow the rules above.
template <class... Params, class... Args>
void launch_pdl_cluster(const LaunchCtx& ctx, const char* what, unsigned cluster, void (*kernel)(Params...),
                        dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchAttribute attrs[2]{};
  unsigned n = 0;
  if (ctx.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 0) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster;
    attrs[n].val.clusterDim.y = 1;
    attrs[n++].val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = ctx.stream;
  cfg.attrs = n > 0 ? attrs : nullptr;
  cfg.numAttrs = n;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}
template <class... Params, class... Args>
void launch_pdl(const LaunchCtx& ctx, const char* what, void (*kernel)(Params...), dim3 grid, dim3 block,
                size_t smem, Args&&... args) {
  launch_pdl_cluster(ctx, what, 0, kernel, grid, block, smem, std::forward<Args>(args)...);
}

// Waits until the kernels this one depends on have completed and their writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel on the stream be scheduled (it still waits for our completion in pdl_wait()).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- completion counts across the blocks of a launch ----

// Counts this block in on counters[i] (zero between launches). True, in every thread, for the block
// that completes the count of `expected` blocks; it resets the counter for the next launch. Threads
// whose global writes the last block reads pass wrote: their __threadfence orders those writes
// before the count, __syncthreads orders every thread's fence before thread 0's atomicAdd, and the
// last block's fence after the count it saw orders its later reads after every counted write.
// Contains __syncthreads.
__device__ __forceinline__ bool arrive_last(unsigned* counters, int64_t i, unsigned expected, bool wrote) {
  if (wrote) __threadfence();
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) last = atomicAdd(&counters[i], 1u) == expected - 1;
  if (!__syncthreads_or(last)) return false;
  if (threadIdx.x == 0) counters[i] = 0;
  __threadfence();
  return true;
}

// ---- thread block clusters (launch_pdl_cluster) ----

// The cluster barrier, split: every thread of every block of the cluster arrives, then waits for
// all the others. Arrive has release semantics (relaxed: none), wait acquire semantics.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
// Stores v at the address `local` has in the shared memory of block `rank` of this cluster
// (distributed shared memory). That block must be running: a cluster barrier has been passed since
// every block arrived at the kernel's start.
__device__ __forceinline__ void store_cluster_shared(float* local, unsigned rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
#endif
}

// ---- element helpers ----

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// A small parameter vector (norm weight, A_log, dt_bias, conv weight) of either F32 or BF16, read
// element by element: the dtype branch is uniform, so it costs nothing next to the math.
struct ParamView {
  const void* ptr = nullptr;
  bool is_bf16 = true;
  __device__ __forceinline__ float operator[](int64_t i) const {
    return is_bf16 ? __bfloat162float(static_cast<const bf16*>(ptr)[i]) : static_cast<const float*>(ptr)[i];
  }
};
ParamView param_view(const Tensor& t, const char* op, const char* name);

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// Sum over a warp, result in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); `red` holds 32 floats of shared
// memory. Every thread gets the result. Contains __syncthreads.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `red` may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : 0.0f;
  return warp_sum(v);
}

// 16-byte aligned pointer and a row stride (elements) that keeps every row 16-byte aligned.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace cuda

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // The stream every op runs on (for CUDA-graph capture by the engine).
  cudaStream_t stream() const { return stream_; }
  int device_index() const { return device_; }
  int sm_count() const { return sm_count_; }
  // Whether decode-path kernels go out as programmatic dependent launches (OCRIA_RT_PDL != "0" in
  // the environment when the backend was constructed).
  bool pdl() const { return pdl_; }
  // Whether gdn_decode runs its fused kernel where it applies (OCRIA_RT_GDN_FUSED != "0" in the
  // environment when the backend was constructed; "0" runs the three ops, for comparison).
  bool gdn_fused() const { return gdn_fused_; }
  // Whether attention_decode runs its one-kernel decode step where it applies (OCRIA_RT_ATTN_FUSED !=
  // "0" in the environment when the backend was constructed; "0" runs attention_prepare + attention).
  bool attn_fused() const { return attn_fused_; }
  // Whether attention runs 2..16 tokens (a speculative verify block) through its tensor-core kernel
  // where it applies (OCRIA_RT_ATTN_VERIFY != "0" in the environment when the backend was
  // constructed; "0" runs them through the flash-decoding kernels, as T = 1, for comparison).
  bool attn_verify() const { return attn_verify_; }
  // The one-kernel decode step merges up to this many non-empty splits of a kv head in one level, more
  // in two (attention.cu): OCRIA_RT_ATTN_MERGE_GROUP in the environment when the backend was
  // constructed (at least 1; 1024, the most splits, or more: always one level), for experiments;
  // unset: kDefaultAttnMergeGroup.
  int attn_merge_group() const { return attn_merge_group_; }
  static constexpr int kDefaultAttnMergeGroup = 8;
  // K splits of the skinny GEMM (linear with M <= 16, linear.cu): OCRIA_RT_SKINNY_KSPLIT in the
  // environment when the backend was constructed; unset, 0 or 1: no split-K (the default: it measured
  // slower), n > 1 asks for n splits (capped by K and by the split-K scratch), for experiments.
  int skinny_ksplit() const { return skinny_ksplit_; }
  // Grows the op workspace to at least `bytes` (it starts at kDefaultWorkspaceBytes). Call before
  // capturing graphs; ops never allocate. Sampling of R rows of V logits needs about R * V * 4 bytes
  // (rows beyond what fits are processed in several launches), attention about
  // 16 * Hq * splits * (head_dim + 2) * 4 (fewer splits are used when it is smaller), the chunked
  // GDN about HV * (2 dk + 4 dv + 136) bytes per token (longer prompts take several passes).
  void reserve_workspace(size_t bytes);
  size_t workspace_bytes() const { return workspace_bytes_; }
  static constexpr size_t kDefaultWorkspaceBytes = size_t(64) << 20;
  // Split-K scratch of the skinny GEMM, apart from the workspace (its tile counters must stay zero
  // between launches): (row tile, split) pairs it holds, one 16 x 16 fp32 partial tile each, and
  // counters for the at most kSplitKSlots / 2 tiles of a split launch.
  static constexpr int64_t kSplitKSlots = 4096;
  static constexpr size_t kDequantScratchBytes = size_t(64) << 20;
  static constexpr size_t kSplitKCounterBytes = size_t(kSplitKSlots / 2) * sizeof(uint32_t);
  static constexpr size_t kSplitKBytes = kSplitKCounterBytes + size_t(kSplitKSlots) * 16 * 16 * sizeof(float);
  // Counters of attention_decode's one-kernel decode step (attention.cu), apart from the workspace for
  // the same reason: zero between launches. It uses Hkv * (splits + 1) of them.
  static constexpr int64_t kAttnCounters = 8192;
  // The value of the skinny GEMM's launch-shape switches (below) when the environment leaves them unset.
  static constexpr int kSkinnyAuto = -1;

  const char* name() const override { return "cuda"; }
  DeviceKind device() const override { return DeviceKind::CUDA; }
  DType activation_dtype() const override { return DType::BF16; }
  DType weight_dtype() const override { return DType::BF16; }

  void check_model_shapes(const AttentionParams& attention, const GdnParams& gdn) const override;
  void* allocate(size_t bytes) override;
  void release(void* ptr) override;
  void copy_from_host(const Tensor& dst, const void* src, DType src_dtype) override;
  void copy_to_host(void* dst, const Tensor& src) override;
  void fill_zero(const Tensor& t) override;
  void synchronize() override;
  bool queues_work() const override { return true; }
  void post_i32(const Tensor& values, const Tensor& tag) override;
  std::vector<int32_t> wait_post_i32s(int32_t tag) override;
  void clear_posts() override;

  void embedding(const Tensor& table, const Tensor& ids, const Tensor& out) override;
  void linear(const Tensor& x, const LinearWeight& w, const Tensor& out) override;
  void linear_glu(const Tensor& x, const LinearWeight& w, const Tensor& scratch, const Tensor& act) override;
  void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, float eps) override;
  void fold_norm_weight(const Tensor& w, const Tensor& norm_weight) override;
  void prepare_quantized_weight(const LinearWeight& w) override;
  void rms_norm_linear(const Tensor& x, float eps, const LinearWeight& w, const Tensor& normed,
                       const Tensor& out) override;
  void rms_norm_linear_glu(const Tensor& x, float eps, const LinearWeight& w, const Tensor& normed,
                           const Tensor& scratch, const Tensor& act) override;
  void linear_add(const Tensor& x, const LinearWeight& w, const Tensor& delta, const Tensor& residual) override;
  void add(const Tensor& residual, const Tensor& delta) override;
  void silu_mul(const Tensor& gate_up, const Tensor& out) override;
  void attention_prepare(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, const Tensor& positions,
                         const Tensor& rope_positions, const AttentionParams& p, const Tensor& q_out,
                         const Tensor& k_cache, const Tensor& v_cache) override;
  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                 const Tensor& positions, const AttentionParams& p, const Tensor& out) override;
  void attention_decode(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, const Tensor& positions,
                        const Tensor& rope_positions, const AttentionParams& p, const Tensor& q, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& out) override;
  void gdn_conv(const Tensor& x, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& out) override;
  void gdn_recurrent(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                     const Tensor& state, const GdnParams& p, const Tensor& out) override;
  void gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                   const Tensor& state, const GdnParams& p, const Tensor& out) override;
  void gdn_gated_norm(const Tensor& o, const Tensor& z, const Tensor& weight, const GdnParams& p,
                      const Tensor& out) override;
  void gdn_decode(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                  const Tensor& conv_out, const Tensor& o, const Tensor& out) override;
  void sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step, const Tensor& tokens) override;
  // Speculative decoding (gdn.cu: verify / commit; dflash.cu: the drafter's ops; sampling.cu: acceptance).
  void gdn_verify(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                  const Tensor& conv_out, const Tensor& o, const Tensor& out, const GdnReplay& replay) override;
  void gdn_commit(const GdnReplay& replay, const Tensor& keep, const GdnParams& p, const Tensor& conv_state,
                  const Tensor& state) override;
  void draft_store_kv(const Tensor& kv, const Tensor& k_norm, const Tensor& positions, const AttentionParams& p,
                      const Tensor& k_cache, const Tensor& v_cache) override;
  void draft_attention(const Tensor& q, const Tensor& q_norm, const Tensor& positions, const Tensor& k_cache,
                       const Tensor& v_cache, const AttentionParams& p, const DraftMask& mask, const Tensor& out) override;
  void dynamic_conv(const Tensor& x, const Tensor& dyn, const Tensor& base, int64_t group, const Tensor& out) override;
  void scale_softcap(const Tensor& x, float multiplier, float softcap) override;
  void selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ, const Tensor& anchor,
                     float temperature, uint64_t seed, const Tensor& step, const Tensor& tokens, const Tensor& cand,
                     const Tensor& cand_prob) override;
  void speculative_accept(const Tensor& logits, const Tensor& draft, const Tensor& cand, const Tensor& cand_prob,
                          const SamplerConfig& config, const Tensor& step, const Tensor& out,
                          const Tensor& count) override;
  void kl_divergence(const Tensor& reference, const Tensor& logits, const Tensor& out) override;
  void accumulate_input_stats(const Tensor& x, const Tensor& abs_max, const Tensor& sums, const Tensor& gram) override;
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, float eps) override;
  void gelu(const Tensor& x, const Tensor& out, bool tanh_approximation) override;
  void gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x) override;
  void vision_attention(const Tensor& qkv, const Tensor& patch_pos, const Tensor& cu_seqlens, int64_t num_heads,
                        float rope_theta, const Tensor& out) override;
  void increment(const Tensor& counter, int32_t by) override;
  void copy(const Tensor& dst, const Tensor& src) override;
  void speculative_advance(const Tensor& count, const Tensor& tokens, const Tensor& positions,
                           const Tensor& rope_positions, const Tensor& draft_ids, const Tensor& verify_ids,
                           const Tensor& step) override;

  // CUDA graphs: begin_capture() starts capturing stream() (thread-local mode), end_capture(slot)
  // instantiates the graph into the slot (replacing the one there), replay(slot) launches it on stream().
  bool supports_graphs() const override { return true; }
  void begin_capture() override;
  void end_capture(int slot) override;
  void replay(int slot) override;
  int64_t graph_kernels(int slot) const override;
  // Timing marks are CUDA events recorded on stream().
  void mark_time(int i) override;
  double seconds_between_marks(int i, int j) override;

 private:
  // Makes device_ current on the calling thread (cheap when it already is).
  void activate() const;
  cuda::LaunchCtx launch_ctx() const { return {stream_, pdl_}; }
  cuda::SkinnySettings skinny_settings() const {
    return {launch_ctx(), sm_count_, skinny_ksplit_, skinny_cluster_, skinny_persistent_, skinny_rows_,
            skinny_prefetch_bytes_, splitk_scratch_};
  }
  void free_resources() noexcept;
  // The GDN recurrence ops; `chunked` takes the chunked tensor-core kernels where they apply.
  void gdn_run(const char* op, const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
               const Tensor& state, const GdnParams& p, const Tensor& out, bool chunked);

  int device_ = 0;
  int sm_count_ = 0;
  bool pdl_ = true;
  bool gdn_fused_ = true;
  bool attn_fused_ = true;
  bool attn_verify_ = true;
  int attn_merge_group_ = kDefaultAttnMergeGroup;
  int skinny_ksplit_ = 0;
  // OCRIA_RT_SKINNY_CLUSTER, read when the backend is constructed: 2 or 4 split every tile's K over
  // that many blocks of a thread block cluster wherever there are few row tiles and no split-K over
  // the grid is asked for; any other number: never; unset or empty: kSkinnyAuto, 2 above 8 tokens
  // (linear.cu, skinny_cluster).
  int skinny_cluster_ = kSkinnyAuto;
  // OCRIA_RT_SKINNY_PERSISTENT, read likewise: 1 persistent blocks for every shape of many row tiles,
  // anything else: never; unset or empty: kSkinnyAuto, the measured choice (linear.cu, skinny_persistent).
  int skinny_persistent_ = kSkinnyAuto;
  // OCRIA_RT_SKINNY_ROWS: 32 gives a block two row tiles that share their x loads wherever no K is
  // split, 16 never; unset: above 8 tokens without the GLU epilogue (linear.cu, skinny_plan).
  int skinny_rows_ = kSkinnyAuto;
  // What the blocks of one skinny GEMM prefetch into L2, together, before their input is ready
  // (OCRIA_RT_L2_PREFETCH_MB; default none: linear.cu, the notes on programmatic dependent launch).
  int64_t skinny_prefetch_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  // Op scratch, shared by all ops: kernels on the one stream only touch it after pdl_wait(), when
  // every earlier kernel has completed.
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  // kSplitKBytes: the counters (zeroed once; the last block of a tile resets its counter), then the
  // partial tiles. Only touched after pdl_wait(), like the workspace.
  void* splitk_scratch_ = nullptr;
  // kAttnCounters counters, zeroed once; the block that uses a counter last resets it. Only touched
  // after pdl_wait().
  uint32_t* attn_counters_ = nullptr;
  // BF16 rows of a quantized weight where linear forms its product through memory (prefill; linear.cu,
  // linear_dequantized): kDequantScratchBytes, allocated at the first such call (never during graph
  // capture). Its kernels launch the ordinary way, each after the previous slab's GEMM has read it.
  void* dequant_scratch_ = nullptr;
  // Pinned staging for host copies: two halves, so that filling one chunk on the host overlaps
  // the transfer of the previous one. An F32 -> BF16 copy_from_host passes each chunk through the
  // workspace, which therefore holds at least one half.
  static constexpr size_t kStagingBytes = size_t(16) << 20;
  static_assert(kStagingBytes <= kDefaultWorkspaceBytes, "copy_from_host stages F32 chunks in the workspace");
  void* staging_[2] = {nullptr, nullptr};
  cudaEvent_t staging_done_[2] = {nullptr, nullptr};
  // post_i32's mailbox: pinned host memory mapped into the device's address space, which a kernel
  // writes over PCIe and the host polls
  Post* mailbox_host_ = nullptr;
  Post* mailbox_device_ = nullptr;
  bool capturing_ = false;
  cudaGraphExec_t graph_exec_[kGraphSlots] = {};
  int64_t graph_kernels_[kGraphSlots] = {};
  cudaEvent_t time_marks_[kTimeMarks] = {};
};

}  // namespace ocria_rt

namespace ocria_rt {
namespace cuda {

// V consecutive elements, for 16-byte (or smaller) vector loads and stores.
template <class T, int V> struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <class T, int V> __device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <class T, int V> __device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}
// Elements per 16-byte vector.
template <class T> constexpr int vec16() { return 16 / int(sizeof(T)); }

// Whether rows of `cols` elements starting at p with stride `stride` (elements) can all be accessed
// with V-element vectors.
inline bool vec_ok(const void* p, int64_t stride, int64_t cols, int V, size_t esz) {
  return (reinterpret_cast<uintptr_t>(p) % (V * esz)) == 0 && stride % V == 0 && cols % V == 0;
}

// A 2-D [rows, cols] view of a tensor whose last dimension is `cols` and whose dimension 0 may be
// strided: row r lives at data + (r / inner) * outer_stride + (r % inner) * cols.
struct RowView {
  int64_t rows = 0, inner = 1, outer_stride = 0, cols = 0;
};
RowView row_view(const Tensor& t, int64_t cols, const char* op, const char* name);

}  // namespace cuda
}  // namespace ocria_rt
