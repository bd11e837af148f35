// ocria_rt._core's FP8 / NVFP4 weight-code functions (csrc/engine/weight_codes.h), for
// python/ocria_rt/quantization/formats.py: numpy arrays in and out, the work without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "engine/weight_codes.h"
#include "ocria_rt/error.h"

namespace py = pybind11;
using namespace ocria_rt;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using ByteArray = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
namespace wc = weight_codes;

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(ErrorCode::kInvalidArgument, message);
}

// [rows, K] of a 2-D array
std::pair<int64_t, int64_t> matrix_shape(const py::array& a, const char* what) {
  require(a.ndim() == 2, std::string(what) + " must be 2-D, got " + std::to_string(a.ndim()) + " dimensions");
  return {int64_t(a.shape(0)), int64_t(a.shape(1))};
}

}  // namespace

void register_weight_codes(py::module_& m) {
  m.def("fp8_quantize", [](FloatArray w, float scale, int threads) {
    py::array_t<uint8_t> codes(std::vector<py::ssize_t>(w.shape(), w.shape() + w.ndim()));
    const float* src = w.data();
    uint8_t* dst = codes.mutable_data();
    {
      py::gil_scoped_release release;
      wc::fp8_quantize(src, int64_t(w.size()), scale, dst, threads);
    }
    return codes;
  }, py::arg("w"), py::arg("scale"), py::arg("threads") = 0);

  m.def("fp8_dequantize", [](ByteArray codes, float scale, int threads) {
    py::array_t<float> out(std::vector<py::ssize_t>(codes.shape(), codes.shape() + codes.ndim()));
    const uint8_t* src = codes.data();
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      wc::fp8_dequantize(src, int64_t(codes.size()), scale, dst, threads);
    }
    return out;
  }, py::arg("codes"), py::arg("scale"), py::arg("threads") = 0);

  m.def("nvfp4_quantize", [](FloatArray w, float global_scale, std::optional<FloatArray> clip_factors,
                             std::optional<FloatArray> block_moments, int threads) {
    const auto [rows, K] = matrix_shape(w, "nvfp4_quantize: w");
    require(K % wc::kBlock == 0, "nvfp4_quantize: K = " + std::to_string(K) + " is not a multiple of 16");
    wc::ClipSearch search;
    if (clip_factors) {
      require(block_moments.has_value(), "nvfp4_quantize: clip_factors need block_moments");
      require(clip_factors->ndim() == 1 && clip_factors->size() >= 1 && clip_factors->size() <= wc::kMaxClipFactors,
              "nvfp4_quantize: clip_factors must be 1-D with 1 to " + std::to_string(wc::kMaxClipFactors) + " factors");
      const py::array& bm = *block_moments;
      require(bm.ndim() == 3 && bm.shape(0) == K / wc::kBlock && bm.shape(1) == wc::kBlock && bm.shape(2) == wc::kBlock,
              "nvfp4_quantize: block_moments must be [K / 16, 16, 16] = [" + std::to_string(K / wc::kBlock) + ", 16, 16]");
      search = {clip_factors->data(), int(clip_factors->size()), block_moments->data()};
    }
    py::array_t<uint8_t> scales({py::ssize_t(rows), py::ssize_t(K / wc::kBlock)});
    py::array_t<uint8_t> packed({py::ssize_t(rows), py::ssize_t(K / 2)});
    const float* src = w.data();
    uint8_t *s = scales.mutable_data(), *p = packed.mutable_data();
    int64_t changed;
    {
      py::gil_scoped_release release;
      changed = wc::nvfp4_quantize(src, rows, K, global_scale, clip_factors ? &search : nullptr, s, p, threads);
    }
    return py::make_tuple(scales, packed, changed);
  }, py::arg("w"), py::arg("global_scale"), py::arg("clip_factors") = py::none(), py::arg("block_moments") = py::none(),
     py::arg("threads") = 0);

  m.def("nvfp4_dequantize", [](ByteArray packed, ByteArray block_scales, float global_scale, int threads) {
    const auto [rows, half] = matrix_shape(packed, "nvfp4_dequantize: packed");
    const int64_t K = 2 * half;
    require(K % wc::kBlock == 0, "nvfp4_dequantize: K = " + std::to_string(K) + " is not a multiple of 16");
    const auto [srows, nb] = matrix_shape(block_scales, "nvfp4_dequantize: block_scales");
    require(srows == rows && nb == K / wc::kBlock, "nvfp4_dequantize: block_scales must be [" + std::to_string(rows) +
                                                       ", " + std::to_string(K / wc::kBlock) + "]");
    py::array_t<float> out({py::ssize_t(rows), py::ssize_t(K)});
    const uint8_t *p = packed.data(), *s = block_scales.data();
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      wc::nvfp4_dequantize(p, s, rows, K, global_scale, dst, threads);
    }
    return out;
  }, py::arg("packed"), py::arg("block_scales"), py::arg("global_scale"), py::arg("threads") = 0);
}
