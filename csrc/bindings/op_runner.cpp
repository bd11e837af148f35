// OpRunner: each Backend op on numpy arrays, for the op tests (CPU vs CUDA, fresh random inputs).
// Inputs arrive as fp32 (or int32) arrays and are converted to the backend's dtypes; every output is
// poisoned with NaN before the op runs, and comes back as fp32.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <functional>
#include <optional>
#include <vector>

#include "ops/ops.h"

namespace py = pybind11;
using namespace ocria_rt;

namespace {

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
// Raw bytes: no forcecast, so float arrays are refused rather than converted (pass fp8 data as
// .view(np.uint8)).
using U8Array = py::array_t<uint8_t, py::array::c_style>;

// A quantized linear weight (ops.h LinearWeight) as numpy arrays. format "fp8": weight uint8 [N, K]
// (float8 e4m3fn bits); "nvfp4": weight uint8 [N, K / 2] (E2M1 pairs, element 2j in the low nibble)
// and block_scale uint8 [N, K / 16] (e4m3fn bits). row_scale f32 [N]; input_scale f32 [K] or None.
struct QuantWeight {
  LinearWeight::Format format;
  U8Array weight;
  std::optional<U8Array> block_scale;
  F32Array row_scale;
  std::optional<F32Array> input_scale;

  QuantWeight(const std::string& fmt, U8Array w, std::optional<U8Array> bs, F32Array rs, std::optional<F32Array> is)
      : weight(std::move(w)), block_scale(std::move(bs)), row_scale(std::move(rs)), input_scale(std::move(is)) {
    if (fmt == "fp8") format = LinearWeight::Format::kFp8;
    else if (fmt == "nvfp4") format = LinearWeight::Format::kNvfp4;
    else throw Error(ErrorCode::kInvalidArgument, "QuantWeight: format must be 'fp8' or 'nvfp4', got '" + fmt + "'");
    if ((format == LinearWeight::Format::kNvfp4) != block_scale.has_value())
      throw Error(ErrorCode::kInvalidArgument, "QuantWeight: block_scale is required for 'nvfp4' and only for it");
  }
};

class OpRunner {
 public:
  explicit OpRunner(const std::string& device)
      : be_(device == "cpu" ? make_cpu_backend(0) : make_cuda_backend(device == "cuda" ? 0 : std::stoi(device.substr(5)))) {}
  ~OpRunner() {
    for (void* p : allocations_) be_->release(p);
  }
  const char* name() const { return be_->name(); }

  // Device tensor of `dtype` holding `a` (shape taken from a), or poisoned if a is null.
  Tensor upload(const F32Array& a, DType dtype) {
    Tensor t = alloc_like(a.request().shape, dtype);
    be_->copy_from_host(t, a.data(), DType::F32);
    return t;
  }
  // Device tensor of `dtype` (U8 or F8E4M3) holding the bytes of `a`.
  Tensor upload_raw(const U8Array& a, DType dtype) {
    Tensor t = alloc_like(a.request().shape, dtype);
    be_->copy_from_host(t, a.data(), dtype);
    return t;
  }
  // `w` (a QuantWeight, or an fp32 array [N, K] for a dense weight in the backend's weight dtype)
  // and `bias` uploaded as a LinearWeight.
  LinearWeight upload_weight(const py::object& w, const std::optional<F32Array>& bias) {
    LinearWeight lw;
    if (py::isinstance<QuantWeight>(w)) {
      const QuantWeight& q = w.cast<const QuantWeight&>();
      lw.format = q.format;
      lw.weight = upload_raw(q.weight, q.format == LinearWeight::Format::kFp8 ? DType::F8E4M3 : DType::U8);
      if (q.block_scale) lw.block_scale = upload_raw(*q.block_scale, DType::F8E4M3);
      lw.row_scale = upload(q.row_scale, DType::F32);
      if (q.input_scale) lw.input_scale = upload(*q.input_scale, DType::F32);
      be_->prepare_quantized_weight(lw);
    } else {
      lw.weight = upload(w.cast<F32Array>(), wt());
    }
    if (bias) lw.bias = upload(*bias, DType::F32);
    return lw;
  }
  Tensor upload_i32(const I32Array& a) {
    Tensor t = alloc_like(a.request().shape, DType::I32);
    be_->copy_from_host(t, a.data(), DType::I32);
    return t;
  }
  Tensor poisoned(const std::vector<py::ssize_t>& shape, DType dtype) {
    Tensor t = alloc_like(shape, dtype);
    std::vector<float> nan(size_t(t.numel()), NAN);
    be_->copy_from_host(t, nan.data(), DType::F32);
    return t;
  }
  py::array_t<float> download(const Tensor& t) {
    std::vector<py::ssize_t> shape(t.shape, t.shape + t.ndim);
    py::array_t<float> out(shape);
    be_->copy_to_host(out.mutable_data(), t);
    return out;
  }
  py::array_t<int32_t> download_i32(const Tensor& t) {
    std::vector<py::ssize_t> shape(t.shape, t.shape + t.ndim);
    py::array_t<int32_t> out(shape);
    be_->copy_to_host(out.mutable_data(), t);
    return out;
  }
  DType act() const { return be_->activation_dtype(); }
  DType wt() const { return be_->weight_dtype(); }
  Backend& be() { return *be_; }

