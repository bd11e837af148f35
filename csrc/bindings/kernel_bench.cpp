// KernelBench: times single backend ops on device-resident random data, for bench/kernels.py.
// Only the Backend interface is used (no CUDA headers): `iters` calls of an op are captured into a
// graph (where the backend supports graphs) and the graph is replayed `reps` times; each replay is
// timed on the host around replay() + synchronize(), so a figure is the time per call in a stream
// of back-to-back calls (launch gaps included, host launch overhead not). Weights and caches are
// replicated so that a timed sequence streams at least 256 MiB and does not run out of L2.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

#include "ops/ops.h"

namespace py = pybind11;
using namespace ocria_rt;

namespace {

constexpr int64_t kStreamBytes = int64_t(256) << 20;

class KernelBench {
 public:
  explicit KernelBench(const std::string& device)
      : be_(device == "cpu" ? make_cpu_backend(0)
                            : make_cuda_backend(device == "cuda" ? 0 : std::stoi(device.substr(5)))) {}
  ~KernelBench() { release_all(); }

  // Microseconds per call of a linear op on x [M, K] and W [N, K], as the decode step runs it: "linear"
  // (out[M, N] = x W^T), "linear_glu" (W the gate and up rows in the GLU layout, out [M, N / 2] =
  // silu(gate) * up), "rms_norm_linear" / "rms_norm_linear_glu" (the same of x's unit RMSNorm), or
  // "linear_add" (an [M, N] residual += x W^T). fmt: the weight's format, "dense" (the backend's
  // weight dtype), "fp8" or "nvfp4" (random codes, ops.h LinearWeight), with an input_scale if asked.
  std::vector<double> linear(int64_t M, int64_t N, int64_t K, const std::string& op, int iters, int reps,
                             const std::string& fmt, bool input_scale) {
    Scope scope(this);
    std::vector<LinearWeight> ws;
    if (fmt == "dense") {
      ws.resize(copies_for(N * K * dtype_size(be_->weight_dtype())));
      for (auto& w : ws) w.weight = random({N, K}, be_->weight_dtype(), 1.0f / std::sqrt(float(K)));
    } else if (fmt == "fp8" || fmt == "nvfp4") {
      const bool fp8 = fmt == "fp8";
      if (!fp8 && K % LinearWeight::kNvfp4Block != 0)
        throw Error(ErrorCode::kInvalidArgument, "KernelBench.linear: NVFP4 needs K a multiple of 16");
      ws.resize(copies_for(fp8 ? N * K : N * K / 2 + N * K / 16));
      for (auto& w : ws) {
        w.format = fp8 ? LinearWeight::Format::kFp8 : LinearWeight::Format::kNvfp4;
        // FP8: codes of magnitude 0.5 .. 2, either sign; NVFP4: any nibbles, block scales 0.5 .. 2.
        w.weight = fp8 ? random_bytes({N, K}, DType::F8E4M3, 0x8F, 0x30) : random_bytes({N, K / 2}, DType::U8, 0xFF, 0);
        if (!fp8) w.block_scale = random_bytes({N, K / 16}, DType::F8E4M3, 0x0F, 0x30);
        w.row_scale = random({N}, DType::F32, 0.0f, 1.0f / std::sqrt(float(K)));
        if (input_scale) w.input_scale = random({K}, DType::F32, 0.1f, 1.0f);
        be_->prepare_quantized_weight(w);
      }
    } else {
      throw Error(ErrorCode::kInvalidArgument, "KernelBench.linear: unknown weight format '" + fmt + "'");
    }
    const int64_t copies = int64_t(ws.size());
    const DType act = be_->activation_dtype();
    Tensor x = random({M, K}, act, 1.0f), out = alloc({M, N}, act), half = alloc({M, N / 2}, act);
    Tensor normed = alloc({M, K}, act), delta = alloc({M, N}, act);
    const float eps = 1e-6f;
    std::function<void(int)> call;
    if (op == "linear") call = [&](int i) { be_->linear(x, ws[i % copies], out); };
    else if (op == "linear_glu") call = [&](int i) { be_->linear_glu(x, ws[i % copies], out, half); };
    else if (op == "rms_norm_linear") call = [&](int i) { be_->rms_norm_linear(x, eps, ws[i % copies], normed, out); };
    else if (op == "rms_norm_linear_glu")
      call = [&](int i) { be_->rms_norm_linear_glu(x, eps, ws[i % copies], normed, out, half); };
    else if (op == "linear_add") call = [&](int i) { be_->linear_add(x, ws[i % copies], delta, out); };
    else throw Error(ErrorCode::kInvalidArgument, "KernelBench.linear: unknown op '" + op + "'");
    return time(call, iters, reps);
  }

