// The Python module ocria_rt._core: thin bindings over include/ocria_rt (no logic here).
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

#include "ocria_rt/engine.h"

namespace py = pybind11;
using namespace ocria_rt;

void register_op_runner(py::module_& m);     // op_runner.cpp
void register_kernel_bench(py::module_& m);  // kernel_bench.cpp
void register_weight_codes(py::module_& m);  // weight_codes.cpp

namespace {

// Sets the Python exception `cls` with a C++ message. Messages quote file contents with their
// bytes escaped, but a path or a name may still hold bytes that are not UTF-8: those are kept as
// \xNN escapes instead of failing the conversion.
void set_error(PyObject* cls, const char* message) {
  PyObject* text = PyUnicode_DecodeUTF8(message, Py_ssize_t(std::strlen(message)), "backslashreplace");
  if (!text) return;  // the decode itself failed (out of memory): its exception stands
  PyErr_SetObject(cls, text);
  Py_DECREF(text);
}

// ocria_rt.Error -> the matching Python exception class of ocria_rt.errors; out of memory ->
// ResourceError; any other C++ exception is a bug: InternalError.
void translate_errors() {
  py::register_exception_translator([](std::exception_ptr p) {
    auto error_class = [](const char* name) { return py::module_::import("ocria_rt.errors").attr(name); };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      static const char* names[] = {"InvalidArgumentError", "FileError", "ModelError", "ResourceError", "DeviceError", "InternalError"};
      set_error(error_class(names[int(e.code())]).ptr(), e.what());
    } catch (const std::bad_alloc&) {
      set_error(error_class("ResourceError").ptr(), "out of host memory");
    } catch (const py::builtin_exception&) {
      throw;  // pybind11's own (cast errors, stop_iteration, ...): translated as pybind11 does
    } catch (const py::error_already_set&) {
      throw;
    } catch (const std::exception& e) {
      set_error(error_class("InternalError").ptr(), (std::string("unexpected C++ exception: ") + e.what()).c_str());
    }
  });
}

py::dict config_to_dict(const ModelConfig& c) {
  py::dict d;
  d["model_type"] = c.model_type;
  d["has_vision"] = c.has_vision;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["intermediate_size"] = c.intermediate_size;
  d["num_layers"] = c.num_layers;
  d["full_attention"] = c.full_attention;
  d["num_attention_heads"] = c.num_attention_heads;
  d["num_key_value_heads"] = c.num_key_value_heads;
  d["head_dim"] = c.head_dim;
  d["rotary_dim"] = c.rotary_dim;
  d["rope_theta"] = c.rope_theta;
  d["linear_num_key_heads"] = c.linear_num_key_heads;
  d["linear_num_value_heads"] = c.linear_num_value_heads;
  d["linear_key_head_dim"] = c.linear_key_head_dim;
  d["linear_value_head_dim"] = c.linear_value_head_dim;
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["eos_token_ids"] = c.eos_token_ids;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["mrope_section"] = c.mrope_section;
  if (c.has_vision) {
    d["image_token_id"] = c.image_token_id;
    d["vision_start_token_id"] = c.vision_start_token_id;
    d["vision_end_token_id"] = c.vision_end_token_id;
    const VisionConfig& v = c.vision;
    py::dict vd;
    vd["depth"] = v.depth;
    vd["hidden_size"] = v.hidden_size;
    vd["num_heads"] = v.num_heads;
    vd["intermediate_size"] = v.intermediate_size;
    vd["in_channels"] = v.in_channels;
    vd["patch_size"] = v.patch_size;
    vd["temporal_patch_size"] = v.temporal_patch_size;
    vd["spatial_merge_size"] = v.spatial_merge_size;
    vd["out_hidden_size"] = v.out_hidden_size;
    vd["num_position_embeddings"] = v.num_position_embeddings;
    vd["rope_theta"] = v.rope_theta;
    d["vision"] = vd;
  }
  return d;
}

SamplingParams make_params(int64_t max_new_tokens, float temperature, int64_t top_k, float top_p, uint64_t seed,
                           std::vector<int32_t> stop, bool speculative) {
  SamplingParams sp;
  sp.speculative = speculative;
  sp.max_new_tokens = max_new_tokens;
  sp.temperature = temperature;
  sp.top_k = top_k;
  sp.top_p = top_p;
  sp.seed = seed;
  sp.stop_token_ids = std::move(stop);
  return sp;
}

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// The batch borrows the pixels' memory, which must outlive it: a float32 C-contiguous array comes
// through the argument cast as it is, so the pixels are not copied on their way to the engine.
ImageBatch to_images(const FloatArray& pixel_values, const IntArray& grid_thw) {
  if (pixel_values.ndim() != 2) throw Error(ErrorCode::kInvalidArgument, "pixel_values must be 2-D [patches, patch_dim]");
  if (grid_thw.ndim() != 2 || grid_thw.shape(1) != 3)
    throw Error(ErrorCode::kInvalidArgument, "image_grid_thw must be [images, 3]");
  ImageBatch b;
  b.pixel_values = pixel_values.data();
  b.pixel_count = int64_t(pixel_values.size());
  for (py::ssize_t i = 0; i < grid_thw.shape(0); ++i)
    b.grid_thw.push_back({grid_thw.at(i, 0), grid_thw.at(i, 1), grid_thw.at(i, 2)});
  return b;
}

