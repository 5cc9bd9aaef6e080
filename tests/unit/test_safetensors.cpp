#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "scratch_dir.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

class Safetensors : public ScratchDirTest {
 protected:
  std::string file(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

// Random bit patterns that are valid values of `dtype` (finite floats, any integers).
Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  std::uniform_real_distribution<double> real(-100.0, 100.0);
  std::uniform_int_distribution<int64_t> integer(std::numeric_limits<int64_t>::min(),
                                                 std::numeric_limits<int64_t>::max());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (dtype) {
      case DType::F64:
        static_cast<double*>(t.raw())[i] = real(rng);
        break;
      case DType::F32:
        static_cast<float*>(t.raw())[i] = static_cast<float>(real(rng));
        break;
      case DType::BF16:
        static_cast<uint16_t*>(t.raw())[i] = float_to_bf16(static_cast<float>(real(rng)));
        break;
      case DType::F16:
        static_cast<uint16_t*>(t.raw())[i] = float_to_f16(static_cast<float>(real(rng)));
        break;
      case DType::I64:
        static_cast<int64_t*>(t.raw())[i] = integer(rng);
        break;
      case DType::I32:
        static_cast<int32_t*>(t.raw())[i] = static_cast<int32_t>(integer(rng));
        break;
    }
  }
  return t;
}

void expect_same(const Tensor& expected, const Tensor& actual, const std::string& name) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(actual.defined());
  EXPECT_EQ(actual.dtype(), expected.dtype());
  EXPECT_EQ(actual.shape(), expected.shape());
  ASSERT_EQ(actual.nbytes(), expected.nbytes());
  if (expected.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(actual.raw(), expected.raw(), expected.nbytes()), 0);
  }
  // Every tensor handed out must be aligned for its element type.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(actual.raw()) % dtype_size(actual.dtype()), 0u);
}

// Writes a safetensors file from a hand-written header (not padded) and raw data bytes.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               uint64_t declared_length) {
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(declared_length >> (8 * i)));
  out << header << data;
}
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  write_raw(path, header, data, header.size());
}

// The message of the spindle::Error thrown by `body`, or a test failure.
template <class Body>
std::string error_of(Body body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected spindle::Error";
  return "";
}

NamedTensors every_dtype(std::mt19937& rng) {
  return {{"f64", random_tensor({3, 5}, DType::F64, rng)},
          {"f32", random_tensor({7}, DType::F32, rng)},
          {"bf16", random_tensor({2, 3, 3}, DType::BF16, rng)},
          {"f16", random_tensor({5, 1}, DType::F16, rng)},
          {"i64", random_tensor({4}, DType::I64, rng)},
          {"i32", random_tensor({3, 2}, DType::I32, rng)},
          {"scalar", random_tensor({}, DType::F32, rng)},
          {"empty", random_tensor({0, 3}, DType::BF16, rng)}};
}

TEST_F(Safetensors, RoundTripEveryDType) {
  std::mt19937 rng(1234);
  const NamedTensors tensors = every_dtype(rng);
  const std::string path = file("all.safetensors");
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "round trip"}});

  const SafetensorsReader reader = SafetensorsReader::open(path);
  EXPECT_EQ(reader.names(),
            (std::vector<std::string>{"bf16", "empty", "f16", "f32", "f64", "i32", "i64", "scalar"}));
  EXPECT_EQ(reader.metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "round trip"}}));
  for (const auto& [name, tensor] : tensors) {
    expect_same(tensor, reader.get(name), name);
    EXPECT_EQ(reader.file_of(name), path);
  }
  EXPECT_EQ(reader.get("scalar").ndim(), 0);
  EXPECT_EQ(reader.get("f64").data<double>()[4], tensors[0].second.data<double>()[4]);
  EXPECT_FALSE(reader.contains("missing"));
  EXPECT_NE(error_of([&] { reader.get("missing"); }).find("missing"), std::string::npos);

  // The header is padded to 8 bytes, so the data section starts aligned.
  std::ifstream in(path, std::ios::binary);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  EXPECT_EQ(length[0] % 8, 0);
}

