// CudaBackend: device selection, the stream, the workspace, memory and host <-> device copies.
#include "ops/cuda/backend.cuh"

#include "core/float_convert.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace ocria_rt {
namespace cuda {

void throw_cuda_error(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear a sticky launch error so that the next call reports its own
  ErrorCode code = err == cudaErrorMemoryAllocation ? ErrorCode::kResourceError : ErrorCode::kDeviceError;
  throw Error(code, std::string("CUDA backend: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                        cudaGetErrorString(err) + ")");
}

void require_failed(const char* op, const std::string& message) {
  throw Error(ErrorCode::kInternal, std::string("CUDA ") + op + ": " + message);
}

void require_tensor(const Tensor& t, DType dtype, const char* op, const char* name) {
  OCRIA_RT_REQUIRE(t.defined(), op, std::string(name) + " is not defined");
  OCRIA_RT_REQUIRE(t.device == DeviceKind::CUDA, op, std::string(name) + " is not a CUDA tensor");
  OCRIA_RT_REQUIRE(t.dtype == dtype, op,
          std::string(name) + " has dtype " + dtype_name(t.dtype) + ", expected " + dtype_name(dtype));
}

void require_float(const Tensor& t, const char* op, const char* name) {
  OCRIA_RT_REQUIRE(t.defined(), op, std::string(name) + " is not defined");
  OCRIA_RT_REQUIRE(t.device == DeviceKind::CUDA, op, std::string(name) + " is not a CUDA tensor");
  OCRIA_RT_REQUIRE(t.dtype == DType::F32 || t.dtype == DType::BF16, op,
          std::string(name) + " has dtype " + dtype_name(t.dtype) + ", expected F32 or BF16");
}

ParamView param_view(const Tensor& t, const char* op, const char* name) {
  require_float(t, op, name);
  OCRIA_RT_REQUIRE(t.contiguous(), op, std::string(name) + " must be contiguous");
  return ParamView{t.data, t.dtype == DType::BF16};
}

}  // namespace cuda

namespace {

// ---- host-side dtype conversion for copies (scalar conversions: core/float_convert.h) ----

// Reads element i of host data of dtype t as double (exact for all four dtypes).
double read_host(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::I32: return static_cast<const int32_t*>(p)[i];
  }
  return 0;
}

void write_host(void* p, DType t, size_t i, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = float(v); break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(float(v)); break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = float_to_f16(float(v)); break;
    case DType::I32: static_cast<int32_t*>(p)[i] = int32_t(v); break;
  }
}