  // Microseconds per call of gdn_recurrent (or gdn_chunked) over T tokens.
  std::vector<double> gdn(int64_t T, int64_t hk, int64_t hv, int64_t dk, int64_t dv, bool chunked, int iters, int reps) {
    Scope scope(this);
    GdnParams p{hk, hv, dk, dv, 4, 1e-6f};
    const int64_t copies = copies_for(hv * dk * dv * 4);
    std::vector<Tensor> states(copies);
    for (auto& s : states) s = random({hv, dk, dv}, DType::F32, 0.05f);
    Tensor qkv = random({T, p.conv_dim()}, be_->activation_dtype(), 1.0f);
    Tensor ba = random({T, 2 * hv}, be_->activation_dtype(), 1.0f);
    Tensor a_log = random({hv}, DType::F32, 0.5f), dt_bias = random({hv}, DType::F32, 0.5f);
    Tensor out = alloc({T, hv * dv}, be_->activation_dtype());
    return time(
        [&](int i) {
          if (chunked) be_->gdn_chunked(qkv, ba, a_log, dt_bias, states[i % copies], p, out);
          else be_->gdn_recurrent(qkv, ba, a_log, dt_bias, states[i % copies], p, out);
        },
        iters, reps);
  }

  // Microseconds per call of gdn_decode over T tokens (conv + recurrence + gated norm): the backend's
  // own (the CUDA fused kernel) or, fused = false, the base class's three ops.
  std::vector<double> gdn_decode(int64_t T, int64_t hk, int64_t hv, int64_t dk, int64_t dv, bool fused, int iters,
                                 int reps) {
    Scope scope(this);
    GdnParams p{hk, hv, dk, dv, 4, 1e-6f};
    const int64_t C = p.conv_dim(), vdim = hv * dv;
    const DType act = be_->activation_dtype();
    const int64_t copies = copies_for((hv * dk * dv + C * 3) * 4);
    std::vector<Tensor> states(copies), conv_states(copies);
    for (int64_t c = 0; c < copies; ++c) {
      states[c] = random({hv, dk, dv}, DType::F32, 0.05f);
      conv_states[c] = random({C, 3}, DType::F32, 1.0f);
    }
    Tensor proj = random({T, C + vdim + 2 * hv}, act, 1.0f), conv_w = random({C, 4}, DType::F32, 0.3f);
    Tensor a_log = random({hv}, DType::F32, 0.5f), dt_bias = random({hv}, DType::F32, 0.5f);
    Tensor norm_w = random({dv}, DType::F32, 1.0f);
    Tensor conv_out = alloc({T, C}, act), o = alloc({T, vdim}, act), out = alloc({T, vdim}, act);
    return time(
        [&](int i) {
          const Tensor &cs = conv_states[i % copies], &st = states[i % copies];
          if (fused) be_->gdn_decode(proj, conv_w, cs, a_log, dt_bias, norm_w, st, p, conv_out, o, out);
          else be_->Backend::gdn_decode(proj, conv_w, cs, a_log, dt_bias, norm_w, st, p, conv_out, o, out);
        },
        iters, reps);
  }

