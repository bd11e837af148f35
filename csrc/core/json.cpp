#include "core/json.h"

#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace ocria_rt::json {

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

  double parse_number() {
    size_t start = pos_;
    while (pos_ < s_.size() && std::string_view("+-0123456789.eE").find(s_[pos_]) != std::string_view::npos) ++pos_;
    if (pos_ == start) fail("unexpected character");
    std::string text(s_.substr(start, pos_ - start));
    char* end = nullptr;
    double d = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size()) fail("malformed number");
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
      char c = s_[pos_++];
      if (c == '"') return out;
      if (c != '\\') { out += c; continue; }
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
          if (cp >= 0xD800 && cp < 0xDC00 && s_.substr(pos_, 2) == "\\u") {  // surrogate pair
            pos_ += 2;
            uint32_t lo = parse_hex4();
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

}  // namespace ocria_rt::json