// dst[0..n) (dst_t) <- src[0..n) (src_t).
void convert_host(void* dst, DType dst_t, const void* src, DType src_t, size_t n) {
  if (dst_t == src_t) {
    std::memcpy(dst, src, n * dtype_size(dst_t));
  } else if (src_t == DType::F32 && dst_t == DType::BF16) {
    auto* d = static_cast<uint16_t*>(dst);
    auto* s = static_cast<const float*>(src);
    for (size_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
  } else if (src_t == DType::BF16 && dst_t == DType::F32) {
    auto* d = static_cast<float*>(dst);
    auto* s = static_cast<const uint16_t*>(src);
    for (size_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
  } else {
    for (size_t i = 0; i < n; ++i) write_host(dst, dst_t, i, read_host(src, src_t, i));
  }
}

// The (rows, elements per row) layout of a tensor whose dimension 0 may be strided.
struct RowLayout {
  int64_t rows, row_elems, stride;
};
RowLayout row_layout(const Tensor& t) {
  if (t.ndim == 0) return {1, 1, 1};
  return {t.shape[0], t.row_size(), t.ndim == 1 ? 1 : t.row_stride};
}

}  // namespace

using cuda::check_cuda;

CudaBackend::CudaBackend(int device_index) : device_(device_index) {
  const char* pdl_env = std::getenv("OCRIA_RT_PDL");
  pdl_ = !(pdl_env && std::strcmp(pdl_env, "0") == 0);
  const char* fused_env = std::getenv("OCRIA_RT_GDN_FUSED");
  gdn_fused_ = !(fused_env && std::strcmp(fused_env, "0") == 0);
  const char* attn_fused_env = std::getenv("OCRIA_RT_ATTN_FUSED");
  attn_fused_ = !(attn_fused_env && std::strcmp(attn_fused_env, "0") == 0);
  const char* attn_verify_env = std::getenv("OCRIA_RT_ATTN_VERIFY");
  attn_verify_ = !(attn_verify_env && std::strcmp(attn_verify_env, "0") == 0);
  const char* merge_env = std::getenv("OCRIA_RT_ATTN_MERGE_GROUP");
  if (merge_env && *merge_env) attn_merge_group_ = std::max(1, std::atoi(merge_env));
  const char* ksplit_env = std::getenv("OCRIA_RT_SKINNY_KSPLIT");
  skinny_ksplit_ = ksplit_env ? std::max(0, std::atoi(ksplit_env)) : 0;
  const char* cluster_env = std::getenv("OCRIA_RT_SKINNY_CLUSTER");
  skinny_cluster_ = cluster_env && *cluster_env ? std::max(0, std::atoi(cluster_env)) : kSkinnyAuto;
  const char* persistent_env = std::getenv("OCRIA_RT_SKINNY_PERSISTENT");
  skinny_persistent_ = persistent_env && *persistent_env ? int(std::strcmp(persistent_env, "1") == 0) : kSkinnyAuto;
  const char* rows_env = std::getenv("OCRIA_RT_SKINNY_ROWS");
  if (rows_env && (std::strcmp(rows_env, "16") == 0 || std::strcmp(rows_env, "32") == 0)) skinny_rows_ = std::atoi(rows_env);
  const char* prefetch_env = std::getenv("OCRIA_RT_L2_PREFETCH_MB");
  if (prefetch_env && *prefetch_env) skinny_prefetch_bytes_ = int64_t(std::max(0, std::atoi(prefetch_env))) << 20;
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device_index < 0 || device_index >= count)
    throw Error(ErrorCode::kDeviceError, "CUDA backend: device index " + std::to_string(device_index) +
                                             " out of range (" + std::to_string(count) + " devices)");
  check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_), "cudaDeviceGetAttribute");
  if (major < 9)
    throw Error(ErrorCode::kDeviceError, "CUDA backend: device " + std::to_string(device_index) +
                                             " has compute capability " + std::to_string(major) +
                                             ".x; this build targets sm_90a (Hopper)");
  check_cuda(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), "cudaDeviceGetAttribute");
  try {
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (int i = 0; i < 2; ++i) {
      check_cuda(cudaMallocHost(&staging_[i], kStagingBytes), "cudaMallocHost (staging buffer)");
      check_cuda(cudaEventCreateWithFlags(&staging_done_[i], cudaEventDisableTiming), "cudaEventCreate");
    }
    for (cudaEvent_t& e : time_marks_) check_cuda(cudaEventCreate(&e), "cudaEventCreate (time mark)");
    check_cuda(cudaHostAlloc(&mailbox_host_, kMailboxSlots * sizeof(Post), cudaHostAllocMapped), "cudaHostAlloc (mailbox)");
    check_cuda(cudaHostGetDevicePointer(&mailbox_device_, mailbox_host_, 0), "cudaHostGetDevicePointer (mailbox)");
    for (int i = 0; i < kMailboxSlots; ++i) mailbox_host_[i] = Post{};
    reserve_workspace(kDefaultWorkspaceBytes);
    check_cuda(cudaMalloc(&splitk_scratch_, kSplitKBytes), "cudaMalloc (split-K scratch)");
    check_cuda(cudaMemsetAsync(splitk_scratch_, 0, kSplitKCounterBytes, stream_), "cudaMemsetAsync (split-K counters)");
    const size_t attn_counter_bytes = size_t(kAttnCounters) * sizeof(uint32_t);
    check_cuda(cudaMalloc(&attn_counters_, attn_counter_bytes), "cudaMalloc (attention counters)");
    check_cuda(cudaMemsetAsync(attn_counters_, 0, attn_counter_bytes, stream_), "cudaMemsetAsync (attention counters)");
  } catch (...) {
    free_resources();
    throw;
  }
}

