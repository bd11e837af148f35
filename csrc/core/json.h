// A small JSON reader, enough for config.json, safetensors headers and index files.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ocria_rt::json {

class Value {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::Null; }
  bool is_number() const { return kind_ == Kind::Number; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_array() const { return kind_ == Kind::Array; }
  bool is_object() const { return kind_ == Kind::Object; }
  bool is_bool() const { return kind_ == Kind::Bool; }

  // Accessors throw std::runtime_error on a kind mismatch; callers add the file/key context.
  bool as_bool() const;
  double as_number() const;
  int64_t as_int() const;  // the number must be integral
  const std::string& as_string() const;
  const std::vector<Value>& as_array() const;
  const std::map<std::string, Value>& as_object() const;

  // Object member or nullptr.
  const Value* find(const std::string& key) const;

  static Value parse(std::string_view text);  // throws std::runtime_error with the byte offset

 private:
  friend class Parser;
  Kind kind_ = Kind::Null;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Value> array_;
  std::map<std::string, Value> object_;
};

}  // namespace ocria_rt::json