  // Microseconds per call of a speculative block's DeltaNet work on one layer: part "verify"
  // (gdn_verify of T tokens: outputs and replay records, no state written), "commit" (gdn_commit of
  // `keep` of them, keep a device tensor) or "both" (verify then commit, as a step runs them).
  std::vector<double> gdn_verify_commit(int64_t T, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t keep,
                                        const std::string& part, int iters, int reps) {
    if (part != "verify" && part != "commit" && part != "both")
      throw Error(ErrorCode::kInvalidArgument, "KernelBench.gdn_verify_commit: part must be verify, commit or both");
    if (keep < 1 || keep > T)
      throw Error(ErrorCode::kInvalidArgument, "KernelBench.gdn_verify_commit: keep must be in 1..T");
    Scope scope(this);
    GdnParams p{hk, hv, dk, dv, 4, 1e-6f};
    const int64_t C = p.conv_dim(), vdim = hv * dv;
    const DType act = be_->activation_dtype();
    const int64_t copies = copies_for((hv * dk * dv + C * 3) * 4);
    std::vector<Tensor> states(copies), conv_states(copies);
    std::vector<GdnReplay> replays(copies);
    for (int64_t c = 0; c < copies; ++c) {
      states[c] = random({hv, dk, dv}, DType::F32, 0.05f);
      conv_states[c] = random({C, 3}, DType::F32, 1.0f);
      replays[c] = {alloc({T, C}, act), alloc({T, hk * dk}, DType::F32), alloc({T, hv}, DType::F32),
                    alloc({T, vdim}, DType::F32)};
    }
    Tensor proj = random({T, C + vdim + 2 * hv}, act, 1.0f), conv_w = random({C, 4}, DType::F32, 0.3f);
    Tensor a_log = random({hv}, DType::F32, 0.5f), dt_bias = random({hv}, DType::F32, 0.5f);
    Tensor norm_w = random({dv}, DType::F32, 1.0f);
    Tensor conv_out = alloc({T, C}, act), o = alloc({T, vdim}, act), out = alloc({T, vdim}, act);
    Tensor keep_t = alloc({1}, DType::I32);
    const int32_t k32 = int32_t(keep);
    be_->copy_from_host(keep_t, &k32, DType::I32);
    auto verify = [&](int64_t c) {
      be_->gdn_verify(proj, conv_w, conv_states[c], a_log, dt_bias, norm_w, states[c], p, conv_out, o, out, replays[c]);
    };
    if (part == "commit")
      for (int64_t c = 0; c < copies; ++c) verify(c);  // records to commit
    return time(
        [&](int i) {
          const int64_t c = i % copies;
          if (part != "commit") verify(c);
          if (part != "verify") be_->gdn_commit(replays[c], keep_t, p, conv_states[c], states[c]);
        },
        iters, reps);
  }

  // Microseconds per call of attention for T new tokens at the end of a context of `context` rows.
  std::vector<double> attention(int64_t T, int64_t context, int64_t hq, int64_t hkv, int64_t hd, int iters, int reps) {
    Scope scope(this);
    const AttentionParams p = bench_attention_params(hq, hkv, hd);
    const DType act = be_->activation_dtype();
    std::vector<Tensor> kc, vc;
    random_caches(context, hkv, hd, kc, vc);
    const int64_t copies = int64_t(kc.size());
    Tensor q = random({T, hq, hd}, act, 1.0f), qkv = random({T, (2 * hq + 2 * hkv) * hd}, act, 1.0f);
    Tensor out = alloc({T, hq * hd}, act), pos = alloc({T}, DType::I32);
    std::vector<int32_t> positions(T);
    for (int64_t t = 0; t < T; ++t) positions[t] = int32_t(context - T + t);
    be_->copy_from_host(pos, positions.data(), DType::I32);
    return time([&](int i) { be_->attention(q, kc[i % copies], vc[i % copies], qkv, pos, p, out); }, iters, reps);
  }

  // Microseconds per call of attention_decode for T new tokens at the end of a context of `context`
  // rows (q / k norms, RoPE, the cache rows' write, attention): the backend's own (for T = 1 the CUDA
  // one-kernel step) or, fused = false, the base class's attention_prepare + attention.
  std::vector<double> attention_decode(int64_t T, int64_t context, int64_t hq, int64_t hkv, int64_t hd, bool fused,
                                       int iters, int reps) {
    Scope scope(this);
    const AttentionParams p = bench_attention_params(hq, hkv, hd);
    const DType act = be_->activation_dtype();
    std::vector<Tensor> kc, vc;
    random_caches(context, hkv, hd, kc, vc);
    const int64_t copies = int64_t(kc.size());
    Tensor qkv = random({T, (2 * hq + 2 * hkv) * hd}, act, 1.0f);
    Tensor q_norm = random({hd}, DType::F32, 0.1f), k_norm = random({hd}, DType::F32, 0.1f);
    Tensor q = alloc({T, hq, hd}, act), out = alloc({T, hq * hd}, act);
    Tensor pos = alloc({T}, DType::I32), rope_pos = alloc({T, 3}, DType::I32);
    std::vector<int32_t> positions(T), rope_positions(3 * T);
    for (int64_t t = 0; t < T; ++t) {
      positions[t] = int32_t(context - T + t);
      for (int a = 0; a < 3; ++a) rope_positions[3 * t + a] = positions[t];
    }
    be_->copy_from_host(pos, positions.data(), DType::I32);
    be_->copy_from_host(rope_pos, rope_positions.data(), DType::I32);
    return time(
        [&](int i) {
          const Tensor &k = kc[i % copies], &v = vc[i % copies];
          if (fused) be_->attention_decode(qkv, q_norm, k_norm, pos, rope_pos, p, q, k, v, out);
          else be_->Backend::attention_decode(qkv, q_norm, k_norm, pos, rope_pos, p, q, k, v, out);
        },
        iters, reps);
  }