CudaBackend::~CudaBackend() { free_resources(); }

void CudaBackend::check_model_shapes(const AttentionParams& a, const GdnParams& g) const {
  auto unsupported = [](const std::string& what, int64_t v, const char* allowed) {
    return Error(ErrorCode::kModelError, "the CUDA backend cannot run this model: " + what + " = " + std::to_string(v) +
                                             " (supported: " + allowed + ")");
  };
  const int64_t hd = a.head_dim, dk = g.k_head_dim;
  if (hd != 32 && hd != 64 && hd != 128 && hd != 256) throw unsupported("head_dim", hd, "32, 64, 128, 256");
  if (a.num_q_heads / a.num_kv_heads > 8) throw unsupported("num_attention_heads / num_key_value_heads", a.num_q_heads / a.num_kv_heads, "at most 8");
  if (dk != 16 && dk != 32 && dk != 64 && dk != 128 && dk != 256)
    throw unsupported("linear_key_head_dim", dk, "16, 32, 64, 128, 256");
}

void CudaBackend::free_resources() noexcept {
  cudaSetDevice(device_);
  if (capturing_ && stream_) {  // abandon an unfinished capture
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);
    if (g) cudaGraphDestroy(g);
    capturing_ = false;
  }
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaGraphExec_t& g : graph_exec_) {
    if (g) cudaGraphExecDestroy(g);
    g = nullptr;
  }
  for (cudaEvent_t& e : time_marks_) {
    if (e) cudaEventDestroy(e);
    e = nullptr;
  }
  if (workspace_) cudaFree(workspace_);
  if (splitk_scratch_) cudaFree(splitk_scratch_);
  splitk_scratch_ = nullptr;
  if (attn_counters_) cudaFree(attn_counters_);
  attn_counters_ = nullptr;
  if (dequant_scratch_) cudaFree(dequant_scratch_);
  dequant_scratch_ = nullptr;
  if (mailbox_host_) cudaFreeHost(mailbox_host_);
  mailbox_host_ = mailbox_device_ = nullptr;
  for (int i = 0; i < 2; ++i) {
    if (staging_[i]) cudaFreeHost(staging_[i]);
    if (staging_done_[i]) cudaEventDestroy(staging_done_[i]);
    staging_[i] = nullptr;
    staging_done_[i] = nullptr;
  }
  if (stream_) cudaStreamDestroy(stream_);
  workspace_ = nullptr;
  stream_ = nullptr;
  cudaGetLastError();
}

void CudaBackend::activate() const {
  int cur = -1;
  check_cuda(cudaGetDevice(&cur), "cudaGetDevice");
  if (cur != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
}

void CudaBackend::reserve_workspace(size_t bytes) {
  if (bytes <= workspace_bytes_) return;
  activate();
  if (workspace_) {
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (reserve_workspace)");
    check_cuda(cudaFree(workspace_), "cudaFree (workspace)");
    workspace_ = nullptr;
    workspace_bytes_ = 0;
  }
  check_cuda(cudaMalloc(&workspace_, bytes), "cudaMalloc (op workspace)");
  workspace_bytes_ = bytes;
}

void* CudaBackend::allocate(size_t bytes) {
  activate();
  void* p = nullptr;
  if (bytes == 0) bytes = 1;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(err == cudaErrorMemoryAllocation ? ErrorCode::kResourceError : ErrorCode::kDeviceError,
                "CUDA backend: cudaMalloc of " + std::to_string(bytes) + " bytes failed: " +
                    cudaGetErrorString(err));
  }
  return p;
}