TEST_F(Safetensors, CheckpointSingleFile) {
  std::mt19937 rng(7);
  const NamedTensors tensors = every_dtype(rng);
  const std::string dir = file("ckpt/nested");
  write_safetensors_checkpoint(dir, tensors);
  EXPECT_TRUE(fs::is_regular_file(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));

  const SafetensorsReader reader = SafetensorsReader::open(dir);
  EXPECT_EQ(reader.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  for (const auto& [name, tensor] : tensors) expect_same(tensor, reader.get(name), name);
}

TEST_F(Safetensors, ShardedRoundTrip) {
  std::mt19937 rng(99);
  NamedTensors tensors;
  for (int i = 0; i < 10; ++i)
    tensors.emplace_back("layer." + std::to_string(i), random_tensor({16}, DType::F32, rng));
  tensors.emplace_back("big", random_tensor({100}, DType::F64, rng));  // larger than one shard
  const std::string dir = file("sharded");
  write_safetensors_checkpoint(dir, tensors, 200);

  // 3 tensors of 64 bytes per 200-byte shard: 4 shards, then the oversized tensor alone.
  std::vector<std::string> expected = {"model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors",
                                       "model-00003-of-00005.safetensors", "model-00004-of-00005.safetensors",
                                       "model-00005-of-00005.safetensors", "model.safetensors.index.json"};
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(dir)) found.push_back(entry.path().filename().string());
  std::sort(found.begin(), found.end());
  EXPECT_EQ(found, expected);

  std::ifstream index_file(fs::path(dir) / "model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(index_file);
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 10 * 64 + 800);
  EXPECT_EQ(index["weight_map"]["layer.0"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["layer.9"], "model-00004-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["big"], "model-00005-of-00005.safetensors");

  for (const std::string& path : {dir, (fs::path(dir) / "model.safetensors.index.json").string()}) {
    const SafetensorsReader reader = SafetensorsReader::open(path);
    EXPECT_EQ(reader.names().size(), tensors.size());
    EXPECT_EQ(reader.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
    for (const auto& [name, tensor] : tensors) expect_same(tensor, reader.get(name), name);
    EXPECT_EQ(fs::path(reader.file_of("layer.4")).filename(), "model-00002-of-00005.safetensors");
  }

  // Each shard carries the metadata transformers expects.
  const SafetensorsReader shard = SafetensorsReader::open((fs::path(dir) / expected[2]).string());
  EXPECT_EQ(shard.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

  // Saving a small checkpoint over the sharded one must not leave the old index shadowing it.
  write_safetensors_checkpoint(dir, {tensors[0]});
  const SafetensorsReader reread = SafetensorsReader::open(dir);
  EXPECT_EQ(reread.names(), std::vector<std::string>{"layer.0"});
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / expected[0]));
}

TEST_F(Safetensors, ShardMissingTensorIsNamed) {
  write_safetensors(file("a.safetensors"), {{"x", Tensor::zeros({2}, DType::F32)}});
  std::ofstream(file("model.safetensors.index.json"))
      << R"({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})";
  const std::string message = error_of([&] { SafetensorsReader::open(dir_.string()); });
  EXPECT_NE(message.find("'y'"), std::string::npos) << message;
  EXPECT_NE(message.find("a.safetensors"), std::string::npos) << message;
}

TEST_F(Safetensors, TruncatedFile) {
  const std::string path = file("truncated.safetensors");
  write_safetensors(path,
                    {{"first", Tensor::zeros({4}, DType::F32)}, {"weight", Tensor::zeros({64}, DType::F32)}});
  fs::resize_file(path, fs::file_size(path) - 10);
  const std::string message = error_of([&] { SafetensorsReader::open(path); });
  EXPECT_TRUE(message.find("truncat") != std::string::npos || message.find("shorter") != std::string::npos)
      << message;
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("'weight'"), std::string::npos) << message;
}

TEST_F(Safetensors, UnsupportedDType) {
  const std::string path = file("fp8.safetensors");
  write_raw(path, R"({"w.scale":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})",
            std::string(2, '\0'));
  const std::string message = error_of([&] { SafetensorsReader::open(path); });
  EXPECT_NE(message.find("F8_E4M3"), std::string::npos) << message;
  EXPECT_NE(message.find("w.scale"), std::string::npos) << message;
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("BF16"), std::string::npos) << message;  // lists what is supported
}

TEST_F(Safetensors, HeaderLengthBeyondFile) {
  const std::string path = file("short_header.safetensors");
  write_raw(path, "{}", "", 1000);
  const std::string message = error_of([&] { SafetensorsReader::open(path); });
  EXPECT_NE(message.find("1000"), std::string::npos) << message;
  EXPECT_NE(message.find(path), std::string::npos) << message;
}