std::optional<ImageBatch> maybe_images(const std::optional<FloatArray>& pixel_values, const std::optional<IntArray>& grid_thw) {
  if (pixel_values.has_value() != grid_thw.has_value())
    throw Error(ErrorCode::kInvalidArgument, "pixel_values and image_grid_thw must be given together");
  if (!pixel_values) return std::nullopt;
  return to_images(*pixel_values, *grid_thw);
}

// A [rows, cols] array that takes over v's memory instead of copying it.
py::array_t<float> to_array(std::vector<float>&& v, int64_t rows, int64_t cols) {
  auto* owned = new std::vector<float>(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
  return py::array_t<float>({rows, cols}, owned->data(), free_when_done);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "ocria_rt native core";
  translate_errors();
  m.def("version", &version);
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_device_count", &cuda_device_count);
  m.attr("MAX_SECOND_MOMENT_FEATURES") = LinearInputStats::kMaxSecondMomentFeatures;
  m.def("load_config", [](const std::string& dir) { return config_to_dict(load_model_config(dir)); });

  py::class_<GenerationResult>(m, "GenerationResult")
      .def_readonly("token_ids", &GenerationResult::token_ids)
      .def_readonly("finish_reason", &GenerationResult::finish_reason)
      .def_readonly("prompt_tokens", &GenerationResult::prompt_tokens)
      .def_readonly("prefill_seconds", &GenerationResult::prefill_seconds)
      .def_readonly("decode_seconds", &GenerationResult::decode_seconds)
      .def_readonly("acceptance_lengths", &GenerationResult::acceptance_lengths);

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const std::string& dir, const std::string& device, int64_t max_context, int64_t prefill_chunk,
                       int num_threads, bool cuda_graphs, int64_t max_image_patches, const std::string& drafter,
                       bool linear_observer, int64_t benchmark_forced_acceptance, bool benchmark_phase_timing) {
             EngineOptions o;
             o.drafter = drafter;
             o.device = device;
             o.max_context = max_context;
             o.prefill_chunk = prefill_chunk;
             o.num_threads = num_threads;
             o.cuda_graphs = cuda_graphs;
             o.max_image_patches = max_image_patches;
             o.linear_observer = linear_observer;
             o.benchmark_forced_acceptance = benchmark_forced_acceptance;
             o.benchmark_phase_timing = benchmark_phase_timing;
             py::gil_scoped_release release;
             return Engine::create(dir, o);
           }),
           py::arg("model_dir"), py::arg("device") = "cpu", py::arg("max_context") = 0, py::arg("prefill_chunk") = 0,
           py::arg("num_threads") = 0, py::arg("cuda_graphs") = true, py::arg("max_image_patches") = 16384,
           py::arg("drafter") = "", py::arg("linear_observer") = false, py::arg("benchmark_forced_acceptance") = 0,
           py::arg("benchmark_phase_timing") = false)
      .def_property_readonly("config", [](const Engine& e) { return config_to_dict(e.config()); })
      .def_property_readonly("max_context", &Engine::max_context)
      .def("stats", [](const Engine& e) {
        EngineStats s = e.stats();
        py::dict d;
        d["device"] = s.device;
        d["backend"] = s.backend_name;
        d["weight_bytes"] = s.weight_bytes;
        py::dict by_format;
        by_format["dense"] = s.weight_bytes - s.weight_bytes_fp8 - s.weight_bytes_nvfp4;
        by_format["fp8"] = s.weight_bytes_fp8;
        by_format["nvfp4"] = s.weight_bytes_nvfp4;
        d["weight_bytes_by_format"] = by_format;
        d["quantization"] = s.quantization;
        d["state_bytes"] = s.state_bytes;
        d["workspace_bytes"] = s.workspace_bytes;
        d["launches_per_decode_step"] = s.launches_per_decode_step;
        d["kernels_per_decode_step"] = s.kernels_per_decode_step;
        d["draft_block_size"] = s.draft_block_size;
        d["drafter_weight_bytes"] = s.drafter_weight_bytes;
        d["drafter_state_bytes"] = s.drafter_state_bytes;
        d["launches_per_speculative_step"] = s.launches_per_speculative_step;
        d["kernels_per_speculative_step"] = s.kernels_per_speculative_step;
        d["timed_speculative_steps"] = s.timed_speculative_steps;
        d["speculative_draft_seconds"] = s.speculative_draft_seconds;
        d["speculative_verify_seconds"] = s.speculative_verify_seconds;
        d["speculative_commit_seconds"] = s.speculative_commit_seconds;
        return d;
      })
      .def("score", [](Engine& e, const std::vector<int32_t>& ids, int64_t chunk, std::optional<FloatArray> pixel_values,
                       std::optional<IntArray> grid_thw) {
        std::optional<ImageBatch> images = maybe_images(pixel_values, grid_thw);
        std::vector<float> logits;
        {
          py::gil_scoped_release release;
          logits = e.score(ids, chunk, images ? &*images : nullptr);
        }
        return to_array(std::move(logits), int64_t(ids.size()), e.config().vocab_size);
      }, py::arg("token_ids"), py::arg("chunk") = 0, py::arg("pixel_values") = py::none(),
         py::arg("image_grid_thw") = py::none())
      .def("hidden_states", [](Engine& e, const std::vector<int32_t>& ids, const std::vector<int64_t>& layers,
                               std::optional<FloatArray> pixel_values, std::optional<IntArray> grid_thw) {
        std::optional<ImageBatch> images = maybe_images(pixel_values, grid_thw);
        std::vector<float> states;
        {
          py::gil_scoped_release release;
          states = e.hidden_states(ids, layers, images ? &*images : nullptr);
        }
        return to_array(std::move(states), int64_t(ids.size()), int64_t(layers.size()) * e.config().hidden_size);
      }, py::arg("token_ids"), py::arg("layers"), py::arg("pixel_values") = py::none(),
         py::arg("image_grid_thw") = py::none())
      .def("start", [](Engine& e, const std::vector<int32_t>& ids, int64_t max_new_tokens, float temperature, int64_t top_k,
                       float top_p, uint64_t seed, std::vector<int32_t> stop, std::optional<FloatArray> pixel_values,
                       std::optional<IntArray> grid_thw, bool speculative) {
             std::optional<ImageBatch> images = maybe_images(pixel_values, grid_thw);
             py::gil_scoped_release release;
             e.start(ids, make_params(max_new_tokens, temperature, top_k, top_p, seed, std::move(stop), speculative),
                     images ? &*images : nullptr);
           },
           py::arg("token_ids"), py::arg("max_new_tokens"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
           py::arg("seed"), py::arg("stop_token_ids"), py::arg("pixel_values") = py::none(),
           py::arg("image_grid_thw") = py::none(), py::arg("speculative") = true)
      .def("next_token", [](Engine& e) {
        py::gil_scoped_release release;
        return e.next_token();
      })
      .def_property_readonly("last_prefill_seconds", &Engine::last_prefill_seconds)
      .def("encode_images", [](Engine& e, FloatArray pixel_values, IntArray grid_thw) {
        ImageBatch images = to_images(pixel_values, grid_thw);
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = e.encode_images(images);
        }
        const int64_t H = e.config().hidden_size, rows = int64_t(out.size()) / H;
        return to_array(std::move(out), rows, H);
      }, py::arg("pixel_values"), py::arg("image_grid_thw"))
      .def("generate", [](Engine& e, const std::vector<int32_t>& ids, int64_t max_new_tokens, float temperature, int64_t top_k,
                          float top_p, uint64_t seed, std::vector<int32_t> stop, std::optional<FloatArray> pixel_values,
                          std::optional<IntArray> grid_thw, bool speculative) {
             std::optional<ImageBatch> images = maybe_images(pixel_values, grid_thw);
             py::gil_scoped_release release;
             return e.generate(ids, make_params(max_new_tokens, temperature, top_k, top_p, seed, std::move(stop), speculative),
                               nullptr, images ? &*images : nullptr);
           },
           py::arg("token_ids"), py::arg("max_new_tokens"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
           py::arg("seed"), py::arg("stop_token_ids"), py::arg("pixel_values") = py::none(),
           py::arg("image_grid_thw") = py::none(), py::arg("speculative") = true)
      .def("draft", [](Engine& e, const std::vector<int32_t>& ids, std::optional<FloatArray> pixel_values,
                       std::optional<IntArray> grid_thw) {
             std::optional<ImageBatch> images = maybe_images(pixel_values, grid_thw);
             py::gil_scoped_release release;
             return e.draft(ids, images ? &*images : nullptr);
           },
           py::arg("token_ids"), py::arg("pixel_values") = py::none(), py::arg("image_grid_thw") = py::none())
      .def_property_readonly("acceptance_lengths", &Engine::acceptance_lengths)
      .def("set_proposal_hook", [](Engine& e, std::optional<py::function> hook) {
             // The hook runs on the thread that generates, with the GIL released: it takes the GIL. It
             // returns the proposals to verify (a list of ints) or None to keep them.
             if (!hook) return e.set_proposal_hook(nullptr);
             auto shared = std::make_shared<py::function>(*hook);
             e.set_proposal_hook([shared](int64_t position, std::vector<int32_t>& proposals) {
               py::gil_scoped_acquire gil;
               py::object replaced = (*shared)(position, proposals);
               if (!replaced.is_none()) proposals = replaced.cast<std::vector<int32_t>>();
             });
           },
           py::arg("hook"))
      .def("linear_groups", [](const Engine& e) {
        py::list out;
        for (const LinearGroupInfo& g : e.linear_groups()) {
          py::dict d;
          d["modules"] = g.modules;
          d["rows"] = g.rows;
          d["in_features"] = g.in_features;
          d["format"] = g.format;
          out.append(d);
        }
        return out;
      })
      .def("observe_linear_inputs", &Engine::observe_linear_inputs, py::arg("on"), py::arg("second_moment") = false)
      .def("linear_input_stats", [](const Engine& e) {
        std::vector<LinearInputStats> stats;
        {
          py::gil_scoped_release release;
          stats = e.linear_input_stats();
        }
        py::list out;
        for (const LinearInputStats& st : stats) {
          const py::ssize_t K = py::ssize_t(st.abs_max.size());
          py::dict d;
          d["tokens"] = st.tokens;
          d["abs_max"] = py::array_t<float>(K, st.abs_max.data());
          d["abs_mean"] = py::array_t<double>(K, st.abs_mean.data());
          d["square_mean"] = py::array_t<double>(K, st.square_mean.data());
          d["second_moment"] = st.second_moment.empty() ? py::object(py::none())
                                                         : py::object(py::array_t<double>({K, K}, st.second_moment.data()));
          out.append(d);
        }
        return out;
      })
      // A float32 C-contiguous array reaches the engine as it is (its buffer, not a copy); any other is
      // converted once by the cast. The array holds a reference to its buffer while the GIL is released.
      .def("set_linear_weight", [](Engine& e, const std::string& module, FloatArray weight) {
        if (weight.ndim() != 2) throw Error(ErrorCode::kInvalidArgument, "set_linear_weight: weight must be 2-D [out, in]");
        const float* w = weight.data();
        const int64_t count = int64_t(weight.size());
        py::gil_scoped_release release;
        e.set_linear_weight(module, w, count);
      }, py::arg("module"), py::arg("weight"))
      .def("restore_linear_weights", [](Engine& e) {
        py::gil_scoped_release release;
        e.restore_linear_weights();
      })
      .def("keep_reference", [](Engine& e, const std::vector<int32_t>& ids, int64_t begin, int64_t end,
                                std::optional<FloatArray> pixel_values, std::optional<IntArray> grid_thw,
                                std::optional<FloatArray> logits) {
        std::optional<ImageBatch> images = maybe_images(pixel_values, grid_thw);
        const int64_t V = e.config().vocab_size;
        if (logits && (logits->ndim() != 2 || logits->shape(0) != end - begin || logits->shape(1) != V))
          throw Error(ErrorCode::kInvalidArgument, "keep_reference: logits must be [end - begin, vocab] = [" +
                                                       std::to_string(end - begin) + ", " + std::to_string(V) + "]");
        const float* given = logits ? logits->data() : nullptr;
        py::gil_scoped_release release;
        return e.keep_reference(ids, begin, end, images ? &*images : nullptr, given);
      }, py::arg("token_ids"), py::arg("begin"), py::arg("end"), py::arg("pixel_values") = py::none(),
         py::arg("image_grid_thw") = py::none(), py::arg("logits") = py::none())
      .def("reference_kl", [](Engine& e, int64_t index) {
        std::vector<double> kl;
        {
          py::gil_scoped_release release;
          kl = e.reference_kl(index);
        }
        return py::array_t<double>(py::ssize_t(kl.size()), kl.data());
      }, py::arg("index"))
      .def("reference_logits", [](const Engine& e, int64_t index) {
        std::vector<float> logits;
        {
          py::gil_scoped_release release;
          logits = e.reference_logits(index);
        }
        const int64_t V = e.config().vocab_size, rows = int64_t(logits.size()) / V;
        return to_array(std::move(logits), rows, V);
      }, py::arg("index"))
      .def("clear_references", [](Engine& e) {
        py::gil_scoped_release release;
        e.clear_references();
      });

  register_op_runner(m);
  register_kernel_bench(m);
  register_weight_codes(m);
}
