#include "model/weight_loader.h"

#include <cmath>

#include "core/float_convert.h"

namespace ocria_rt {

namespace {

using Format = LinearWeight::Format;

const char* format_name(Format f) {
  switch (f) {
    case Format::kDense: return "unquantized";
    case Format::kFp8: return "FP8";
    case Format::kNvfp4: return "NVFP4";
  }
  return "?";
}

Error model_error(const std::string& what) { return Error(ErrorCode::kModelError, what); }

bool is_float(const TensorRecord& rec) {
  return rec.dtype_supported && (rec.dtype == DType::F32 || rec.dtype == DType::BF16 || rec.dtype == DType::F16);
}

std::vector<float> read_floats(const TensorRecord& rec) {
  std::vector<float> v(rec.nbytes / dtype_size(rec.dtype));
  convert_to_f32(rec.data, rec.dtype, v.data(), int64_t(v.size()));
  for (float x : v)
    if (!std::isfinite(x)) throw model_error("tensor '" + rec.name + "' in '" + rec.file + "' holds a non-finite value");
  return v;
}

// The float tensor `name` holding one scale for the whole weight ([] or [1]) or, where per_row is
// allowed, one per output row ([rows] or [rows, 1]), as [rows] floats. `what` says what it is.
std::vector<float> read_row_scale(const Checkpoint& ck, const std::string& name, int64_t rows, bool per_row,
                                  const std::string& what) {
  const TensorRecord* rec = ck.find(name);
  if (!rec) throw model_error("checkpoint '" + ck.dir() + "' lacks tensor '" + name + "' (" + what + ")");
  if (!is_float(*rec))
    throw model_error("tensor '" + name + "' in '" + rec->file + "' (" + what + ") has dtype " + rec->dtype_str +
                      "; expected BF16, F16 or F32");
  const std::vector<int64_t>& s = rec->shape;
  const bool one = s.empty() || (s.size() == 1 && s[0] == 1);
  const bool each_row = per_row && ((s.size() == 1 && s[0] == rows) || (s.size() == 2 && s[0] == rows && s[1] == 1));
  if (!one && !each_row)
    throw model_error("tensor '" + name + "' in '" + rec->file + "' (" + what + ") has shape " + rec->shape_str() +
                      "; expected [] or [1] (one scale for the tensor)" +
                      (per_row ? " or [" + std::to_string(rows) + "] or [" + std::to_string(rows) + ", 1] (one per output row)"
                               : std::string()));
  std::vector<float> v = read_floats(*rec);
  if (one) v.assign(size_t(rows), v[0]);
  return v;
}

// One part of a quantized projection, on the host.
struct HostPart {
  std::vector<uint8_t> weight;         // [rows, row bytes]: FP8 codes, or NVFP4's packed pairs
  std::vector<uint8_t> block_scale;    // NVFP4: [rows, in / 16] E4M3
  std::vector<float> row_scale;        // [rows]
  std::vector<float> pre_quant_scale;  // [in], or empty
  std::string name;                    // the module, for messages
};

std::vector<uint8_t> bytes_of(const TensorRecord& rec) {
  const uint8_t* p = static_cast<const uint8_t*>(rec.data);
  return std::vector<uint8_t>(p, p + rec.nbytes);
}

// The rows of several parts, each [rows_i, row_bytes] bytes, gathered into one buffer in the order
// `order` gives as (part, row) pairs.
std::vector<uint8_t> gather_rows(const std::vector<const std::vector<uint8_t>*>& parts, size_t row_bytes,
                                 const std::vector<std::pair<size_t, int64_t>>& order) {
  std::vector<uint8_t> out(order.size() * row_bytes);
  for (size_t r = 0; r < order.size(); ++r)
    std::memcpy(out.data() + r * row_bytes, parts[order[r].first]->data() + size_t(order[r].second) * row_bytes, row_bytes);
  return out;
}

}  // namespace

Format WeightLoader::format_of(const std::vector<Part>& parts) const {
  if (!quant_) return Format::kDense;
  const Format f = quant_->format_of(prefix_ + parts[0].name);
  for (size_t i = 1; i < parts.size(); ++i) {
    const Format fi = quant_->format_of(prefix_ + parts[i].name);
    if (fi != f)
      throw model_error("tensors '" + prefix_ + parts[0].name + ".weight' (" + format_name(f) + ") and '" + prefix_ +
                        parts[i].name + ".weight' (" + format_name(fi) +
                        ") are loaded as one fused projection and must share a storage format");
  }
  return f;
}

LinearWeight WeightLoader::projection(const std::vector<Part>& parts, int64_t in, const std::string& norm, bool glu) {
  if (glu && (parts.size() != 2 || parts[0].rows != parts[1].rows))
    throw Error(ErrorCode::kInternal, "projection: a GLU projection is two parts of equal rows");
  const Format format = format_of(parts);
  if (format != Format::kDense) return quantized_projection(format, parts, in, norm, glu);
  LinearWeight w;
  if (glu) {
    w = glu_linear(parts[0].name + ".weight", parts[1].name + ".weight", parts[0].rows, in);
  } else {
    std::vector<std::pair<std::string, std::vector<int64_t>>> tensors;
    for (const Part& p : parts) tensors.push_back({p.name + ".weight", {p.rows, in}});
    w = linear(tensors);
  }
  if (!norm.empty()) be_.fold_norm_weight(w.weight, load(norm, {in}, DType::F32));
  return w;
}

LinearWeight WeightLoader::quantized_projection(Format format, const std::vector<Part>& parts, int64_t in,
                                                const std::string& norm, bool glu) {
  const bool nvfp4 = format == Format::kNvfp4;
  const bool compressed_tensors = quant_->producer() == QuantProducer::kCompressedTensors;
  const int64_t block = LinearWeight::kNvfp4Block;
  if (glu) check_glu(parts[0].name + ".weight", parts[0].rows);

  std::vector<HostPart> host;
  for (const Part& p : parts) {
    const std::string m = prefix_ + p.name;
    HostPart h;
    h.name = m;
    // The weight: its dtype and shape say whether the checkpoint agrees with the config.
    const std::string weight_name = m + (nvfp4 && compressed_tensors ? ".weight_packed" : ".weight");
    if (nvfp4 && in % block != 0)
      throw model_error("tensor '" + weight_name + "': NVFP4 needs the input features (" + std::to_string(in) +
                        ") to be a multiple of 16");
    try {
      h.weight = bytes_of(nvfp4 ? ck_.require_raw(weight_name, {p.rows, in / 2}, DType::U8)
                                : ck_.require_raw(weight_name, {p.rows, in}, DType::F8E4M3));
    } catch (const Error& e) {
      throw model_error(std::string(e.what()) + " (the quantization config stores layer '" + m + "' as " +
                        format_name(format) + ")");
    }
    if (nvfp4) {
      h.block_scale = bytes_of(ck_.require_raw(m + ".weight_scale", {p.rows, in / block}, DType::F8E4M3));
      if (compressed_tensors) {
        h.row_scale = read_row_scale(ck_, m + ".weight_global_scale", p.rows, false, "the NVFP4 global scale");
        for (float& s : h.row_scale) s = 1.0f / s;  // weight_global_scale = 1 / weight_scale_2
      } else {
        h.row_scale = read_row_scale(ck_, m + ".weight_scale_2", p.rows, false, "the NVFP4 global scale");
      }
    } else {
      h.row_scale = read_row_scale(ck_, m + ".weight_scale", p.rows, true, "the FP8 weight scale");
    }
    // ModelOpt's input_scale (static activation quantization) is not used: activations stay unquantized.
    if (const TensorRecord* pqs = ck_.find(m + ".pre_quant_scale")) {
      if (!is_float(*pqs) || pqs->shape != std::vector<int64_t>{in})
        throw model_error("tensor '" + pqs->name + "' in '" + pqs->file + "' (the AWQ pre_quant_scale) has dtype " +
                          pqs->dtype_str + " and shape " + pqs->shape_str() + "; expected a float tensor [" +
                          std::to_string(in) + "]");
      h.pre_quant_scale = read_floats(*pqs);
    }
    host.push_back(std::move(h));
  }
  // One input_scale serves the whole projection: its parts must share the AWQ scale.
  for (size_t i = 1; i < host.size(); ++i)
    if (host[i].pre_quant_scale != host[0].pre_quant_scale)
      throw model_error("tensors '" + host[0].name + ".pre_quant_scale' and '" + host[i].name +
                        ".pre_quant_scale' differ (or one is missing); the parts of one fused projection need the "
                        "same AWQ pre_quant_scale");

  // Output row r of the projection is row order[r].second of part order[r].first.
  std::vector<std::pair<size_t, int64_t>> order;
  if (glu) {
    for (int64_t j = 0; j < parts[0].rows / kGluGroup; ++j)
      for (size_t part = 0; part < 2; ++part)
        for (int64_t r = 0; r < kGluGroup; ++r) order.push_back({part, j * kGluGroup + r});
  } else {
    for (size_t part = 0; part < parts.size(); ++part)
      for (int64_t r = 0; r < parts[part].rows; ++r) order.push_back({part, r});
  }
  const int64_t N = int64_t(order.size());
  std::vector<const std::vector<uint8_t>*> weights, block_scales;
  for (const HostPart& h : host) {
    weights.push_back(&h.weight);
    block_scales.push_back(&h.block_scale);
  }
  std::vector<float> row_scale;
  for (const auto& [part, r] : order) row_scale.push_back(host[part].row_scale[size_t(r)]);

  const size_t bytes_before = arena_.bytes_used();
  LinearWeight w;
  w.format = format;
  const int64_t row_bytes = nvfp4 ? in / 2 : in;
  w.weight = arena_.alloc(nvfp4 ? DType::U8 : DType::F8E4M3, {N, row_bytes});
  be_.copy_from_host(w.weight, gather_rows(weights, size_t(row_bytes), order).data(), w.weight.dtype);
  if (nvfp4) {
    w.block_scale = arena_.alloc(DType::F8E4M3, {N, in / block});
    be_.copy_from_host(w.block_scale, gather_rows(block_scales, size_t(in / block), order).data(), DType::F8E4M3);
  }
  w.row_scale = arena_.alloc(DType::F32, {N});
  be_.copy_from_host(w.row_scale, row_scale.data(), DType::F32);
  // x * input_scale = rms_norm(x, unit) * (1 + norm weight) * pre_quant_scale: the norm's weight
  // cannot be folded into quantized columns.
  if (!norm.empty() || !host[0].pre_quant_scale.empty()) {
    std::vector<float> input_scale(size_t(in), 1.0f);
    if (!norm.empty()) {
      const std::vector<float> nw = read_floats(ck_.require(prefix_ + norm, {in}));
      for (int64_t k = 0; k < in; ++k) input_scale[k] = 1.0f + nw[k];
    }
    for (size_t k = 0; k < host[0].pre_quant_scale.size(); ++k) input_scale[k] *= host[0].pre_quant_scale[k];
    w.input_scale = arena_.alloc(DType::F32, {in});
    be_.copy_from_host(w.input_scale, input_scale.data(), DType::F32);
  }
  be_.prepare_quantized_weight(w);
  const int64_t bytes = int64_t(arena_.bytes_used() - bytes_before);
  (nvfp4 ? quantized_bytes_->nvfp4 : quantized_bytes_->fp8) += bytes;
  return w;
}

}  // namespace ocria_rt
