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

// The column scale / divisor [K] of a [rows, K] matrix, or null.
const float* column_vector(const std::optional<FloatArray>& v, int64_t K, const char* what) {
  if (!v) return nullptr;
  require(v->ndim() == 1 && v->shape(0) == K, std::string(what) + " must be [K] = [" + std::to_string(K) + "]");
  return v->data();
}

// The minuend [rows, K], or null.
const float* minuend_matrix(const std::optional<FloatArray>& m, int64_t rows, int64_t K, const char* what) {
  if (!m) return nullptr;
  require(m->ndim() == 2 && m->shape(0) == rows && m->shape(1) == K,
          std::string(what) + " must be [" + std::to_string(rows) + ", " + std::to_string(K) + "]");
  return m->data();
}

}  // namespace

void register_weight_codes(py::module_& m) {
  m.def("fp8_quantize", [](FloatArray w, float scale, std::optional<FloatArray> col_scale, int threads) {
    const auto [rows, K] = matrix_shape(w, "fp8_quantize: w");
    const float* s = column_vector(col_scale, K, "fp8_quantize: col_scale");
    py::array_t<uint8_t> codes({py::ssize_t(rows), py::ssize_t(K)});
    const float* src = w.data();
    uint8_t* dst = codes.mutable_data();
    {
      py::gil_scoped_release release;
      wc::fp8_quantize(src, rows, K, s, scale, dst, threads);
    }
    return codes;
  }, py::arg("w"), py::arg("scale"), py::arg("col_scale") = py::none(), py::arg("threads") = 0);

  m.def("fp8_dequantize", [](ByteArray codes, float scale, std::optional<FloatArray> col_divisor,
                             std::optional<FloatArray> minuend, int threads) {
    const auto [rows, K] = matrix_shape(codes, "fp8_dequantize: codes");
    const float* div = column_vector(col_divisor, K, "fp8_dequantize: col_divisor");
    const float* sub = minuend_matrix(minuend, rows, K, "fp8_dequantize: minuend");
    py::array_t<float> out({py::ssize_t(rows), py::ssize_t(K)});
    const uint8_t* src = codes.data();
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      wc::fp8_dequantize(src, rows, K, scale, div, sub, dst, threads);
    }
    return out;
  }, py::arg("codes"), py::arg("scale"), py::arg("col_divisor") = py::none(), py::arg("minuend") = py::none(),
     py::arg("threads") = 0);

  m.def("nvfp4_quantize", [](FloatArray w, float global_scale, std::optional<FloatArray> clip_factors,
                             std::optional<FloatArray> block_moments, std::optional<FloatArray> col_scale, int threads) {
    const auto [rows, K] = matrix_shape(w, "nvfp4_quantize: w");
    require(K % wc::kBlock == 0, "nvfp4_quantize: K = " + std::to_string(K) + " is not a multiple of 16");
    const float* s = column_vector(col_scale, K, "nvfp4_quantize: col_scale");
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
    uint8_t *bs = scales.mutable_data(), *p = packed.mutable_data();
    int64_t changed;
    {
      py::gil_scoped_release release;
      changed = wc::nvfp4_quantize(src, rows, K, s, global_scale, clip_factors ? &search : nullptr, bs, p, threads);
    }
    return py::make_tuple(scales, packed, changed);
  }, py::arg("w"), py::arg("global_scale"), py::arg("clip_factors") = py::none(), py::arg("block_moments") = py::none(),
     py::arg("col_scale") = py::none(), py::arg("threads") = 0);

  m.def("nvfp4_dequantize", [](ByteArray packed, ByteArray block_scales, float global_scale,
                               std::optional<FloatArray> col_divisor, std::optional<FloatArray> minuend, int threads) {
    const auto [rows, half] = matrix_shape(packed, "nvfp4_dequantize: packed");
    const int64_t K = 2 * half;
    require(K % wc::kBlock == 0, "nvfp4_dequantize: K = " + std::to_string(K) + " is not a multiple of 16");
    const auto [srows, nb] = matrix_shape(block_scales, "nvfp4_dequantize: block_scales");
    require(srows == rows && nb == K / wc::kBlock, "nvfp4_dequantize: block_scales must be [" + std::to_string(rows) +
                                                       ", " + std::to_string(K / wc::kBlock) + "]");
    const float* div = column_vector(col_divisor, K, "nvfp4_dequantize: col_divisor");
    const float* sub = minuend_matrix(minuend, rows, K, "nvfp4_dequantize: minuend");
    py::array_t<float> out({py::ssize_t(rows), py::ssize_t(K)});
    const uint8_t *p = packed.data(), *s = block_scales.data();
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      wc::nvfp4_dequantize(p, s, rows, K, global_scale, div, sub, dst, threads);
    }
    return out;
  }, py::arg("packed"), py::arg("block_scales"), py::arg("global_scale"), py::arg("col_divisor") = py::none(),
     py::arg("minuend") = py::none(), py::arg("threads") = 0);
}
