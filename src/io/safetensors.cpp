#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

namespace spindle {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kSupportedDTypes = "F64, F32, BF16, F16, I64, I32";

std::optional<DType> dtype_from_safetensors(const std::string& name) {
  if (name == "F64") return DType::F64;
  if (name == "F32") return DType::F32;
  if (name == "BF16") return DType::BF16;
  if (name == "F16") return DType::F16;
  if (name == "I64") return DType::I64;
  if (name == "I32") return DType::I32;
  return std::nullopt;
}

const char* dtype_to_safetensors(DType dtype) {
  switch (dtype) {
    case DType::F64:
      return "F64";
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
  }
  fail("unknown dtype code ", static_cast<int>(dtype));
}

std::string errno_text() { return std::strerror(errno); }

// A read-only mapping of a whole file; tensors borrowed from it hold a shared_ptr to it.
struct MappedFile {
  const char* data = nullptr;
  size_t size = 0;
  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data != nullptr) munmap(const_cast<char*>(data), size);
  }
};

std::shared_ptr<MappedFile> map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open safetensors file ", path, ": ", errno_text());
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    const std::string reason = errno_text();
    ::close(fd);
    fail("cannot stat safetensors file ", path, ": ", reason);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    fail("safetensors path ", path, " is not a regular file");
  }
  const auto size = static_cast<size_t>(info.st_size);
  if (size < 8) {
    ::close(fd);
    fail("safetensors file ", path, " is ", size,
         " bytes, shorter than the 8-byte header length field: truncated or not a safetensors file");
  }
  void* data = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string reason = errno_text();
  ::close(fd);  // the mapping stays valid without the descriptor
  if (data == MAP_FAILED) fail("cannot mmap safetensors file ", path, " (", size, " bytes): ", reason);
  auto mapped = std::make_shared<MappedFile>();
  mapped->data = static_cast<const char*>(data);
  mapped->size = size;
  return mapped;
}

// Parses JSON, rejecting duplicate keys in any object (nlohmann would silently keep one of them).
// `what` names the document in messages.
json parse_json_unique(const char* begin, const char* end, const std::string& what) {
  std::vector<std::set<std::string>> keys;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(key).second) {
        // Depth 1 holds the tensor names of a header and the top-level keys of an index.
        fail(what, ": duplicate ", depth == 1 ? "entry" : "key", " '", key, "'");
      }
    }
    return true;
  };
  try {
    return json::parse(begin, end, callback);
  } catch (const json::exception& e) {
    fail(what, " is not valid JSON: ", e.what());
  }
}

// Reads a JSON integer in [0, INT64_MAX]; `what` describes the field for messages.
int64_t json_nonnegative(const json& value, const std::string& what) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    check(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), what, " is too large: ", v);
    return static_cast<int64_t>(v);
  }
  check(value.is_number_integer() && value.get<int64_t>() >= 0, what, " must be a non-negative integer, got ",
        value.dump());
  return value.get<int64_t>();
}

struct FileContents {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

FileContents read_file(const std::string& path) {
  std::shared_ptr<MappedFile> file = map_file(path);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = (header_length << 8) | static_cast<unsigned char>(file->data[i]);
  const uint64_t available = file->size - 8;
  check(header_length <= available, "safetensors file ", path, " declares a ", header_length,
        "-byte JSON header but only ", available,
        " bytes follow the length field: the file is truncated or not a safetensors file");

  const char* header_begin = file->data + 8;
  const json header =
      parse_json_unique(header_begin, header_begin + header_length, "header of safetensors file " + path);
  check(header.is_object(), "header of safetensors file ", path, " is not a JSON object");

  const char* data_begin = header_begin + header_length;
  const auto data_size = static_cast<uint64_t>(available - header_length);
  FileContents out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      check(entry.is_object(), "__metadata__ of safetensors file ", path, " is not a JSON object");
      for (const auto& [key, value] : entry.items()) {
        check(value.is_string(), "__metadata__ entry '", key, "' of safetensors file ", path,
              " is not a string: ", value.dump());
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "' in safetensors file " + path;
    check(entry.is_object(), where, ": header entry is not a JSON object");
    check(entry.contains("dtype") && entry["dtype"].is_string(), where, ": missing string field 'dtype'");
    const auto dtype_text = entry["dtype"].get<std::string>();
    const std::optional<DType> dtype = dtype_from_safetensors(dtype_text);
    check(dtype.has_value(), where, " has dtype ", dtype_text,
          ", which Spindle does not support (supported: ", kSupportedDTypes, ")");

    check(entry.contains("shape") && entry["shape"].is_array(), where, ": missing array field 'shape'");
    Shape shape;
    uint64_t bytes = dtype_size(*dtype);
    for (const json& d : entry["shape"]) {
      shape.push_back(json_nonnegative(d, where + ": shape dimension"));
      // Checked so that a hostile shape cannot wrap around and pass the size check below.
      check(!__builtin_mul_overflow(bytes, static_cast<uint64_t>(shape.back()), &bytes), where, ": shape ",
            entry["shape"].dump(), " is too large");
    }

    check(entry.contains("data_offsets") && entry["data_offsets"].is_array() &&
              entry["data_offsets"].size() == 2,
          where, ": missing field 'data_offsets' = [begin, end]");
    const auto begin =
        static_cast<uint64_t>(json_nonnegative(entry["data_offsets"][0], where + ": data begin"));
    const auto end = static_cast<uint64_t>(json_nonnegative(entry["data_offsets"][1], where + ": data end"));
    check(begin <= end, where, ": data_offsets [", begin, ", ", end, "] are out of order");
    check(end - begin == bytes, where, ": data_offsets [", begin, ", ", end, "] span ", end - begin,
          " bytes but ", dtype_text, shape_string(shape), " needs ", bytes);
    check(end <= data_size, where, ": data_offsets [", begin, ", ", end, "] reach past the end of the file (",
          data_size,
          " data bytes after the header): the file is truncated, shorter than its header declares");

    const char* pointer = data_begin + begin;
    Tensor tensor;
    if (bytes == 0) {
      tensor = Tensor::empty(shape, *dtype, MemoryCategory::Weights);
    } else if (reinterpret_cast<uintptr_t>(pointer) % dtype_size(*dtype) != 0) {
      // The format does not align data; a misaligned view would make data<T>() undefined behaviour.
      tensor = Tensor::empty(shape, *dtype, MemoryCategory::Weights);
      std::memcpy(tensor.raw(), pointer, bytes);
    } else {
      tensor = Tensor::borrow(file, pointer, shape, *dtype);
    }
    out.tensors.emplace(name, std::move(tensor));
  }
  return out;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "cannot open ", path, ": ", errno_text());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  check(!in.bad(), "cannot read ", path);
  return text;
}