 private:
  Tensor alloc_like(const std::vector<py::ssize_t>& shape, DType dtype) {
    if (shape.empty() || shape.size() > 4) throw Error(ErrorCode::kInvalidArgument, "OpRunner: arrays must have 1 to 4 dimensions");
    Tensor t(nullptr, dtype, be_->device(), {});
    t.ndim = int(shape.size());
    for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
    t.row_stride = t.row_size();
    t.data = be_->allocate(std::max<size_t>(t.nbytes(), 16));
    allocations_.push_back(t.data);
    return t;
  }
  std::unique_ptr<Backend> be_;
  std::vector<void*> allocations_;
};

AttentionParams attn_params(int64_t hq, int64_t hkv, int64_t hd, int64_t rot, float theta, float eps,
                            const std::vector<int32_t>& mrope_section = {}) {
  AttentionParams p;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = hd;
  p.rotary_dim = rot;
  p.rope_theta = theta;
  p.norm_eps = eps;
  p.scale = float(1.0 / std::sqrt(double(hd)));
  for (size_t a = 0; a < 3 && a < mrope_section.size(); ++a) p.mrope_section[a] = mrope_section[a];
  return p;
}
GdnParams gdn_params(int64_t hk, int64_t hv, int64_t dk, int64_t dv, float eps) { return {hk, hv, dk, dv, 4, eps}; }

// attention_decode's operands on the runner's backend: the inputs uploaded, q [T, hq, hd] and
// out [T, hq * hd] poisoned.
struct AttentionStep {
  AttentionStep(OpRunner& r, const F32Array& qkv_in, const F32Array& q_norm, const F32Array& k_norm,
                const I32Array& positions, const I32Array& rope_positions, const F32Array& k_cache,
                const F32Array& v_cache, int64_t hq, int64_t hd)
      : qkv(r.upload(qkv_in, r.act())),
        qn(r.upload(q_norm, DType::F32)),
        kn(r.upload(k_norm, DType::F32)),
        pos(r.upload_i32(positions)),
        rpos(r.upload_i32(rope_positions)),
        kc(r.upload(k_cache, r.act())),
        vc(r.upload(v_cache, r.act())),
        q(r.poisoned({qkv_in.shape(0), py::ssize_t(hq), py::ssize_t(hd)}, r.act())),
        out(r.poisoned({qkv_in.shape(0), py::ssize_t(hq * hd)}, r.act())) {}
  Tensor qkv, qn, kn, pos, rpos, kc, vc, q, out;
};

// `step` as a decode loop runs it: where the backend has graphs, captured once here, and the returned
// callable replays the graph; otherwise the callable runs step.
template <class Step> std::function<void()> captured_step(OpRunner& r, Step& step) {
  if (!r.be().supports_graphs()) return [&step] { step(); };
  r.be().begin_capture();
  step();
  r.be().end_capture(0);
  return [&r] { r.be().replay(0); };
}

// `steps` runs of `step` (captured_step). `out` is poisoned before each run and read back after it:
// [steps, *out.shape].
template <class Step> py::array_t<float> run_steps(OpRunner& r, Step&& step, int64_t steps, const Tensor& out) {
  const std::function<void()> run = captured_step(r, step);
  std::vector<py::ssize_t> shape{py::ssize_t(steps)};
  for (int d = 0; d < out.ndim; ++d) shape.push_back(py::ssize_t(out.dim(d)));
  py::array_t<float> result(shape);
  const std::vector<float> nan(size_t(out.numel()), NAN);
  for (int64_t i = 0; i < steps; ++i) {
    r.be().copy_from_host(out, nan.data(), DType::F32);
    run();
    r.be().copy_to_host(result.mutable_data(i), out);
  }
  return result;
}

}  // namespace