  // Microseconds per call of sample over R rows of V fp32 logits.
  std::vector<double> sample(int64_t R, int64_t V, float temperature, int32_t top_k, float top_p, int iters, int reps) {
    Scope scope(this);
    Tensor logits = random({R, V}, DType::F32, 3.0f), tokens = alloc({R}, DType::I32), step = alloc({1}, DType::I32);
    be_->fill_zero(step);
    SamplerConfig cfg{temperature, top_k, top_p, 1234};
    return time([&](int) { be_->sample(logits, cfg, step, tokens); }, iters, reps);
  }

  // Microseconds per call of a row gather that is a plain copy (embedding with ids 0..rows-1): a
  // bandwidth reference through the backend itself. Bytes moved = 2 * rows * cols * element size.
  std::vector<double> copy(int64_t rows, int64_t cols, int iters, int reps) {
    Scope scope(this);
    const DType act = be_->activation_dtype();
    Tensor table = random({rows, cols}, act, 1.0f), out = alloc({rows, cols}, act), ids = alloc({rows}, DType::I32);
    std::vector<int32_t> v(rows);
    for (int64_t i = 0; i < rows; ++i) v[i] = int32_t(i);
    be_->copy_from_host(ids, v.data(), DType::I32);
    return time([&](int) { be_->embedding(table, ids, out); }, iters, reps);
  }

  const char* name() const { return be_->name(); }

 private:
  // Frees what an op's benchmark allocated when it returns.
  struct Scope {
    explicit Scope(KernelBench* b) : b(b) {}
    ~Scope() { b->release_all(); }
    KernelBench* b;
  };

  static int64_t copies_for(int64_t bytes) { return std::max<int64_t>(1, (kStreamBytes + bytes - 1) / bytes); }

  // The attention benchmarks' shape: partial RoPE on a quarter of each head, rope_theta 1e7 (OCRia-1's).
  static AttentionParams bench_attention_params(int64_t hq, int64_t hkv, int64_t hd) {
    AttentionParams p;
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = hd;
    p.rotary_dim = hd / 4;
    p.rope_theta = 1e7f;
    p.norm_eps = 1e-6f;
    p.scale = float(1.0 / std::sqrt(double(hd)));
    return p;
  }

  // Random K / V caches of `context` rows, as many copies as keep the timed loop out of L2.
  void random_caches(int64_t context, int64_t hkv, int64_t hd, std::vector<Tensor>& kc, std::vector<Tensor>& vc) {
    const DType act = be_->activation_dtype();
    const int64_t copies = copies_for(2 * context * hkv * hd * dtype_size(act));
    for (int64_t c = 0; c < copies; ++c) {
      kc.push_back(random({context, hkv, hd}, act, 1.0f));
      vc.push_back(random({context, hkv, hd}, act, 1.0f));
    }
  }

  Tensor alloc(std::initializer_list<int64_t> dims, DType dtype) {
    Tensor t(nullptr, dtype, be_->device(), dims);
    t.data = be_->allocate(std::max<size_t>(t.nbytes(), 16));
    owned_.push_back(t.data);
    return t;
  }

  // Random bytes of a U8 / F8E4M3 tensor: (next byte & mask) | set.
  Tensor random_bytes(std::initializer_list<int64_t> dims, DType dtype, uint8_t mask, uint8_t set) {
    Tensor t = alloc(dims, dtype);
    std::vector<uint8_t> buf(t.nbytes());
    for (auto& b : buf) b = uint8_t((uint8_t(next() >> 56) & mask) | set);
    be_->copy_from_host(t, buf.data(), dtype);
    return t;
  }

  // offset + pseudo-normal values (sum of uniforms) times `scale`.
  Tensor random(std::initializer_list<int64_t> dims, DType dtype, float offset, float scale) {
    Tensor t = random(dims, dtype, scale);
    const int64_t n = t.numel();
    if (offset != 0.0f && n > 0) {
      std::vector<float> v(size_t(n), 0.0f);
      be_->copy_to_host(v.data(), t);
      for (float& f : v) f = offset + std::fabs(f);
      be_->copy_from_host(t, v.data(), DType::F32);
    }
    return t;
  }