// Chooses the file to open inside a checkpoint directory.
std::string resolve_directory(const fs::path& dir) {
  if (fs::is_regular_file(dir / kIndexName)) return (dir / kIndexName).string();
  if (fs::is_regular_file(dir / kSingleName)) return (dir / kSingleName).string();
  std::vector<std::string> candidates;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec) && it->path().extension() == ".safetensors") {
      candidates.push_back(it->path().filename().string());
    }
  }
  check(!ec, "cannot list checkpoint directory ", dir.string(), ": ", ec.message());
  if (candidates.size() == 1) return (dir / candidates[0]).string();
  std::ostringstream found;
  std::sort(candidates.begin(), candidates.end());
  for (size_t i = 0; i < candidates.size(); ++i) found << (i ? ", " : "") << candidates[i];
  fail("checkpoint directory ", dir.string(), " has neither ", kIndexName, " nor ", kSingleName,
       candidates.empty()
           ? " nor any *.safetensors file"
           : ", and more than one *.safetensors file, so which to load is ambiguous: " + found.str());
}

// Closes and removes the temporary file unless committed, so a failed write leaves nothing behind.
class TempFile {
 public:
  explicit TempFile(std::string target) : target_(std::move(target)) {
    path_ = target_ + ".tmp." + std::to_string(::getpid());
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create ", path_, " to write ", target_, ": ", errno_text());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }

  void write(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      // Bounded chunks: Linux writes at most ~2 GiB per call anyway.
      const ssize_t n = ::write(fd_, p, std::min<size_t>(size, size_t{1} << 30));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        fail("cannot write ", path_, " (for ", target_, "): ", n < 0 ? errno_text() : "no progress");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }

  // Makes the data durable, then atomically replaces the target.
  void commit() {
    if (::fsync(fd_) != 0) fail("cannot fsync ", path_, " (for ", target_, "): ", errno_text());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close ", path_, " (for ", target_, "): ", errno_text());
    if (::rename(path_.c_str(), target_.c_str()) != 0) {
      fail("cannot rename ", path_, " to ", target_, ": ", errno_text());
    }
    committed_ = true;
    // Persist the rename itself; best effort, as some file systems refuse fsync on directories.
    fs::path dir = fs::path(target_).parent_path();
    if (dir.empty()) dir = ".";
    const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd >= 0) {
      ::fsync(dir_fd);
      ::close(dir_fd);
    }
  }

 private:
  std::string target_;
  std::string path_;
  int fd_ = -1;
  bool committed_ = false;
};

void write_text_atomically(const std::string& path, const std::string& text) {
  TempFile file(path);
  file.write(text.data(), text.size());
  file.commit();
}

std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index, count);
  return name;
}