void CudaBackend::release(void* ptr) {
  if (!ptr) return;
  // Called from destructors: never throws. Pending work may still use the memory.
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaFree(ptr);
  cudaGetLastError();
}

namespace {
// dst[r * ldd + c] = bf16(src[r * cols + c]) for r < rows, c < cols: the device half of an F32 -> BF16
// copy_from_host (round to nearest even, as the host conversion).
__global__ void f32_to_bf16_kernel(const float* __restrict__ src, int64_t rows, int64_t cols, cuda::bf16* __restrict__ dst,
                                   int64_t ldd) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[(i / cols) * ldd + i % cols] = __float2bfloat16_rn(src[i]);
}
}  // namespace

void CudaBackend::copy_from_host(const Tensor& dst, const void* src, DType src_dtype) {
  OCRIA_RT_REQUIRE(dst.device == DeviceKind::CUDA, "copy_from_host", "dst is not a CUDA tensor");
  if (dst.numel() == 0) return;
  OCRIA_RT_REQUIRE(dst.dtype != DType::I32 || src_dtype == DType::I32, "copy_from_host",
                std::string("an I32 destination needs I32 data, got ") + dtype_name(src_dtype));
  activate();
  const RowLayout L = row_layout(dst);
  const size_t esz = dtype_size(dst.dtype), src_esz = dtype_size(src_dtype);
  // F32 data for a BF16 tensor (activations such as image pixels, fp32 checkpoints) crosses the bus
  // as it is, into the op workspace, and a kernel rounds it into dst: the host only copies into the
  // staging buffer. Other conversions happen on the host while staging.
  const bool device_convert = src_dtype == DType::F32 && dst.dtype == DType::BF16;
  const DType staged = device_convert ? DType::F32 : dst.dtype;
  const size_t staged_esz = dtype_size(staged);
  // Rows that do not fit a staging half are split into column pieces.
  const int64_t piece_elems = std::min<int64_t>(L.row_elems, int64_t(kStagingBytes / staged_esz));
  const int64_t rows_per_chunk =
      piece_elems < L.row_elems ? 1 : std::max<int64_t>(1, kStagingBytes / (size_t(L.row_elems) * staged_esz));
  int buf = 0;
  for (int64_t r0 = 0; r0 < L.rows; r0 += rows_per_chunk) {
    const int64_t nr = std::min(rows_per_chunk, L.rows - r0);
    for (int64_t c0 = 0; c0 < L.row_elems; c0 += piece_elems) {
      const int64_t nc = std::min(piece_elems, L.row_elems - c0);
      check_cuda(cudaEventSynchronize(staging_done_[buf]), "cudaEventSynchronize (copy_from_host)");
      for (int64_t r = 0; r < nr; ++r)
        convert_host(static_cast<char*>(staging_[buf]) + size_t(r * nc) * staged_esz, staged,
                     static_cast<const char*>(src) + size_t((r0 + r) * L.row_elems + c0) * src_esz, src_dtype,
                     size_t(nc));
      char* d = static_cast<char*>(dst.data) + size_t(r0 * L.stride + c0) * esz;
      if (device_convert) {
        // The workspace holds one chunk at a time: the stream runs the next chunk's copy into it
        // only after this chunk's kernel has read it.
        const size_t bytes = size_t(nr * nc) * staged_esz;
        check_cuda(cudaMemcpyAsync(workspace_, staging_[buf], bytes, cudaMemcpyHostToDevice, stream_),
                   "cudaMemcpyAsync (copy_from_host)");
        check_cuda(cudaEventRecord(staging_done_[buf], stream_), "cudaEventRecord (copy_from_host)");
        const int64_t blocks = std::min<int64_t>((nr * nc + 255) / 256, int64_t(sm_count_) * 16);
        f32_to_bf16_kernel<<<unsigned(blocks), 256, 0, stream_>>>(static_cast<const float*>(workspace_), nr, nc,
                                                                  reinterpret_cast<cuda::bf16*>(d), L.stride);
        cuda::check_launch("f32_to_bf16_kernel (copy_from_host)");
      } else {
        check_cuda(cudaMemcpy2DAsync(d, size_t(L.stride) * esz, staging_[buf], size_t(nc) * esz, size_t(nc) * esz,
                                     size_t(nr), cudaMemcpyHostToDevice, stream_),
                   "cudaMemcpy2DAsync (copy_from_host)");
        check_cuda(cudaEventRecord(staging_done_[buf], stream_), "cudaEventRecord (copy_from_host)");
      }
      buf ^= 1;
    }
  }
  // The caller's buffer may be freed on return, and the staging buffers reused: wait.
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (copy_from_host)");
}

