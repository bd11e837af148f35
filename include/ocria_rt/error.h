// ocria_rt errors: every failure the library reports is an ocria_rt::Error carrying a code and a
// message that names the file, tensor or argument at fault. The library never aborts on bad input.
#pragma once
#include <stdexcept>
#include <string>

namespace ocria_rt {

enum class ErrorCode {
  kInvalidArgument,  // a bad argument from the caller (token id, length, sampling parameter)
  kFileError,        // a file is missing, unreadable or malformed (config.json, safetensors)
  kModelError,       // the checkpoint does not describe a supported model (type, tensor, shape, dtype)
  kResourceError,    // memory or context capacity exhausted
  kDeviceError,      // the accelerator or its runtime failed
  kInternal,         // a bug in ocria_rt
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace ocria_rt