void register_op_runner(py::module_& m) {
  py::class_<QuantWeight>(m, "QuantWeight",
                          "A quantized linear weight for OpRunner's ops (ops.h LinearWeight): format 'fp8' "
                          "(weight uint8 [N, K], e4m3fn bits) or 'nvfp4' (weight uint8 [N, K/2], E2M1 pairs, low "
                          "nibble first; block_scale uint8 [N, K/16], e4m3fn bits); row_scale f32 [N]; input_scale "
                          "f32 [K] or None.")
      .def(py::init<const std::string&, U8Array, std::optional<U8Array>, F32Array, std::optional<F32Array>>(),
           py::arg("format"), py::arg("weight"), py::arg("block_scale"), py::arg("row_scale"),
           py::arg("input_scale") = py::none());
  py::class_<OpRunner>(m, "OpRunner", "Runs single ops of a backend on numpy arrays (for tests).")
      .def(py::init<const std::string&>(), py::arg("device"))
      .def_property_readonly("name", &OpRunner::name)
      .def("embedding", [](OpRunner& r, F32Array table, I32Array ids) {
        Tensor t = r.upload(table, r.wt()), i = r.upload_i32(ids), out = r.poisoned({ids.shape(0), table.shape(1)}, r.act());
        r.be().embedding(t, i, out);
        return r.download(out);
      })
      .def(
          "linear",
          [](OpRunner& r, F32Array x, py::object w, std::optional<F32Array> bias, bool out_f32) {
            // w: an fp32 array [N, K] or a QuantWeight (likewise in every op below that takes a weight).
            LinearWeight lw = r.upload_weight(w, bias);
            Tensor xt = r.upload(x, r.act());
            Tensor out = r.poisoned({x.shape(0), lw.out_features()}, out_f32 ? DType::F32 : r.act());
            r.be().linear(xt, lw, out);
            return r.download(out);
          },
          py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("out_f32") = false)
      .def("linear_glu", [](OpRunner& r, F32Array x, py::object w) {
        // w [2I, K]: the gate and up rows in the GLU layout (ops.h). Returns act [M, I].
        LinearWeight lw = r.upload_weight(w, std::nullopt);
        const py::ssize_t M = x.shape(0), N = lw.out_features();
        Tensor scratch = r.poisoned({M, N}, r.act()), act = r.poisoned({M, N / 2}, r.act());
        r.be().linear_glu(r.upload(x, r.act()), lw, scratch, act);
        return r.download(act);
      })
      .def(
          "rms_norm",
          [](OpRunner& r, F32Array x, std::optional<F32Array> w, float eps) {
            // w None: the unit weight (a norm whose weight is folded into the next linear).
            Tensor xt = r.upload(x, r.act()), out = r.poisoned({x.shape(0), x.shape(1)}, r.act());
            r.be().rms_norm(xt, w ? r.upload(*w, DType::F32) : Tensor(), out, eps);
            return r.download(out);
          },
          py::arg("x"), py::arg("w"), py::arg("eps"))
      .def("fold_norm_weight", [](OpRunner& r, F32Array w, F32Array norm_w) {
        // W [N, K] as the backend stores it after the fold, read back.
        Tensor wt = r.upload(w, r.wt());
        r.be().fold_norm_weight(wt, r.upload(norm_w, DType::F32));
        return r.download(wt);
      })
      .def(
          "rms_norm_linear",
          [](OpRunner& r, F32Array x, py::object w, float eps, std::optional<F32Array> bias, bool glu) {
            // rms_norm(x, unit) · W^T, or with glu its silu(gate) * up (W in the GLU layout). W is taken
            // as already folded. Returns (out, normed): `normed` comes back NaN where it was not written.
            LinearWeight lw = r.upload_weight(w, bias);
            const py::ssize_t M = x.shape(0), N = lw.out_features();
            Tensor xt = r.upload(x, r.act()), normed = r.poisoned({M, x.shape(1)}, r.act());
            Tensor out = r.poisoned({M, glu ? N / 2 : N}, r.act());
            if (glu) r.be().rms_norm_linear_glu(xt, eps, lw, normed, r.poisoned({M, N}, r.act()), out);
            else r.be().rms_norm_linear(xt, eps, lw, normed, out);
            return py::make_tuple(r.download(out), r.download(normed));
          },
          py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("bias") = py::none(), py::arg("glu") = false)
      .def(
          "linear_add",
          [](OpRunner& r, F32Array x, py::object w, F32Array residual, std::optional<F32Array> bias) {
            // residual += x · W^T; returns the residual.
            LinearWeight lw = r.upload_weight(w, bias);
            Tensor res = r.upload(residual, r.act());
            r.be().linear_add(r.upload(x, r.act()), lw, r.poisoned({x.shape(0), lw.out_features()}, r.act()), res);
            return r.download(res);
          },
          py::arg("x"), py::arg("w"), py::arg("residual"), py::arg("bias") = py::none())
      .def("block_chain", [](OpRunner& r, F32Array residual, py::object w_gate_up, py::object w_down, int layers,
                             float eps) {
        // `layers` MLP residual blocks, residual += down(silu(gate) * up of rms_norm(residual, unit)),
        // then the final rms_norm(residual, unit), all enqueued before anything is read back: dependent
        // kernels back to back, as in a decode step. Returns (residual, normed).
        LinearWeight gu = r.upload_weight(w_gate_up, std::nullopt), down = r.upload_weight(w_down, std::nullopt);
        const py::ssize_t M = residual.shape(0), H = residual.shape(1), I2 = gu.out_features();
        Tensor res = r.upload(residual, r.act());
        Tensor normed = r.poisoned({M, H}, r.act()), gate_up = r.poisoned({M, I2}, r.act());
        Tensor act = r.poisoned({M, I2 / 2}, r.act()), delta = r.poisoned({M, H}, r.act());
        for (int i = 0; i < layers; ++i) {
          r.be().rms_norm_linear_glu(res, eps, gu, normed, gate_up, act);
          r.be().linear_add(act, down, delta, res);
        }
        r.be().rms_norm(res, Tensor(), normed, eps);
        return py::make_tuple(r.download(res), r.download(normed));
      })
      .def("layer_norm", [](OpRunner& r, F32Array x, F32Array w, F32Array b, float eps) {
        Tensor out = r.poisoned({x.shape(0), x.shape(1)}, r.act());
        r.be().layer_norm(r.upload(x, r.act()), r.upload(w, DType::F32), r.upload(b, DType::F32), out, eps);
        return r.download(out);
      })
      .def("gelu", [](OpRunner& r, F32Array x, bool tanh_approximation) {
        Tensor out = r.poisoned({x.shape(0), x.shape(1)}, r.act());
        r.be().gelu(r.upload(x, r.act()), out, tanh_approximation);
        return r.download(out);
      })
      .def("gather_blend_add", [](OpRunner& r, F32Array table, I32Array rows, F32Array weights, F32Array x, int64_t n,
                                  int64_t d, bool f32_table) {
        // x [R, C] is updated in its top-left [n, d] block, a row-strided view: the rest must come
        // back as it went in. The table is F32 (as the vision encoder keeps it) or the activation dtype.
        Tensor xt = r.upload(x, r.act());
        r.be().gather_blend_add(r.upload(table, f32_table ? DType::F32 : r.act()), r.upload_i32(rows),
                                r.upload(weights, DType::F32), xt.rows(0, n).cols(0, d));
        return r.download(xt);
      }, py::arg("table"), py::arg("rows"), py::arg("weights"), py::arg("x"), py::arg("n"), py::arg("d"),
         py::arg("f32_table") = true)
      .def("vision_attention", [](OpRunner& r, F32Array qkv, I32Array patch_pos, I32Array cu_seqlens, int64_t heads,
                                  float theta) {
        Tensor out = r.poisoned({qkv.shape(0), qkv.shape(1) / 3}, r.act());
        r.be().vision_attention(r.upload(qkv, r.act()), r.upload_i32(patch_pos), r.upload_i32(cu_seqlens), heads, theta,
                                out);
        return r.download(out);
      })
      .def("silu_mul", [](OpRunner& r, F32Array gate_up) {
        Tensor out = r.poisoned({gate_up.shape(0), gate_up.shape(1) / 2}, r.act());
        r.be().silu_mul(r.upload(gate_up, r.act()), out);
        return r.download(out);
      })
      .def("attention_prepare",
           [](OpRunner& r, F32Array qkv, F32Array q_norm, F32Array k_norm, I32Array positions, I32Array rope_positions,
              F32Array k_cache, F32Array v_cache, int64_t hq, int64_t hkv, int64_t hd, int64_t rot, float theta, float eps,
              std::vector<int32_t> mrope_section) {
             AttentionParams p = attn_params(hq, hkv, hd, rot, theta, eps, mrope_section);
             Tensor q = r.poisoned({qkv.shape(0), hq, hd}, r.act());
             Tensor kc = r.upload(k_cache, r.act()), vc = r.upload(v_cache, r.act());
             r.be().attention_prepare(r.upload(qkv, r.act()), r.upload(q_norm, DType::F32), r.upload(k_norm, DType::F32),
                                      r.upload_i32(positions), r.upload_i32(rope_positions), p, q, kc, vc);
             return py::make_tuple(r.download(q), r.download(kc), r.download(vc));
           },
           py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("positions"), py::arg("rope_positions"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("hq"), py::arg("hkv"), py::arg("hd"), py::arg("rot"),
           py::arg("theta"), py::arg("eps"), py::arg("mrope_section") = std::vector<int32_t>{})
      .def("attention",
           [](OpRunner& r, F32Array q, F32Array k_cache, F32Array v_cache, F32Array qkv, I32Array positions, int64_t hq,
              int64_t hkv, int64_t hd) {
             AttentionParams p = attn_params(hq, hkv, hd, hd, 10000.0f, 1e-6f);
             Tensor out = r.poisoned({q.shape(0), hq * hd}, r.act());
             r.be().attention(r.upload(q, r.act()), r.upload(k_cache, r.act()), r.upload(v_cache, r.act()),
                              r.upload(qkv, r.act()), r.upload_i32(positions), p, out);
             return r.download(out);
           })
      .def("attention_steps",
           [](OpRunner& r, F32Array q, F32Array k_cache, F32Array v_cache, F32Array qkv, I32Array positions, int64_t hq,
              int64_t hkv, int64_t hd, int64_t steps, int32_t advance) {
             // `steps` runs (run_steps) of one attention op on the same tensors, the positions advancing
             // by `advance` (on the device) after each, as in a decode step. Returns [steps, T, hq * hd].
             AttentionParams p = attn_params(hq, hkv, hd, hd, 10000.0f, 1e-6f);
             const py::ssize_t T = q.shape(0);
             Tensor qt = r.upload(q, r.act()), kc = r.upload(k_cache, r.act()), vc = r.upload(v_cache, r.act());
             Tensor g = r.upload(qkv, r.act()), pos = r.upload_i32(positions), out = r.poisoned({T, hq * hd}, r.act());
             auto step = [&] {
               r.be().attention(qt, kc, vc, g, pos, p, out);
               r.be().increment(pos, advance);
             };
             return run_steps(r, step, steps, out);
           },
           py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("qkv"), py::arg("positions"), py::arg("hq"),
           py::arg("hkv"), py::arg("hd"), py::arg("steps"), py::arg("advance"))
      .def("attention_decode",
           [](OpRunner& r, F32Array qkv, F32Array q_norm, F32Array k_norm, I32Array positions, I32Array rope_positions,
              F32Array k_cache, F32Array v_cache, int64_t hq, int64_t hkv, int64_t hd, int64_t rot, float theta, float eps,
              std::vector<int32_t> mrope_section, bool fused) {
             // attention_prepare + attention as the one op the model calls; fused = false runs the base
             // class's two ops instead of a backend's own attention_decode. Returns (q, k_cache, v_cache,
             // out): q comes back NaN where the backend did not write it.
             AttentionParams p = attn_params(hq, hkv, hd, rot, theta, eps, mrope_section);
             AttentionStep a(r, qkv, q_norm, k_norm, positions, rope_positions, k_cache, v_cache, hq, hd);
             if (fused) r.be().attention_decode(a.qkv, a.qn, a.kn, a.pos, a.rpos, p, a.q, a.kc, a.vc, a.out);
             else r.be().Backend::attention_decode(a.qkv, a.qn, a.kn, a.pos, a.rpos, p, a.q, a.kc, a.vc, a.out);
             return py::make_tuple(r.download(a.q), r.download(a.kc), r.download(a.vc), r.download(a.out));
           },
           py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("positions"), py::arg("rope_positions"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("hq"), py::arg("hkv"), py::arg("hd"), py::arg("rot"),
           py::arg("theta"), py::arg("eps"), py::arg("mrope_section") = std::vector<int32_t>{}, py::arg("fused") = true)
      .def("attention_decode_steps",
           [](OpRunner& r, F32Array qkv, F32Array q_norm, F32Array k_norm, I32Array positions, I32Array rope_positions,
              F32Array k_cache, F32Array v_cache, int64_t hq, int64_t hkv, int64_t hd, int64_t rot, float theta, float eps,
              std::vector<int32_t> mrope_section, int64_t steps, int32_t advance) {
             // `steps` runs (run_steps) of attention_decode on the same tensors, the positions and rope
             // positions advancing by `advance` (on the device) after each, as in a decode step. Each run
             // writes its cache row. Returns (out [steps, T, hq * hd], k_cache, v_cache).
             AttentionParams p = attn_params(hq, hkv, hd, rot, theta, eps, mrope_section);
             AttentionStep a(r, qkv, q_norm, k_norm, positions, rope_positions, k_cache, v_cache, hq, hd);
             auto step = [&] {
               r.be().attention_decode(a.qkv, a.qn, a.kn, a.pos, a.rpos, p, a.q, a.kc, a.vc, a.out);
               r.be().increment(a.pos, advance);
               r.be().increment(a.rpos, advance);
             };
             py::array_t<float> outs = run_steps(r, step, steps, a.out);
             return py::make_tuple(outs, r.download(a.kc), r.download(a.vc));
           },
           py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("positions"), py::arg("rope_positions"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("hq"), py::arg("hkv"), py::arg("hd"), py::arg("rot"),
           py::arg("theta"), py::arg("eps"), py::arg("mrope_section"), py::arg("steps"), py::arg("advance"))
      .def("gdn_conv", [](OpRunner& r, F32Array x, F32Array w, F32Array state) {
        Tensor st = r.upload(state, DType::F32), out = r.poisoned({x.shape(0), x.shape(1)}, r.act());
        r.be().gdn_conv(r.upload(x, r.act()), r.upload(w, DType::F32), st, out);
        return py::make_tuple(r.download(out), r.download(st));
      })
      .def("gdn",
           [](OpRunner& r, F32Array qkv, F32Array ba, F32Array A_log, F32Array dt_bias, F32Array state, int64_t hk,
              int64_t hv, int64_t dk, int64_t dv, bool chunked) {
             GdnParams p = gdn_params(hk, hv, dk, dv, 1e-6f);
             Tensor st = r.upload(state, DType::F32), out = r.poisoned({qkv.shape(0), hv * dv}, r.act());
             Tensor q = r.upload(qkv, r.act()), b = r.upload(ba, r.act()), a = r.upload(A_log, DType::F32),
                    d = r.upload(dt_bias, DType::F32);
             if (chunked) r.be().gdn_chunked(q, b, a, d, st, p, out);
             else r.be().gdn_recurrent(q, b, a, d, st, p, out);
             return py::make_tuple(r.download(out), r.download(st));
           },
           py::arg("qkv"), py::arg("ba"), py::arg("A_log"), py::arg("dt_bias"), py::arg("state"), py::arg("hk"),
           py::arg("hv"), py::arg("dk"), py::arg("dv"), py::arg("chunked"))
      .def("gdn_decode",
           [](OpRunner& r, F32Array proj, F32Array conv_w, F32Array conv_state, F32Array A_log, F32Array dt_bias,
              F32Array norm_w, F32Array state, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t calls,
              int64_t pad, bool fused) {
             // `calls` gdn_decode ops back to back on consecutive row blocks of proj [calls * T, width + pad],
             // carrying both states, as consecutive decode steps do. proj and out are column ranges of
             // wider buffers (pad extra columns), as the model passes them. fused = false runs the base
             // class's three ops instead of a backend's own gdn_decode. Returns (out, conv_state, state).
             GdnParams p = gdn_params(hk, hv, dk, dv, 1e-6f);
             p.conv_kernel = conv_w.shape(1);
             const py::ssize_t rows = proj.shape(0), width = proj.shape(1) - pad, T = rows / calls;
             const int64_t vdim = hv * dv;
             Tensor pr = r.upload(proj, r.act()).cols(0, width);
             Tensor cw = r.upload(conv_w, DType::F32), cs = r.upload(conv_state, DType::F32),
                    st = r.upload(state, DType::F32), a = r.upload(A_log, DType::F32), d = r.upload(dt_bias, DType::F32),
                    nw = r.upload(norm_w, DType::F32);
             Tensor out = r.poisoned({rows, vdim + pad}, r.act()).cols(0, vdim);
             Tensor conv_out = r.poisoned({T, p.conv_dim()}, r.act()), o = r.poisoned({T, vdim}, r.act());
             for (int64_t i = 0; i < calls; ++i) {
               const Tensor pi = pr.rows(i * T, T), oi = out.rows(i * T, T);
               if (fused) r.be().gdn_decode(pi, cw, cs, a, d, nw, st, p, conv_out, o, oi);
               else r.be().Backend::gdn_decode(pi, cw, cs, a, d, nw, st, p, conv_out, o, oi);
             }
             return py::make_tuple(r.download(out), r.download(cs), r.download(st));
           },
           py::arg("proj"), py::arg("conv_w"), py::arg("conv_state"), py::arg("A_log"), py::arg("dt_bias"),
           py::arg("norm_w"), py::arg("state"), py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"),
           py::arg("calls"), py::arg("pad"), py::arg("fused"))
      .def("gdn_gated_norm", [](OpRunner& r, F32Array o, F32Array z, F32Array w, int64_t hv, int64_t dv, float eps) {
        GdnParams p = gdn_params(1, hv, 1, dv, eps);
        Tensor out = r.poisoned({o.shape(0), o.shape(1)}, r.act());
        r.be().gdn_gated_norm(r.upload(o, r.act()), r.upload(z, r.act()), r.upload(w, DType::F32), p, out);
        return r.download(out);
      })
      .def("post_steps",
           [](OpRunner& r, int32_t value, int32_t tag, int64_t steps, const std::vector<int32_t>& wait_tags, bool drain) {
             // `steps` steps (captured_step) that each post (value, tag) and then advance value by 3 and
             // tag by 1 on the device, queued without a wait;
             // then (after draining the queue, if `drain`) the values waited for under wait_tags, in order.
             r.be().clear_posts();
             I32Array init(std::vector<py::ssize_t>{2});
             init.mutable_data()[0] = value;
             init.mutable_data()[1] = tag;
             Tensor vt = r.upload_i32(init), v = vt.rows(0, 1), t = vt.rows(1, 1);
             auto step = [&] {
               r.be().post_i32(v, t);
               r.be().increment(v, 3);
               r.be().increment(t, 1);
             };
             const std::function<void()> run = captured_step(r, step);
             for (int64_t i = 0; i < steps; ++i) run();
             if (drain) r.be().synchronize();
             std::vector<int32_t> got;
             for (int32_t w : wait_tags) got.push_back(r.be().wait_post_i32(w));
             return got;
           },
           py::arg("value"), py::arg("tag"), py::arg("steps"), py::arg("wait_tags"), py::arg("drain") = false)
      .def("post_vector_steps",
           [](OpRunner& r, const std::vector<int32_t>& values, int32_t tag, int64_t steps,
              const std::vector<int32_t>& wait_tags, bool drain) {
             // `steps` steps (captured_step) that each post the vector `values` under `tag`, then add 1 to
             // every value and to the tag on the device, queued without a wait; then (after draining the
             // queue, if `drain`) the vectors waited for under wait_tags, in order.
             r.be().clear_posts();
             I32Array init(std::vector<py::ssize_t>{py::ssize_t(values.size()) + 1});
             std::copy(values.begin(), values.end(), init.mutable_data());
             init.mutable_data()[values.size()] = tag;
             const Tensor all = r.upload_i32(init), v = all.rows(0, int64_t(values.size())),
                          t = all.rows(int64_t(values.size()), 1);
             auto step = [&] {
               r.be().post_i32(v, t);
               r.be().increment(all, 1);
             };
             const std::function<void()> run = captured_step(r, step);
             for (int64_t i = 0; i < steps; ++i) run();
             if (drain) r.be().synchronize();
             std::vector<std::vector<int32_t>> got;
             for (int32_t w : wait_tags) got.push_back(r.be().wait_post_i32s(w));
             return got;
           },
           py::arg("values"), py::arg("tag"), py::arg("steps"), py::arg("wait_tags"), py::arg("drain") = false)
      .def("post_vector",
           [](OpRunner& r, const std::vector<int32_t>& values, int32_t tag) {
             // One post of `values` under `tag`, then the vector waited for under that tag.
             r.be().clear_posts();
             I32Array init(std::vector<py::ssize_t>{py::ssize_t(values.size()) + 1});
             std::copy(values.begin(), values.end(), init.mutable_data());
             init.mutable_data()[values.size()] = tag;
             const Tensor all = r.upload_i32(init);
             r.be().post_i32(all.rows(0, int64_t(values.size())), all.rows(int64_t(values.size()), 1));
             return r.be().wait_post_i32s(tag);
           })
      .def("speculative_advance",
           [](OpRunner& r, int32_t count, I32Array tokens, I32Array positions, I32Array rope_positions,
              I32Array draft_ids, I32Array verify_ids, int32_t step) {
             // Returns (positions, rope_positions, draft_ids, verify_ids, step) after the op.
             I32Array c(std::vector<py::ssize_t>{1}), st(std::vector<py::ssize_t>{1});
             c.mutable_data()[0] = count;
             st.mutable_data()[0] = step;
             Tensor pos = r.upload_i32(positions), rope = r.upload_i32(rope_positions), d = r.upload_i32(draft_ids),
                    v = r.upload_i32(verify_ids), s = r.upload_i32(st);
             r.be().speculative_advance(r.upload_i32(c), r.upload_i32(tokens), pos, rope, d, v, s);
             return py::make_tuple(r.download_i32(pos), r.download_i32(rope), r.download_i32(d), r.download_i32(v),
                                   r.download_i32(s).data()[0]);
           })
      .def("gdn_verify_commit",
           [](OpRunner& r, F32Array proj, F32Array conv_w, F32Array conv_state, F32Array A_log, F32Array dt_bias,
              F32Array norm_w, F32Array state, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int32_t keep, int64_t pad) {
             // gdn_verify of the T tokens of proj [T, width + pad] (a column range, as the model passes it),
             // then gdn_commit of the first `keep`. Returns (out, conv_state and state after the verify,
             // conv_state and state after the commit).
             GdnParams p = gdn_params(hk, hv, dk, dv, 1e-6f);
             p.conv_kernel = conv_w.shape(1);
             const py::ssize_t T = proj.shape(0), width = proj.shape(1) - pad, C = p.conv_dim(), vdim = hv * dv;
             Tensor pr = r.upload(proj, r.act()).cols(0, width);
             Tensor cw = r.upload(conv_w, DType::F32), cs = r.upload(conv_state, DType::F32),
                    st = r.upload(state, DType::F32), a = r.upload(A_log, DType::F32), d = r.upload(dt_bias, DType::F32),
                    nw = r.upload(norm_w, DType::F32);
             Tensor out = r.poisoned({T, vdim}, r.act()), conv_out = r.poisoned({T, C}, r.act()),
                    o = r.poisoned({T, vdim}, r.act());
             GdnReplay replay{r.poisoned({T, C}, r.act()), r.poisoned({T, hk * dk}, DType::F32),
                              r.poisoned({T, hv}, DType::F32), r.poisoned({T, vdim}, DType::F32)};
             r.be().gdn_verify(pr, cw, cs, a, d, nw, st, p, conv_out, o, out, replay);
             py::array_t<float> cs_verify = r.download(cs), st_verify = r.download(st);
             I32Array k(std::vector<py::ssize_t>{1});
             k.mutable_data()[0] = keep;
             r.be().gdn_commit(replay, r.upload_i32(k), p, cs, st);
             return py::make_tuple(r.download(out), cs_verify, st_verify, r.download(cs), r.download(st));
           },
           py::arg("proj"), py::arg("conv_w"), py::arg("conv_state"), py::arg("A_log"), py::arg("dt_bias"),
           py::arg("norm_w"), py::arg("state"), py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"),
           py::arg("keep"), py::arg("pad") = 0)
      .def("gdn_verify_commit_replay",
           [](OpRunner& r, F32Array proj, F32Array conv_w, F32Array conv_state, F32Array A_log, F32Array dt_bias,
              F32Array norm_w, F32Array state, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
              const std::vector<int32_t>& keeps) {
             // One step (captured_step: a CUDA graph where the backend has graphs) that restores both states
             // from copies of the inputs, runs gdn_verify of proj's T tokens and gdn_commit of keep[0] of
             // them, keep being a device tensor set before each run to the next of `keeps`. Returns (out
             // [n, T, HV*dv], conv_state [n, C, K-1], state [n, HV, dk, dv]) after each run.
             GdnParams p = gdn_params(hk, hv, dk, dv, 1e-6f);
             p.conv_kernel = conv_w.shape(1);
             const py::ssize_t T = proj.shape(0), C = p.conv_dim(), vdim = hv * dv, n = py::ssize_t(keeps.size());
             Tensor pr = r.upload(proj, r.act());
             Tensor cw = r.upload(conv_w, DType::F32), cs0 = r.upload(conv_state, DType::F32),
                    st0 = r.upload(state, DType::F32), a = r.upload(A_log, DType::F32), d = r.upload(dt_bias, DType::F32),
                    nw = r.upload(norm_w, DType::F32);
             Tensor cs = r.poisoned({C, py::ssize_t(p.conv_kernel - 1)}, DType::F32),
                    st = r.poisoned({py::ssize_t(hv), py::ssize_t(dk), py::ssize_t(dv)}, DType::F32);
             Tensor out = r.poisoned({T, vdim}, r.act()), conv_out = r.poisoned({T, C}, r.act()),
                    o = r.poisoned({T, vdim}, r.act());
             GdnReplay replay{r.poisoned({T, C}, r.act()), r.poisoned({T, hk * dk}, DType::F32),
                              r.poisoned({T, hv}, DType::F32), r.poisoned({T, vdim}, DType::F32)};
             Tensor keep = r.upload_i32(I32Array(std::vector<py::ssize_t>{1}));
             auto step = [&] {
               r.be().copy(cs, cs0);
               r.be().copy(st, st0);
               r.be().gdn_verify(pr, cw, cs, a, d, nw, st, p, conv_out, o, out, replay);
               r.be().gdn_commit(replay, keep, p, cs, st);
             };
             const std::function<void()> run = captured_step(r, step);
             py::array_t<float> outs({n, T, py::ssize_t(vdim)}), conv_states({n, C, py::ssize_t(p.conv_kernel - 1)}),
                 states({n, py::ssize_t(hv), py::ssize_t(dk), py::ssize_t(dv)});
             for (py::ssize_t i = 0; i < n; ++i) {
               r.be().copy_from_host(keep, &keeps[size_t(i)], DType::I32);
               run();
               r.be().copy_to_host(outs.mutable_data(i), out);
               r.be().copy_to_host(conv_states.mutable_data(i), cs);
               r.be().copy_to_host(states.mutable_data(i), st);
             }
             return py::make_tuple(outs, conv_states, states);
           },
           py::arg("proj"), py::arg("conv_w"), py::arg("conv_state"), py::arg("A_log"), py::arg("dt_bias"),
           py::arg("norm_w"), py::arg("state"), py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"),
           py::arg("keeps"))
      .def("draft_store_kv",
           [](OpRunner& r, F32Array kv, F32Array k_norm, I32Array positions, F32Array k_cache, F32Array v_cache,
              int64_t hkv, int64_t hd, float theta, float eps) {
             AttentionParams p = attn_params(1, hkv, hd, hd, theta, eps);
             Tensor kc = r.upload(k_cache, r.act()), vc = r.upload(v_cache, r.act());
             r.be().draft_store_kv(r.upload(kv, r.act()), r.upload(k_norm, DType::F32), r.upload_i32(positions), p, kc, vc);
             return py::make_tuple(r.download(kc), r.download(vc));
           })
      .def("draft_attention",
           [](OpRunner& r, F32Array q, F32Array q_norm, I32Array positions, F32Array k_cache, F32Array v_cache, int64_t hq,
              int64_t hkv, int64_t hd, float theta, float eps, bool causal, int64_t window) {
             AttentionParams p = attn_params(hq, hkv, hd, hd, theta, eps);
             Tensor out = r.poisoned({q.shape(0), hq * hd}, r.act());
             r.be().draft_attention(r.upload(q, r.act()), r.upload(q_norm, DType::F32), r.upload_i32(positions),
                                    r.upload(k_cache, r.act()), r.upload(v_cache, r.act()), p, DraftMask{causal, window}, out);
             return r.download(out);
           })
      .def("dynamic_conv", [](OpRunner& r, F32Array x, F32Array dyn, F32Array base, int64_t group) {
        Tensor out = r.poisoned({x.shape(0), x.shape(1)}, r.act());
        r.be().dynamic_conv(r.upload(x, r.act()), r.upload(dyn, r.act()), r.upload(base, DType::F32), group, out);
        return r.download(out);
      })
      .def("scale_softcap", [](OpRunner& r, F32Array x, float multiplier, float softcap) {
        Tensor t = r.upload(x, r.act());
        r.be().scale_softcap(t, multiplier, softcap);
        return r.download(t);
      })
      .def("selector_walk",
           [](OpRunner& r, F32Array logits, F32Array h, F32Array pred, F32Array succ, int32_t anchor, int64_t top_k,
              float temperature, uint64_t seed, int32_t step) {
             // Returns (tokens, candidates, candidate probabilities).
             const py::ssize_t R = logits.shape(0);
             I32Array a(std::vector<py::ssize_t>{1}), st(std::vector<py::ssize_t>{1});
             a.mutable_data()[0] = anchor;
             st.mutable_data()[0] = step;
             Tensor tokens = r.upload_i32(I32Array(std::vector<py::ssize_t>{R})),
                    cand = r.upload_i32(I32Array(std::vector<py::ssize_t>{R, py::ssize_t(top_k)}));
             Tensor prob = r.poisoned({R, py::ssize_t(top_k)}, DType::F32);
             r.be().selector_walk(r.upload(logits, r.act()), r.upload(h, r.act()), r.upload(pred, r.wt()),
                                  r.upload(succ, r.wt()), r.upload_i32(a), temperature, seed, r.upload_i32(st), tokens, cand,
                                  prob);
             return py::make_tuple(r.download_i32(tokens), r.download_i32(cand), r.download(prob));
           })
      .def("speculative_accept",
           [](OpRunner& r, F32Array logits, I32Array draft, I32Array cand, F32Array cand_prob, float temperature,
              int32_t top_k, float top_p, uint64_t seed, int32_t step) {
             // Returns (emitted tokens, their count, the advanced step).
             SamplerConfig c{temperature, top_k, top_p, seed};
             I32Array st(std::vector<py::ssize_t>{1});
             st.mutable_data()[0] = step;
             Tensor stt = r.upload_i32(st), out = r.upload_i32(I32Array(std::vector<py::ssize_t>{logits.shape(0)})),
                    count = r.upload_i32(I32Array(std::vector<py::ssize_t>{1}));
             r.be().speculative_accept(r.upload(logits, r.act()), r.upload_i32(draft), r.upload_i32(cand),
                                       r.upload(cand_prob, DType::F32), c, stt, out, count);
             const int32_t n = r.download_i32(count).data()[0];
             py::array_t<int32_t> emitted = r.download_i32(out);
             return py::make_tuple(emitted[py::slice(0, n, 1)], n, r.download_i32(stt).data()[0]);
           })
      .def("selector_walk_steps",
           [](OpRunner& r, F32Array logits, F32Array h, F32Array pred, F32Array succ, int32_t anchor, int64_t top_k,
              float temperature, uint64_t seed, int32_t step, int64_t steps) {
             // `steps` runs of one step (captured_step) of selector_walk followed by step += R on the device.
             // Returns (tokens [steps, R], candidates [steps, R, K], probabilities [steps, R, K]).
             const py::ssize_t R = logits.shape(0), K = py::ssize_t(top_k);
             I32Array a(std::vector<py::ssize_t>{1}), st(std::vector<py::ssize_t>{1});
             a.mutable_data()[0] = anchor;
             st.mutable_data()[0] = step;
             Tensor lt = r.upload(logits, r.act()), ht = r.upload(h, r.act()), pt = r.upload(pred, r.wt()),
                    su = r.upload(succ, r.wt()), at = r.upload_i32(a), stt = r.upload_i32(st);
             Tensor tokens = r.upload_i32(I32Array(std::vector<py::ssize_t>{R})),
                    cand = r.upload_i32(I32Array(std::vector<py::ssize_t>{R, K}));
             Tensor prob = r.poisoned({R, K}, DType::F32);
             auto one = [&] {
               r.be().selector_walk(lt, ht, pt, su, at, temperature, seed, stt, tokens, cand, prob);
               r.be().increment(stt, int32_t(R));
             };
             const std::function<void()> run = captured_step(r, one);
             py::array_t<int32_t> tok({py::ssize_t(steps), R}), cnd({py::ssize_t(steps), R, K});
             py::array_t<float> prb({py::ssize_t(steps), R, K});
             for (py::ssize_t i = 0; i < py::ssize_t(steps); ++i) {
               run();
               r.be().copy_to_host(tok.mutable_data(i), tokens);
               r.be().copy_to_host(cnd.mutable_data(i), cand);
               r.be().copy_to_host(prb.mutable_data(i), prob);
             }
             return py::make_tuple(tok, cnd, prb);
           })
      .def("speculative_accept_steps",
           [](OpRunner& r, F32Array logits, I32Array draft, I32Array cand, F32Array cand_prob, float temperature,
              int32_t top_k, float top_p, uint64_t seed, int32_t step, int64_t steps) {
             // `steps` runs of one step (captured_step) of speculative_accept on the same inputs, the step
             // counter advancing on the device. Returns (emitted tokens [steps, B] (-1 past the count),
             // counts [steps], the final step).
             SamplerConfig c{temperature, top_k, top_p, seed};
             const py::ssize_t B = logits.shape(0);
             I32Array st(std::vector<py::ssize_t>{1});
             st.mutable_data()[0] = step;
             Tensor lt = r.upload(logits, r.act()), dt = r.upload_i32(draft), ct = r.upload_i32(cand),
                    qt = r.upload(cand_prob, DType::F32), stt = r.upload_i32(st);
             Tensor out = r.upload_i32(I32Array(std::vector<py::ssize_t>{B})),
                    count = r.upload_i32(I32Array(std::vector<py::ssize_t>{1}));
             auto one = [&] { r.be().speculative_accept(lt, dt, ct, qt, c, stt, out, count); };
             const std::function<void()> run = captured_step(r, one);
             py::array_t<int32_t> emitted({py::ssize_t(steps), B}), counts(std::vector<py::ssize_t>{py::ssize_t(steps)});
             std::vector<int32_t> row(size_t(B), 0);
             for (py::ssize_t i = 0; i < py::ssize_t(steps); ++i) {
               const std::vector<int32_t> minus(size_t(B), -1);
               r.be().copy_from_host(out, minus.data(), DType::I32);
               run();
               int32_t n = 0;
               r.be().copy_to_host(&n, count);
               r.be().copy_to_host(row.data(), out);
               for (py::ssize_t j = 0; j < B; ++j) emitted.mutable_at(i, j) = j < n ? row[size_t(j)] : -1;
               counts.mutable_at(i) = n;
             }
             return py::make_tuple(emitted, counts, r.download_i32(stt).data()[0]);
           })
      .def("sample", [](OpRunner& r, F32Array logits, float temperature, int32_t top_k, float top_p, uint64_t seed,
                        int32_t step) {
        SamplerConfig c{temperature, top_k, top_p, seed};
        I32Array step_arr(std::vector<py::ssize_t>{1});
        step_arr.mutable_data()[0] = step;
        Tensor st = r.upload_i32(step_arr), tok = r.upload_i32(I32Array(std::vector<py::ssize_t>{logits.shape(0)}));
        r.be().sample(r.upload(logits, DType::F32), c, st, tok);
        return py::make_tuple(r.download_i32(tok), r.download_i32(st).data()[0]);
      });
}