void CudaBackend::copy_to_host(void* dst, const Tensor& src) {
  OCRIA_RT_REQUIRE(src.device == DeviceKind::CUDA, "copy_to_host", "src is not a CUDA tensor");
  if (src.numel() == 0) return;
  activate();
  const DType host_t = src.dtype == DType::I32 ? DType::I32 : DType::F32;
  const RowLayout L = row_layout(src);
  const size_t esz = dtype_size(src.dtype), host_esz = dtype_size(host_t);
  const int64_t piece_elems = std::min<int64_t>(L.row_elems, int64_t(kStagingBytes / esz));
  const int64_t rows_per_chunk =
      piece_elems < L.row_elems ? 1 : std::max<int64_t>(1, kStagingBytes / (size_t(L.row_elems) * esz));
  for (int64_t r0 = 0; r0 < L.rows; r0 += rows_per_chunk) {
    const int64_t nr = std::min(rows_per_chunk, L.rows - r0);
    for (int64_t c0 = 0; c0 < L.row_elems; c0 += piece_elems) {
      const int64_t nc = std::min(piece_elems, L.row_elems - c0);
      const char* s = static_cast<const char*>(src.data) + size_t(r0 * L.stride + c0) * esz;
      check_cuda(cudaMemcpy2DAsync(staging_[0], size_t(nc) * esz, s, size_t(L.stride) * esz, size_t(nc) * esz,
                                   size_t(nr), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpy2DAsync (copy_to_host)");
      check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (copy_to_host)");
      for (int64_t r = 0; r < nr; ++r)
        convert_host(static_cast<char*>(dst) + size_t((r0 + r) * L.row_elems + c0) * host_esz, host_t,
                     static_cast<const char*>(staging_[0]) + size_t(r * nc) * esz, src.dtype, size_t(nc));
    }
  }
}

void CudaBackend::fill_zero(const Tensor& t) {
  OCRIA_RT_REQUIRE(t.device == DeviceKind::CUDA, "fill_zero", "tensor is not a CUDA tensor");
  if (t.numel() == 0) return;
  activate();
  const RowLayout L = row_layout(t);
  const size_t esz = dtype_size(t.dtype);
  if (L.stride == L.row_elems) {
    check_cuda(cudaMemsetAsync(t.data, 0, size_t(L.rows * L.row_elems) * esz, stream_), "cudaMemsetAsync (fill_zero)");
  } else {
    check_cuda(cudaMemset2DAsync(t.data, size_t(L.stride) * esz, 0, size_t(L.row_elems) * esz, size_t(L.rows), stream_),
               "cudaMemset2DAsync (fill_zero)");
  }
}

namespace {
// One post: the values, then (once they are visible to the host) the tag that announces them. One
// thread: a post is a few dozen words.
__global__ void post_kernel(const int32_t* values, int32_t count, const int32_t* tag, int32_t* mailbox) {
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();
  const int32_t t = *tag;
  if (t < 0) return;
  volatile int32_t* slot = mailbox + (2 + Backend::kMaxPostValues) * (t % Backend::kMailboxSlots);  // {tag, count, values}
  for (int32_t i = 0; i < count; ++i) slot[2 + i] = values[i];
  slot[1] = count;
  __threadfence_system();
  slot[0] = t;
}
}  // namespace

void CudaBackend::post_i32(const Tensor& values, const Tensor& tag) {
  cuda::require_tensor(values, DType::I32, "post_i32", "values");
  cuda::require_tensor(tag, DType::I32, "post_i32", "tag");
  check_post(values, tag);
  activate();
  static_assert(sizeof(Post) == (2 + kMaxPostValues) * sizeof(int32_t), "post_kernel writes a Post as {tag, count, values}");
  cuda::launch_pdl(launch_ctx(), "post_kernel", post_kernel, 1, 1, 0, values.ptr<int32_t>(), int32_t(values.numel()),
                   tag.ptr<int32_t>(), reinterpret_cast<int32_t*>(mailbox_device_));
}

std::vector<int32_t> CudaBackend::wait_post_i32s(int32_t tag) {
  if (tag < 0) throw missing_post(tag);
  activate();
  const volatile Post* slot = mailbox_host_ + tag % kMailboxSlots;
  // Polls the slot; every 64 polls the stream is asked whether it is still busy, so that a failed
  // kernel is reported and a tag that will never come is an error rather than a hang.
  for (int polls = 1;; ++polls) {
    if (slot->tag == tag) {
      std::atomic_thread_fence(std::memory_order_acquire);  // the values were written before the tag
      std::vector<int32_t> values(size_t(slot->count));
      for (size_t i = 0; i < values.size(); ++i) values[i] = slot->values[i];
      return values;
    }
    if (polls % 64 == 0) {
      const cudaError_t busy = cudaStreamQuery(stream_);
      if (busy == cudaSuccess && slot->tag != tag) throw missing_post(tag);
      if (busy != cudaSuccess && busy != cudaErrorNotReady) check_cuda(busy, "cudaStreamQuery (wait_post_i32)");
    }
    std::this_thread::yield();
  }
}

void CudaBackend::clear_posts() {
  synchronize();
  for (int i = 0; i < kMailboxSlots; ++i) mailbox_host_[i] = Post{};
}

void CudaBackend::synchronize() {
  activate();
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

// ---- graphs ----

void CudaBackend::begin_capture() {
  OCRIA_RT_REQUIRE(!capturing_, "begin_capture", "a capture is already in progress");
  activate();
  check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  capturing_ = true;
}

void CudaBackend::end_capture(int slot) {
  OCRIA_RT_REQUIRE(capturing_, "end_capture", "no capture in progress");
  activate();
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  // The capture ends before the slot is checked, so that a bad slot leaves the stream usable.
  check_cuda(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture (an op failed or synchronised during capture?)");
  if (slot < 0 || slot >= kGraphSlots) {
    cudaGraphDestroy(graph);
    cuda::require_failed("end_capture", "graph slot " + std::to_string(slot) + " outside 0.." + std::to_string(kGraphSlots - 1));
  }
  cudaGraphExec_t exec = nullptr;
  size_t num_nodes = 0;
  cudaError_t err = cudaGraphGetNodes(graph, nullptr, &num_nodes);
  int64_t kernels = 0;
  if (err == cudaSuccess) {
    std::vector<cudaGraphNode_t> nodes(num_nodes);
    err = cudaGraphGetNodes(graph, nodes.data(), &num_nodes);
    for (size_t i = 0; err == cudaSuccess && i < num_nodes; ++i) {
      cudaGraphNodeType type;
      err = cudaGraphNodeGetType(nodes[i], &type);
      if (err == cudaSuccess && type == cudaGraphNodeTypeKernel) ++kernels;
    }
  }
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check_cuda(err, "cudaGraphInstantiate");
  if (graph_exec_[slot]) cudaGraphExecDestroy(graph_exec_[slot]);
  graph_exec_[slot] = exec;
  graph_kernels_[slot] = kernels;
}

void CudaBackend::replay(int slot) {
  OCRIA_RT_REQUIRE(slot >= 0 && slot < kGraphSlots && graph_exec_[slot] != nullptr, "replay",
                   "no graph has been captured in slot " + std::to_string(slot));
  activate();
  check_cuda(cudaGraphLaunch(graph_exec_[slot], stream_), "cudaGraphLaunch");
}

int64_t CudaBackend::graph_kernels(int slot) const {
  return slot >= 0 && slot < kGraphSlots ? graph_kernels_[slot] : 0;
}

// ---- timing marks ----

void CudaBackend::mark_time(int i) {
  activate();
  check_cuda(cudaEventRecord(time_marks_[check_mark(i)], stream_), "cudaEventRecord (mark_time)");
}

double CudaBackend::seconds_between_marks(int i, int j) {
  activate();
  check_cuda(cudaEventSynchronize(time_marks_[check_mark(j)]), "cudaEventSynchronize (seconds_between_marks)");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, time_marks_[check_mark(i)], time_marks_[j]), "cudaEventElapsedTime");
  return double(ms) * 1e-3;
}

namespace {
// counter[i] += by over a (possibly row-strided) I32 tensor of rows x cols.
__global__ void increment_kernel(int32_t* counter, int64_t rows, int64_t cols, int64_t stride, int32_t by) {
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x)
    counter[(i / cols) * stride + i % cols] += by;
}
}  // namespace

void CudaBackend::increment(const Tensor& counter, int32_t by) {
  cuda::require_tensor(counter, DType::I32, "increment", "counter");
  if (counter.numel() == 0) return;
  activate();
  const RowLayout L = row_layout(counter);
  const int64_t n = L.rows * L.row_elems;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 1024));
  cuda::launch_pdl(launch_ctx(), "increment_kernel", increment_kernel, blocks, 256, 0, counter.ptr<int32_t>(), L.rows,
                   L.row_elems, L.stride, by);
}