// Matches shard_name()'s pattern, model-NNNNN-of-NNNNN.safetensors.
bool is_shard_name(const std::string& name) {
  const std::string pattern = "model-#####-of-#####.safetensors";
  if (name.size() != pattern.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const bool ok = pattern[i] == '#' ? (name[i] >= '0' && name[i] <= '9') : name[i] == pattern[i];
    if (!ok) return false;
  }
  return true;
}

}  // namespace

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  check(!ec && fs::exists(status), "checkpoint ", path, " does not exist");
  const std::string target = fs::is_directory(status) ? resolve_directory(path) : path;

  SafetensorsReader reader;
  reader.path_ = path;
  if (fs::path(target).filename().string().ends_with(".json")) {
    const std::string text = read_text_file(target);
    const json index =
        parse_json_unique(text.data(), text.data() + text.size(), "safetensors index " + target);
    check(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
          "safetensors index ", target, " has no \"weight_map\" object");
    const fs::path dir = fs::path(target).parent_path();
    // Each shard is mapped once, however many tensors it holds.
    std::map<std::string, FileContents> shards;
    for (const auto& [name, file] : index["weight_map"].items()) {
      check(file.is_string(), "safetensors index ", target, ": weight_map entry '", name,
            "' is not a file name");
      const std::string shard = (dir / file.get<std::string>()).string();
      auto it = shards.find(shard);
      if (it == shards.end()) it = shards.emplace(shard, read_file(shard)).first;
      auto tensor = it->second.tensors.find(name);
      check(tensor != it->second.tensors.end(), "tensor '", name, "' is listed in ", target, " as being in ",
            shard, ", but that file does not contain it");
      reader.tensors_.emplace(name, tensor->second);
      reader.files_.emplace(name, shard);
    }
    if (!shards.empty()) reader.metadata_ = shards.begin()->second.metadata;
  } else {
    FileContents contents = read_file(target);
    for (const auto& [name, tensor] : contents.tensors) reader.files_.emplace(name, target);
    reader.tensors_ = std::move(contents.tensors);
    reader.metadata_ = std::move(contents.metadata);
  }
  for (const auto& entry : reader.tensors_) reader.names_.push_back(entry.first);
  return reader;
}

const Tensor& SafetensorsReader::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    fail("tensor '", name, "' not found in checkpoint ", path_, " (", tensors_.size(), " tensors)");
  return it->second;
}

const std::string& SafetensorsReader::file_of(const std::string& name) const {
  auto it = files_.find(name);
  if (it == files_.end()) fail("tensor '", name, "' not found in checkpoint ", path_);
  return it->second;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Validate everything before creating any file.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    check(!name.empty() && name != "__metadata__", "cannot write ", path, ": invalid tensor name '", name,
          "'");
    check(seen.insert(name).second, "cannot write ", path, ": duplicate tensor name '", name, "'");
    check(tensor.defined(), "cannot write ", path, ": tensor '", name, "' is undefined");
    check(tensor.device() == Device::CPU, "cannot write ", path, ": tensor '", name, "' is on ",
          device_name(tensor.device()), ", expected cpu");
    check(tensor.is_contiguous(), "cannot write ", path, ": tensor '", name, "' (", tensor.describe(),
          ") is not contiguous");
    const uint64_t end = offset + tensor.nbytes();
    header[name] = {{"dtype", dtype_to_safetensors(tensor.dtype())},
                    {"shape", tensor.shape()},
                    {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  // Padding keeps the data section 8-byte aligned, as the reference implementation does.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i)
    length[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  TempFile file(path);
  file.write(length, sizeof(length));
  file.write(text.data(), text.size());
  for (const auto& entry : tensors) {
    if (entry.second.nbytes() > 0) file.write(entry.second.raw(), entry.second.nbytes());
  }
  file.commit();
}

void write_safetensors_checkpoint(const std::string& dir, const NamedTensors& tensors,
                                  int64_t max_shard_bytes) {
  check(max_shard_bytes > 0, "max_shard_bytes must be positive, got ", max_shard_bytes);
  std::error_code ec;
  fs::create_directories(dir, ec);
  check(!ec, "cannot create checkpoint directory ", dir, ": ", ec.message());
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const fs::path base(dir);

  int64_t total = 0;
  for (const auto& entry : tensors) total += static_cast<int64_t>(entry.second.nbytes());

  std::set<std::string> written;
  if (total <= max_shard_bytes) {
    write_safetensors((base / kSingleName).string(), tensors, metadata);
    written.insert(kSingleName);
  } else {
    // Greedy packing in the given order; a tensor larger than the limit gets a shard of its own.
    std::vector<NamedTensors> shards(1);
    int64_t shard_bytes = 0;
    for (const auto& entry : tensors) {
      const auto bytes = static_cast<int64_t>(entry.second.nbytes());
      if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back(entry);
      shard_bytes += bytes;
    }
    json weight_map = json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name = shard_name(i + 1, shards.size());
      write_safetensors((base / name).string(), shards[i], metadata);
      written.insert(name);
      for (const auto& entry : shards[i]) weight_map[entry.first] = name;
    }
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text_atomically((base / kIndexName).string(), index.dump(2) + "\n");
    written.insert(kIndexName);
  }

  // A stale index or shard from an earlier save would shadow or mix with this one when the
  // directory is opened, so remove Spindle/Hugging Face checkpoint files this save did not write.
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(base, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool ours = name == kSingleName || name == kIndexName || is_shard_name(name);
    std::error_code ignored;
    if (ours && !written.count(name) && it->is_regular_file(ignored)) stale.push_back(it->path());
  }
  for (const fs::path& file : stale) fs::remove(file, ec);
}

}  // namespace spindle