TEST_F(Safetensors, MalformedFiles) {
  const std::string path = file("bad.safetensors");
  auto message_for = [&](const std::string& header, const std::string& data) {
    write_raw(path, header, data);
    return error_of([&] { SafetensorsReader::open(path); });
  };
  EXPECT_NE(message_for("not json", "").find("not valid JSON"), std::string::npos);
  EXPECT_NE(message_for(R"({"a":{"dtype":"F32","shape":[1]}})", "1234").find("data_offsets"),
            std::string::npos);
  EXPECT_NE(
      message_for(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "1234").find("out of order"),
      std::string::npos);
  EXPECT_NE(message_for(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "1234").find("needs 8"),
            std::string::npos);
  EXPECT_NE(message_for(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                        "1234")
                .find("duplicate entry 'a'"),
            std::string::npos);
  EXPECT_NE(message_for(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "1234").find("shape"),
            std::string::npos);

  std::ofstream(path, std::ios::binary | std::ios::trunc) << "abc";
  EXPECT_NE(error_of([&] { SafetensorsReader::open(path); }).find("shorter than the 8-byte"),
            std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsReader::open(file("absent.safetensors")); }).find("does not exist"),
            std::string::npos);
}

TEST_F(Safetensors, MisalignedDataIsCopied) {
  // Header padded so the data starts at 5 mod 8 and "b" one byte after "a": both misaligned.
  std::mt19937 rng(5);
  const Tensor a = random_tensor({3}, DType::F64, rng);
  const Tensor b = random_tensor({5}, DType::F32, rng);
  std::string header = R"({"a":{"dtype":"F64","shape":[3],"data_offsets":[0,24]},)"
                       R"("b":{"dtype":"F32","shape":[5],"data_offsets":[25,45]}})";
  header.append((8 - (header.size() + 8) % 8 + 5) % 8, ' ');  // data start = 5 mod 8
  ASSERT_EQ((8 + header.size()) % 8, 5u);
  std::string data(static_cast<const char*>(a.raw()), 24);
  data += '\x7f';
  data.append(static_cast<const char*>(b.raw()), 20);
  const std::string path = file("misaligned.safetensors");
  write_raw(path, header, data);

  const SafetensorsReader reader = SafetensorsReader::open(path);
  expect_same(a, reader.get("a"), "a");
  expect_same(b, reader.get("b"), "b");
  for (int i = 0; i < 3; ++i) EXPECT_EQ(reader.get("a").data<double>()[i], a.data<double>()[i]);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(reader.get("b").data<float>()[i], b.data<float>()[i]);
}

TEST_F(Safetensors, FailedWriteKeepsOldFile) {
  std::mt19937 rng(11);
  const Tensor original = random_tensor({8}, DType::F32, rng);
  const std::string path = file("model.safetensors");
  write_safetensors(path, {{"w", original}});
  const std::vector<std::string> before = listing();

  // An undefined tensor is rejected; the old file stays and no temporary file is left.
  const std::string message = error_of([&] {
    write_safetensors(path, {{"w", Tensor::zeros({8}, DType::F32)}, {"bad", Tensor()}});
  });
  EXPECT_NE(message.find("'bad'"), std::string::npos) << message;
  EXPECT_EQ(listing(), before);
  expect_same(original, SafetensorsReader::open(path).get("w"), "w");

  // A failure at rename (the target is a non-empty directory) removes the temporary file.
  const std::string blocked = file("blocked");
  fs::create_directories(fs::path(blocked) / "inside");
  EXPECT_NE(error_of([&] {
              write_safetensors(blocked, {{"w", original}});
            }).find("rename"),
            std::string::npos);
  EXPECT_EQ(listing(), (std::vector<std::string>{"blocked", "model.safetensors"}));
}

TEST_F(Safetensors, DirectoryResolution) {
  EXPECT_NE(error_of([&] { SafetensorsReader::open(dir_.string()); }).find("model.safetensors"),
            std::string::npos);

  write_safetensors(file("only.safetensors"), {{"x", Tensor::zeros({1}, DType::I32)}});
  EXPECT_EQ(SafetensorsReader::open(dir_.string()).file_of("x"), file("only.safetensors"));

  write_safetensors(file("other.safetensors"), {{"y", Tensor::zeros({1}, DType::I32)}});
  const std::string message = error_of([&] { SafetensorsReader::open(dir_.string()); });
  EXPECT_NE(message.find("only.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("other.safetensors"), std::string::npos) << message;

  write_safetensors(file("model.safetensors"), {{"z", Tensor::zeros({1}, DType::I32)}});
  EXPECT_EQ(SafetensorsReader::open(dir_.string()).names(), std::vector<std::string>{"z"});
}

}  // namespace
}  // namespace spindle
