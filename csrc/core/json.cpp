#include "core/json.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace ocria_rt::json {

namespace {

// The length of the well-formed UTF-8 sequence at the start of s (1-4 bytes), or 0 when it is not one
// (a stray continuation byte, an overlong form, a surrogate, a code point above U+10FFFF, a cut end).
size_t utf8_sequence_length(std::string_view s) {
  if (s.empty()) return 0;
  const auto b0 = static_cast<unsigned char>(s[0]);
  if (b0 < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) n = 2;
  else if (b0 == 0xE0) n = 3, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEC) n = 3;
  else if (b0 == 0xED) n = 3, hi = 0x9F;
  else if (b0 >= 0xEE && b0 <= 0xEF) n = 3;
  else if (b0 == 0xF0) n = 4, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) n = 4;
  else if (b0 == 0xF4) n = 4, hi = 0x8F;
  else return 0;
  if (s.size() < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < (i == 1 ? lo : 0x80) || b > (i == 1 ? hi : 0xBF)) return 0;
  }
  return n;
}

}  // namespace

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  Value parse_document() {
    Value v = parse_value(0);
    skip_space();
    if (pos_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 256;
  std::string_view s_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const char* what) const {
    throw std::runtime_error(std::string("invalid JSON at byte ") + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ >= s_.size()) fail("unexpected end");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail((std::string("expected '") + c + "'").c_str());
    ++pos_;
  }
  bool consume_word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }

  Value parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting too deep");
    Value v;
    char c = peek();
    if (c == '{') {
      v.kind_ = Value::Kind::Object;
      ++pos_;
      if (peek() == '}') { ++pos_; return v; }
      while (true) {
        if (peek() != '"') fail("expected a string key");
        std::string key = parse_string();
        expect(':');
        v.object_[key] = parse_value(depth + 1);
        char d = peek();
        ++pos_;
        if (d == '}') break;
        if (d != ',') fail("expected ',' or '}'");
      }
    } else if (c == '[') {
      v.kind_ = Value::Kind::Array;
      ++pos_;
      if (peek() == ']') { ++pos_; return v; }
      while (true) {
        v.array_.push_back(parse_value(depth + 1));
        char d = peek();
        ++pos_;
        if (d == ']') break;
        if (d != ',') fail("expected ',' or ']'");
      }
    } else if (c == '"') {
      v.kind_ = Value::Kind::String;
      v.string_ = parse_string();
    } else if (consume_word("true")) {
      v.kind_ = Value::Kind::Bool;
      v.bool_ = true;
    } else if (consume_word("false")) {
      v.kind_ = Value::Kind::Bool;
    } else if (consume_word("null")) {
    } else if (consume_word("NaN")) {  // Python's json.dump writes these
      v.kind_ = Value::Kind::Number;
      v.number_ = NAN;
    } else if (consume_word("Infinity")) {
      v.kind_ = Value::Kind::Number;
      v.number_ = INFINITY;
    } else if (consume_word("-Infinity")) {
      v.kind_ = Value::Kind::Number;
      v.number_ = -INFINITY;
    } else {
      v.kind_ = Value::Kind::Number;
      v.number_ = parse_number();
    }
    return v;
  }

  // JSON's number grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  double parse_number() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    const size_t int_start = pos_;
    const size_t int_digits = digits();
    if (int_digits == 0) fail("unexpected character");
    if (int_digits > 1 && s_[int_start] == '0') fail("malformed number (leading zero)");
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) fail("malformed number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) fail("malformed number");
    }
    double d = 0;
    const auto [end, ec] = std::from_chars(s_.data() + start, s_.data() + pos_, d);
    if (ec == std::errc::result_out_of_range) fail("number out of the range of a double");
    if (ec != std::errc() || end != s_.data() + pos_) fail("malformed number");
    return d;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  uint32_t parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else fail("bad \\u escape");
    }
    return v;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("control character in a string");
      if (c >= 0x80) {
        const size_t n = utf8_sequence_length(s_.substr(pos_));
        if (n == 0) fail("invalid UTF-8 in a string");
        out.append(s_.substr(pos_, n));
        pos_ += n;
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += char(c);
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp < 0xE000) fail("lone low surrogate in a \\u escape");
          if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair: the low half must follow
            if (s_.substr(pos_, 2) != "\\u") fail("lone high surrogate in a \\u escape");
            pos_ += 2;
            const uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair in a \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }
};

Value Value::parse(std::string_view text) { return Parser(text).parse_document(); }

static std::runtime_error kind_error(const char* want) { return std::runtime_error(std::string("expected a JSON ") + want); }

bool Value::as_bool() const {
  if (kind_ != Kind::Bool) throw kind_error("boolean");
  return bool_;
}
double Value::as_number() const {
  if (kind_ != Kind::Number) throw kind_error("number");
  return number_;
}
int64_t Value::as_int() const {
  double d = as_number();
  if (d != std::floor(d) || std::fabs(d) > 9.0e15) throw kind_error("integer");
  return int64_t(d);
}
const std::string& Value::as_string() const {
  if (kind_ != Kind::String) throw kind_error("string");
  return string_;
}
const std::vector<Value>& Value::as_array() const {
  if (kind_ != Kind::Array) throw kind_error("array");
  return array_;
}
const std::map<std::string, Value>& Value::as_object() const {
  if (kind_ != Kind::Object) throw kind_error("object");
  return object_;
}
const Value* Value::find(const std::string& key) const {
  if (kind_ != Kind::Object) return nullptr;
  auto it = object_.find(key);
  return it == object_.end() ? nullptr : &it->second;
}

