#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/json.h"

namespace ocria_rt {

namespace fs = std::filesystem;

// Headers larger than this are treated as corrupt (real ones are a few MB at most).
static constexpr uint64_t kMaxHeaderBytes = 256ull << 20;

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw Error(ErrorCode::kFileError, "cannot open '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw Error(ErrorCode::kFileError, "cannot stat '" + path + "'");
    }
    size_ = size_t(st.st_size);
    if (size_ > 0) {
      data_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data_ == MAP_FAILED) {
        ::close(fd);
        data_ = nullptr;
        throw Error(ErrorCode::kFileError, "cannot map '" + path + "': " + std::strerror(errno));
      }
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(data_, size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* bytes() const { return static_cast<const uint8_t*>(data_); }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

std::string TensorRecord::shape_str() const { return dims_str(shape.data(), int(shape.size())); }

static bool parse_dtype(const std::string& s, DType* out, size_t* elem_size) {
  struct Entry { const char* name; DType dtype; bool supported; size_t size; };
  static const Entry table[] = {
      {"F32", DType::F32, true, 4}, {"BF16", DType::BF16, true, 2}, {"F16", DType::F16, true, 2},
      {"I32", DType::I32, false, 4}, {"F64", DType::F32, false, 8}, {"I64", DType::I32, false, 8},
      {"I16", DType::I32, false, 2}, {"I8", DType::I32, false, 1}, {"U8", DType::U8, true, 1},
      {"BOOL", DType::I32, false, 1}, {"F8_E4M3", DType::F8E4M3, true, 1}, {"F8_E5M2", DType::I32, false, 1},
  };
  for (const Entry& e : table) {
    if (s == e.name) {
      *out = e.dtype;
      *elem_size = e.size;
      return e.supported;
    }
  }
  *elem_size = 0;
  return false;
}

void Checkpoint::add_file(const std::string& path) {
  auto file = std::make_shared<MappedFile>(path);
  auto bad = [&](const std::string& why) { return Error(ErrorCode::kFileError, "safetensors file '" + path + "': " + why); };
  if (file->size() < 8) throw bad("truncated (" + std::to_string(file->size()) + " bytes, no header)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file->bytes(), 8);  // little-endian u64
  if (header_len > kMaxHeaderBytes || header_len > file->size() - 8)
    throw bad("header length " + std::to_string(header_len) + " exceeds the file size " +
              std::to_string(file->size()) + " (truncated or corrupt)");
  json::Value header;
  try {
    header = json::Value::parse(std::string_view(reinterpret_cast<const char*>(file->bytes()) + 8, header_len));
    header.as_object();
  } catch (const std::runtime_error& e) {
    throw bad(std::string("bad header: ") + e.what());
  }
  const uint8_t* data_begin = file->bytes() + 8 + header_len;
  const uint64_t data_size = file->size() - 8 - header_len;
  for (const auto& [name, entry] : header.as_object()) {
    if (name == "__metadata__") continue;
    TensorRecord rec;
    rec.name = name;
    rec.file = path;
    try {
      rec.dtype_str = entry.find("dtype") ? entry.find("dtype")->as_string() : "";
      const json::Value* shape = entry.find("shape");
      const json::Value* offsets = entry.find("data_offsets");
      if (!shape || !offsets || offsets->as_array().size() != 2) throw std::runtime_error("missing shape or data_offsets");
      for (const json::Value& d : shape->as_array()) {
        int64_t n = d.as_int();
        if (n < 0) throw std::runtime_error("negative dimension");
        rec.shape.push_back(n);
      }
      int64_t begin = offsets->as_array()[0].as_int(), end = offsets->as_array()[1].as_int();
      size_t elem = 0;
      rec.dtype_supported = parse_dtype(rec.dtype_str, &rec.dtype, &elem);
      if (elem == 0) throw std::runtime_error("unknown dtype '" + rec.dtype_str + "'");
      uint64_t numel = 1;
      for (int64_t d : rec.shape) numel *= uint64_t(d);
      if (begin < 0 || end < begin || uint64_t(end) > data_size)
        throw std::runtime_error("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                 "] outside the " + std::to_string(data_size) + " data bytes (truncated file?)");
      if (uint64_t(end - begin) != numel * elem)
        throw std::runtime_error("holds " + std::to_string(end - begin) + " bytes but shape " + rec.shape_str() +
                                 " of " + rec.dtype_str + " needs " + std::to_string(numel * elem));
      rec.data = data_begin + begin;
      rec.nbytes = size_t(end - begin);
    } catch (const std::runtime_error& e) {
      throw bad("tensor '" + name + "': " + e.what());
    }
    if (tensors_.count(name)) throw bad("tensor '" + name + "' appears in more than one file");
    tensors_.emplace(name, std::move(rec));
  }
  files_.push_back(std::move(file));
}

Checkpoint Checkpoint::open_file(const std::string& path) {
  Checkpoint ck;
  ck.dir_ = fs::path(path).parent_path().string();
  ck.add_file(path);
  return ck;
}

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint ck;
  ck.dir_ = dir;
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index)) {
    std::ifstream in(index);
    std::stringstream ss;
    ss << in.rdbuf();
    std::vector<std::string> shards;
    try {
      json::Value v = json::Value::parse(ss.str());
      const json::Value* map = v.find("weight_map");
      if (!map) throw std::runtime_error("no 'weight_map'");
      for (const auto& [name, file] : map->as_object()) {
        const std::string& f = file.as_string();
        if (f.find('/') != std::string::npos) throw std::runtime_error("shard name '" + f + "' is not a plain file name");
        bool seen = false;
        for (const auto& s : shards) seen |= s == f;
        if (!seen) shards.push_back(f);
      }
    } catch (const std::runtime_error& e) {
      throw Error(ErrorCode::kFileError, "'" + index.string() + "': " + e.what());
    }
    for (const auto& s : shards) ck.add_file((fs::path(dir) / s).string());
  } else if (fs::exists(single)) {
    ck.add_file(single.string());
  } else {
    throw Error(ErrorCode::kFileError, "no checkpoint in '" + dir + "': neither model.safetensors nor model.safetensors.index.json exists");
  }
  return ck;
}

