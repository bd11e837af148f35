// A small JSON reader, enough for config.json, safetensors headers and index files, and typed reads
// of its values for the loaders (json::Field).
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ocria_rt/error.h"

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

  // Accessors throw std::runtime_error on a kind mismatch; loaders read through json::Field instead,
  // which names the file and key.
  bool as_bool() const;
  double as_number() const;
  int64_t as_int() const;  // the number must be integral
  const std::string& as_string() const;
  const std::vector<Value>& as_array() const;
  const std::map<std::string, Value>& as_object() const;

  // Object member or nullptr.
  const Value* find(const std::string& key) const;

  // Strict JSON in UTF-8 (also NaN / Infinity / -Infinity, which Python's json.dump writes). Throws
  // std::runtime_error with the byte offset; strings hold valid UTF-8 only.
  static Value parse(std::string_view text);

 private:
  friend class Parser;
  Kind kind_ = Kind::Null;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Value> array_;
  std::map<std::string, Value> object_;
};

// Reads and parses a JSON file; Error(kFileError) naming the file when it is missing, unreadable or
// not valid JSON.
Value parse_file(const std::string& path);

// s between single quotes, printable: control bytes, quotes, backslashes and bytes that are not
// valid UTF-8 become \xNN escapes; longer than max_chars bytes, it is cut and ends in "...".
std::string quote(std::string_view s, size_t max_chars = 200);

// A short description of a value for error messages: 3.5, NaN, 'abc', null, true, an array of 2, an object.
std::string describe(const Value& v);

// A closed range of integers.
struct IntRange {
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();

  static IntRange at_least(int64_t lo) { return {lo, std::numeric_limits<int64_t>::max()}; }
  static IntRange between(int64_t lo, int64_t hi) { return {lo, hi}; }
  bool contains(int64_t v) const { return v >= min && v <= max; }
  std::string str() const;  // "an integer", "an integer >= 1", "an integer in [0, 511]"
};

// A range of finite numbers whose ends are open or closed. Infinite and NaN values never belong.
struct NumRange {
  double min = -std::numeric_limits<double>::max();
  double max = std::numeric_limits<double>::max();
  bool min_open = false, max_open = false;
  std::string label;  // what str() says, when set (for ranges whose ends are not round numbers)

  static NumRange finite() { return {}; }
  static NumRange positive() { return {0.0, std::numeric_limits<double>::max(), true, false, {}}; }
  static NumRange between(double lo, double hi, std::string label = {}) {  // [lo, hi]
    return {lo, hi, false, false, std::move(label)};
  }
  static NumRange above_until(double lo, double hi) { return {lo, hi, true, false, {}}; }  // (lo, hi]
  bool contains(double v) const;
  std::string str() const;  // "a finite number", "a number > 0", "a number in (0, 1]"
};

// One value of a parsed document with where it came from: typed reads of it name the file and the
// key path of a bad value and say what was expected, throwing Error(code) with
//   <source>: key '<path>' must be <expectation>, got <value>
// A Field may be absent (a missing key); reading a required value from an absent or null field
// fails with "is missing". For example:
//   json::Value doc = json::parse_file(path);
//   json::Field cfg(doc, "config '" + path + "'", ErrorCode::kModelError);
//   int64_t layers = cfg["text_config"]["num_hidden_layers"].integer(json::IntRange::at_least(1));
//   double eps = cfg["rms_norm_eps"].number_or(1e-6, json::NumRange::positive());
class Field {
 public:
  // The document root (path empty). `source` names the file in messages, e.g. "config '/m/config.json'".
  Field(const Value& root, std::string source, ErrorCode code);

  // A member of this object: absent when this field is absent or null; fails when this is not an object.
  Field operator[](std::string_view key) const;
  // An element of this array: fails when this is not an array or has no such element.
  Field operator[](size_t index) const;

  bool present() const { return value_ && !value_->is_null(); }  // exists and is not null
  const Value* value() const { return present() ? value_ : nullptr; }
  const std::string& path() const { return path_; }

  // Throws Error(code): "<source>: key '<path>' <what>" ("<source> <what>" at the root). Use for
  // checks that involve several keys.
  [[noreturn]] void fail(const std::string& what) const;
  // "<source>: key '<path>' must be <expectation>, got <value>" (or "is missing (expected ...)").
  [[noreturn]] void expected(const std::string& expectation) const;

  // Required reads: an absent or null field, a value of another type or outside the range fails.
  bool boolean() const;
  int64_t integer(IntRange range = {}) const;
  double number(NumRange range = NumRange::finite()) const;
  const std::string& string() const;
  const Value& object() const;  // the field must be an object; returns it
  size_t size() const;          // the field must be an array; its length
  std::vector<int64_t> integers(IntRange range = {}) const;  // an array of integers, each in range

  // Optional reads: `fallback` when the field is absent or null, else as the required read.
  bool boolean_or(bool fallback) const { return present() ? boolean() : fallback; }
  int64_t integer_or(int64_t fallback, IntRange range = {}) const { return present() ? integer(range) : fallback; }
  double number_or(double fallback, NumRange range = NumRange::finite()) const {
    return present() ? number(range) : fallback;
  }
  std::string string_or(const std::string& fallback) const { return present() ? string() : fallback; }

 private:
  Field(const Value* value, std::shared_ptr<const std::string> source, ErrorCode code, std::string path)
      : value_(value), source_(std::move(source)), code_(code), path_(std::move(path)) {}
  const Value* value_;
  std::shared_ptr<const std::string> source_;
  ErrorCode code_;
  std::string path_;
};

}  // namespace ocria_rt::json