Value parse_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(ErrorCode::kFileError, "cannot read " + quote(path, std::string::npos) + ": it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(ErrorCode::kFileError, "cannot read " + quote(path, std::string::npos) + ": " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(ErrorCode::kFileError, "cannot read " + quote(path, std::string::npos));
  try {
    return Value::parse(ss.str());
  } catch (const std::runtime_error& e) {
    throw Error(ErrorCode::kFileError, quote(path, std::string::npos) + ": " + e.what());
  }
}

std::string quote(std::string_view s, size_t max_chars) {
  static const char* hex = "0123456789abcdef";
  std::string out = "'";
  size_t i = 0;
  while (i < s.size()) {
    if (out.size() > max_chars) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c >= 0x80 ? utf8_sequence_length(s.substr(i)) : 1;
    if (c >= 0x80 && n > 0) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    if (c < 0x20 || c == 0x7F || c >= 0x80 || c == '\\' || c == '\'') {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += char(c);
    }
    ++i;
  }
  return out + "'";
}

namespace {

// The shortest text that reads back as d; NaN and the infinities as JSON readers write them.
std::string number_text(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(d);
}

}  // namespace

std::string describe(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Null: return "null";
    case Value::Kind::Bool: return v.as_bool() ? "true" : "false";
    case Value::Kind::Number: return number_text(v.as_number());
    case Value::Kind::String: return "the string " + quote(v.as_string(), 60);
    case Value::Kind::Array: return "an array of " + std::to_string(v.as_array().size());
    case Value::Kind::Object: return "an object";
  }
  return "?";
}

std::string IntRange::str() const {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min(), kMax = std::numeric_limits<int64_t>::max();
  if (min == kMin && max == kMax) return "an integer";
  if (max == kMax) return "an integer >= " + std::to_string(min);
  if (min == kMin) return "an integer <= " + std::to_string(max);
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

bool NumRange::contains(double v) const {
  if (!std::isfinite(v)) return false;
  return (min_open ? v > min : v >= min) && (max_open ? v < max : v <= max);
}

std::string NumRange::str() const {
  if (!label.empty()) return label;
  constexpr double kMax = std::numeric_limits<double>::max();
  const bool no_min = min == -kMax && !min_open, no_max = max == kMax && !max_open;
  if (no_min && no_max) return "a finite number";
  if (no_max) return std::string("a finite number ") + (min_open ? "> " : ">= ") + number_text(min);
  if (no_min) return std::string("a finite number ") + (max_open ? "< " : "<= ") + number_text(max);
  return std::string("a number in ") + (min_open ? "(" : "[") + number_text(min) + ", " + number_text(max) +
         (max_open ? ")" : "]");
}

Field::Field(const Value& root, std::string source, ErrorCode code)
    : Field(&root, std::make_shared<const std::string>(std::move(source)), code, "") {}

Field Field::operator[](std::string_view key) const {
  const std::string path = path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  if (!present()) return Field(nullptr, source_, code_, path);
  if (!value_->is_object()) expected("an object");
  return Field(value_->find(std::string(key)), source_, code_, path);
}

Field Field::operator[](size_t index) const {
  const std::string path = path_ + "[" + std::to_string(index) + "]";
  if (!present() || !value_->is_array()) expected("an array");
  const std::vector<Value>& items = value_->as_array();
  if (index >= items.size())
    fail("has " + std::to_string(items.size()) + " elements; element " + std::to_string(index) + " is missing");
  return Field(&items[index], source_, code_, path);
}

void Field::fail(const std::string& what) const {
  throw Error(code_, *source_ + (path_.empty() ? std::string(" ") : ": key " + quote(path_) + " ") + what);
}

void Field::expected(const std::string& expectation) const {
  if (!value_) fail("is missing (expected " + expectation + ")");
  fail("must be " + expectation + ", got " + describe(*value_));
}

bool Field::boolean() const {
  if (!present() || !value_->is_bool()) expected("true or false");
  return value_->as_bool();
}

int64_t Field::integer(IntRange range) const {
  constexpr double kExact = 9007199254740992.0;  // 2^53: larger doubles are not all integers
  if (present() && value_->is_number()) {
    const double d = value_->as_number();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) <= kExact && range.contains(int64_t(d)))
      return int64_t(d);
  }
  expected(range.str());
}

double Field::number(NumRange range) const {
  if (!present() || !value_->is_number() || !range.contains(value_->as_number())) expected(range.str());
  return value_->as_number();
}

const std::string& Field::string() const {
  if (!present() || !value_->is_string()) expected("a string");
  return value_->as_string();
}

const Value& Field::object() const {
  if (!present() || !value_->is_object()) expected("an object");
  return *value_;
}

size_t Field::size() const {
  if (!present() || !value_->is_array()) expected("an array");
  return value_->as_array().size();
}

std::vector<int64_t> Field::integers(IntRange range) const {
  if (!present() || !value_->is_array()) expected("an array (each element " + range.str() + ")");
  std::vector<int64_t> out;
  for (size_t i = 0; i < value_->as_array().size(); ++i) out.push_back((*this)[i].integer(range));
  return out;
}

}  // namespace ocria_rt::json