const TensorRecord* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

namespace {

bool float_dtype(const TensorRecord& rec) {
  return rec.dtype_supported && (rec.dtype == DType::F32 || rec.dtype == DType::BF16 || rec.dtype == DType::F16);
}

}  // namespace

const TensorRecord& Checkpoint::require(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorRecord* rec = find(name);
  if (!rec) throw Error(ErrorCode::kModelError, "checkpoint '" + dir_ + "' lacks tensor '" + name + "'");
  if (!float_dtype(*rec))
    throw Error(ErrorCode::kModelError, "tensor '" + name + "' in '" + rec->file + "' has dtype " + rec->dtype_str +
                                            "; expected BF16, F16 or F32");
  if (rec->shape != shape) {
    throw Error(ErrorCode::kModelError, "tensor '" + name + "' in '" + rec->file + "' has shape " + rec->shape_str() +
                                            "; expected " + dims_str(shape.data(), int(shape.size())));
  }
  return *rec;
}

const TensorRecord& Checkpoint::require_raw(const std::string& name, const std::vector<int64_t>& shape, DType raw) const {
  const TensorRecord* rec = find(name);
  if (!rec) throw Error(ErrorCode::kModelError, "checkpoint '" + dir_ + "' lacks tensor '" + name + "'");
  if (!rec->dtype_supported || rec->dtype != raw)
    throw Error(ErrorCode::kModelError, "tensor '" + name + "' in '" + rec->file + "' has dtype " + rec->dtype_str +
                                            "; expected " + dtype_name(raw));
  if (rec->shape != shape)
    throw Error(ErrorCode::kModelError, "tensor '" + name + "' in '" + rec->file + "' has shape " + rec->shape_str() +
                                            "; expected " + dims_str(shape.data(), int(shape.size())));
  return *rec;
}

bool Checkpoint::has_prefix(const std::string& prefix) const {
  auto it = tensors_.lower_bound(prefix);
  return it != tensors_.end() && it->first.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace ocria_rt