  // Pseudo-normal values (sum of uniforms) times `scale`, uploaded a slab at a time.
  Tensor random(std::initializer_list<int64_t> dims, DType dtype, float scale) {
    Tensor t = alloc(dims, dtype);
    const int64_t n = t.numel(), rows = t.ndim <= 1 ? n : t.dim(0), cols = n / std::max<int64_t>(rows, 1);
    const int64_t slab_rows = std::max<int64_t>(1, (int64_t(1) << 22) / std::max<int64_t>(cols, 1));
    std::vector<float> buf(size_t(std::min(rows, slab_rows) * cols));
    for (int64_t r0 = 0; r0 < rows; r0 += slab_rows) {
      const int64_t nr = std::min(slab_rows, rows - r0);
      for (size_t i = 0; i < size_t(nr * cols); ++i) {
        float s = 0;
        for (int j = 0; j < 4; ++j) s += float(next() >> 40) * (1.0f / 16777216.0f);
        buf[i] = (s - 2.0f) * 1.7320508f * scale;  // sum of 4 U(0,1): variance 1/3
      }
      Tensor part = t.ndim <= 1 ? Tensor(static_cast<char*>(t.data) + r0 * dtype_size(dtype), dtype, t.device, {nr})
                                : t.rows(r0, nr);
      be_->copy_from_host(part, buf.data(), DType::F32);
    }
    return t;
  }

  uint64_t next() {  // xorshift64*
    rng_ ^= rng_ >> 12;
    rng_ ^= rng_ << 25;
    rng_ ^= rng_ >> 27;
    return rng_ * 0x2545F4914F6CDD1Dull;
  }

  std::vector<double> time(const std::function<void(int)>& call, int iters, int reps) {
    iters = std::max(1, iters);
    std::vector<double> us;
    auto run_all = [&] {
      for (int i = 0; i < iters; ++i) call(i);
    };
    const bool graphs = be_->supports_graphs();
    run_all();  // warm-up (module load, first-call attribute setting) outside the capture
    be_->synchronize();
    if (graphs) {
      be_->begin_capture();
      try {
        run_all();
      } catch (...) {
        be_->end_capture(0);
        throw;
      }
      be_->end_capture(0);
      be_->replay(0);
      be_->synchronize();
    }
    for (int r = 0; r < std::max(1, reps); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      if (graphs) be_->replay(0);
      else run_all();
      be_->synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / iters);
    }
    return us;
  }

  void release_all() {
    for (void* p : owned_) be_->release(p);
    owned_.clear();
  }

  std::unique_ptr<Backend> be_;
  std::vector<void*> owned_;
  uint64_t rng_ = 0x9E3779B97F4A7C15ull;
};

}  // namespace

void register_kernel_bench(py::module_& m) {
  py::class_<KernelBench>(m, "KernelBench",
                          "Times single backend ops on device-resident random data (for bench/kernels.py). "
                          "Every method returns microseconds per call, one figure per replay.")
      .def(py::init<const std::string&>(), py::arg("device"))
      .def_property_readonly("name", &KernelBench::name)
      .def("linear", &KernelBench::linear, py::arg("M"), py::arg("N"), py::arg("K"), py::arg("op") = "linear",
           py::arg("iters") = 50, py::arg("reps") = 10, py::arg("fmt") = "dense", py::arg("input_scale") = false)
      .def("gdn", &KernelBench::gdn, py::arg("T"), py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"),
           py::arg("chunked") = false, py::arg("iters") = 50, py::arg("reps") = 10)
      .def("gdn_decode", &KernelBench::gdn_decode, py::arg("T"), py::arg("hk"), py::arg("hv"), py::arg("dk"),
           py::arg("dv"), py::arg("fused") = true, py::arg("iters") = 50, py::arg("reps") = 10)
      .def("gdn_verify_commit", &KernelBench::gdn_verify_commit, py::arg("T"), py::arg("hk"), py::arg("hv"),
           py::arg("dk"), py::arg("dv"), py::arg("keep"), py::arg("part") = "both", py::arg("iters") = 20,
           py::arg("reps") = 10)
      .def("attention", &KernelBench::attention, py::arg("T"), py::arg("context"), py::arg("hq"), py::arg("hkv"),
           py::arg("hd"), py::arg("iters") = 50, py::arg("reps") = 10)
      .def("attention_decode", &KernelBench::attention_decode, py::arg("T"), py::arg("context"), py::arg("hq"),
           py::arg("hkv"), py::arg("hd"), py::arg("fused") = true, py::arg("iters") = 50, py::arg("reps") = 10)
      .def("sample", &KernelBench::sample, py::arg("R"), py::arg("V"), py::arg("temperature"), py::arg("top_k"),
           py::arg("top_p"), py::arg("iters") = 20, py::arg("reps") = 10)
      .def("copy", &KernelBench::copy, py::arg("rows"), py::arg("cols"), py::arg("iters") = 20, py::arg("reps") = 10);
}
