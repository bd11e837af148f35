// Embedding ocria_rt in a C++ program through its public header alone.
//
//   generate MODEL_DIR [--device cpu|cuda] [--max-new-tokens N] TOKEN_ID...
//
// Prints the generated token ids on one line, and timings on stderr.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ocria_rt/engine.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [--device D] [--max-new-tokens N] TOKEN_ID...\n", argv[0]);
    return 2;
  }
  ocria_rt::EngineOptions options;
  ocria_rt::SamplingParams params;
  std::vector<int32_t> prompt;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--device" && i + 1 < argc) options.device = argv[++i];
    else if (arg == "--max-new-tokens" && i + 1 < argc) params.max_new_tokens = std::atoll(argv[++i]);
    else prompt.push_back(int32_t(std::atol(arg.c_str())));
  }
  try {
    auto engine = ocria_rt::Engine::create(argv[1], options);
    ocria_rt::GenerationResult r = engine->generate(prompt, params);
    for (size_t i = 0; i < r.token_ids.size(); ++i) std::printf("%s%d", i ? " " : "", r.token_ids[i]);
    std::printf("\n");
    std::fprintf(stderr, "ocria_rt %s: %zu tokens, prefill %.1f ms, decode %.1f tokens/s (%s)\n",
                 ocria_rt::version().c_str(), r.token_ids.size(), r.prefill_seconds * 1e3,
                 r.decode_tokens_per_second(), r.finish_reason.c_str());
  } catch (const ocria_rt::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