void CudaBackend::copy(const Tensor& dst, const Tensor& src) {
  OCRIA_RT_REQUIRE(dst.device == DeviceKind::CUDA && src.device == DeviceKind::CUDA, "copy", "tensors must be on the device");
  OCRIA_RT_REQUIRE(dst.dtype == src.dtype && dst.numel() == src.numel() && dst.row_size() == src.row_size(), "copy",
                dst.shape_str() + " <- " + src.shape_str() + " (same dtype and shape needed)");
  if (src.numel() == 0) return;
  activate();
  const RowLayout d = row_layout(dst), s = row_layout(src);
  const size_t esz = dtype_size(src.dtype);
  if (d.stride == d.row_elems && s.stride == s.row_elems) {
    check_cuda(cudaMemcpyAsync(dst.data, src.data, size_t(src.numel()) * esz, cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync (copy)");
  } else {
    check_cuda(cudaMemcpy2DAsync(dst.data, size_t(d.stride) * esz, src.data, size_t(s.stride) * esz,
                                 size_t(s.row_elems) * esz, size_t(s.rows), cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpy2DAsync (copy)");
  }
}

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  return std::make_unique<CudaBackend>(device_index);
}

}  // namespace ocria_rt

namespace ocria_rt {
namespace cuda {

RowView row_view(const Tensor& t, int64_t cols, const char* op, const char* name) {
  OCRIA_RT_REQUIRE(t.ndim >= 1 && t.dim(-1) == cols, op,
          std::string(name) + " " + t.shape_str() + " does not end in " + std::to_string(cols));
  RowView v;
  v.cols = cols;
  if (t.ndim == 1) {
    v.rows = 1;
    v.inner = 1;
    v.outer_stride = cols;
    return v;
  }
  v.inner = cols == 0 ? 0 : t.row_size() / cols;
  v.rows = t.shape[0] * v.inner;
  v.outer_stride = t.row_stride;
  return v;
}

}  // namespace cuda
}  // namespace ocria_rt
