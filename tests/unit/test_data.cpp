// The data pipeline: tokenizer, FASTA/u32/Megatron sources, windows, SHA-256, `data get`.
// Every fixture is written by the test itself; nothing here needs the network.
#include <gtest/gtest.h>
#include <htslib/bgzf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/process.h"
#include "core/random.h"
#include "core/sha256.h"
#include "data/fasta_sequences.h"
#include "data/fetch.h"
#include "data/megatron_dataset.h"
#include "data/nucleotide_tokenizer.h"
#include "data/sequence_source.h"
#include "data/token_runs.h"
#include "data/token_source.h"
#include "data/u32_sequences.h"
#include "data/window_sampler.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;

static_assert(kNucleotideVocab == 9);

// The message of the spindle::Error that `body` throws ("" when it throws none).
template <class Body>
std::string error_of(Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR(statement, ...)                                                                  \
  do {                                                                                                \
    const std::string message_ = error_of([&] { statement; });                                        \
    EXPECT_FALSE(message_.empty()) << "no error from " #statement;                                    \
    for (const std::string& part_ : std::initializer_list<std::string>{__VA_ARGS__}) {                \
      EXPECT_NE(message_.find(part_), std::string::npos) << "'" << part_ << "' not in: " << message_; \
    }                                                                                                 \
  } while (0)

// A fresh directory per test, removed afterwards.
class Data : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("spindle_data_" + std::string(info->name()) + "_" +
                                        std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add);
    fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// Tokenizer

TEST(NucleotideTokenizer, EncodesBasesAndFoldsCase) {
  const NucleotideTokenizer tokenizer;
  EXPECT_EQ(tokenizer.encode("ACGTNacgtn"), (std::vector<int32_t>{4, 5, 6, 7, 8, 4, 5, 6, 7, 8}));
  EXPECT_EQ(tokenizer.encode('g'), kTokenG);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("acgTN")), "ACGTN");
}

TEST(NucleotideTokenizer, IupacCodesMapToN) {
  const NucleotideTokenizer tokenizer;
  for (int32_t id : tokenizer.encode("RYKMSWBDHVrykmswbdhv")) EXPECT_EQ(id, kTokenN);
}

TEST(NucleotideTokenizer, SpecialTokensComeFirst) {
  const NucleotideTokenizer tokenizer;
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{0, 1, 2, 3, 4}), "<pad><bos><eos><unk>A");
  EXPECT_EQ(NucleotideTokenizer::token_text(kTokenEos), "<eos>");
  EXPECT_ERROR(tokenizer.decode(std::vector<int32_t>{4, 9}), "token id 9", "index 1", "vocabulary of 9");
  EXPECT_ERROR(tokenizer.decode(std::vector<int32_t>{-1}), "token id -1");
}

TEST(NucleotideTokenizer, InvalidCharacterNamesItsByteAndPosition) {
  const NucleotideTokenizer tokenizer;
  EXPECT_ERROR(tokenizer.encode("ACGU"), "'U'", "byte 85", "position 3");
  std::vector<int32_t> out(4);
  EXPECT_ERROR(tokenizer.encode(std::string_view("AC-G"), out.data(), 100, "x.fa, sequence 'chr1'"), "'-'",
               "byte 45", "position 102 of x.fa, sequence 'chr1'");
  EXPECT_ERROR(tokenizer.encode(std::string("A\x01", 2)), "'\\x01'", "byte 1", "position 1");
}

TEST(NucleotideTokenizer, LenientMapsUnknownCharactersToUnk) {
  const NucleotideTokenizer tokenizer(/*lenient=*/true);
  EXPECT_EQ(tokenizer.encode("AU-n"), (std::vector<int32_t>{kTokenA, kTokenUnk, kTokenUnk, kTokenN}));
}

// ---------------------------------------------------------------------------------------------
// FASTA

struct Record {
  std::string name;
  std::string bases;
};

// Three sequences: mixed case, an N run and IUPAC codes, one short; lines of `width` bases.
std::vector<Record> sample_records() {
  Random random(5);
  const char* letters = "ACGTacgt";
  std::vector<Record> records = {{"chr1", ""}, {"chr2", ""}, {"chr3", ""}};
  for (int i = 0; i < 1000; ++i) records[0].bases += (i >= 400 && i < 450) ? 'N' : letters[random.next() % 8];
  for (int i = 0; i < 777; ++i) records[1].bases += i % 97 == 0 ? 'R' : letters[random.next() % 8];
  records[2].bases = "ACGTNacgtnRYKMSWBDHV";
  return records;
}

std::string fasta_text(const std::vector<Record>& records, size_t width = 60) {
  std::string text;
  for (const auto& r : records) {
    text += ">" + r.name + " description text\n";
    for (size_t at = 0; at < r.bases.size(); at += width) text += r.bases.substr(at, width) + "\n";
  }
  return text;
}

void write_plain(const std::string& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary);
  file << text;
}

// mode "w": bgzip; "wg": plain gzip. Written through htslib, as samtools would.
void write_compressed(const std::string& path, const std::string& text, const char* mode) {
  BGZF* fp = bgzf_open(path.c_str(), mode);
  ASSERT_NE(fp, nullptr);
  ASSERT_EQ(bgzf_write(fp, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  ASSERT_EQ(bgzf_close(fp), 0);
}

int compression_of(const std::string& path) {
  BGZF* fp = bgzf_open(path.c_str(), "r");
  const int compression = bgzf_compression(fp);
  bgzf_close(fp);
  return compression;
}

// Random reads (and the edges) equal the tokenizer applied to the plain text.
void expect_reads_match(const TokenSequences& data, const std::vector<Record>& records) {
  const NucleotideTokenizer tokenizer;
  ASSERT_EQ(data.size(), static_cast<int64_t>(records.size()));
  Random random(17);
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(data.name(static_cast<int64_t>(i)), records[i].name);
    const auto n = static_cast<int64_t>(records[i].bases.size());
    ASSERT_EQ(data.length(static_cast<int64_t>(i)), n);
    const std::vector<int32_t> expected = tokenizer.encode(records[i].bases);
    EXPECT_EQ(data.read(static_cast<int64_t>(i), 0, n), expected);
    for (int trial = 0; trial < 50; ++trial) {
      const auto start = static_cast<int64_t>(random.next() % static_cast<uint64_t>(n));
      const auto count = static_cast<int64_t>(random.next() % static_cast<uint64_t>(n - start + 1));
      const std::vector<int32_t> got = data.read(static_cast<int64_t>(i), start, count);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), expected.begin() + start))
          << records[i].name << " " << start;
    }
  }
  const auto n0 = static_cast<int64_t>(records[0].bases.size());
  EXPECT_ERROR(data.read(0, n0 - 5, 10),
               "outside sequence '" + records[0].name + "' of length " + std::to_string(n0));
  EXPECT_ERROR(data.read(7, 0, 1), "sequence index 7");
}

TEST_F(Data, FastaPlainIsReadThroughFaidx) {
  const auto records = sample_records();
  write_plain(path("a.fa"), fasta_text(records));
  FastaSequences data(path("a.fa"));
  EXPECT_FALSE(data.in_memory());
  EXPECT_TRUE(fs::exists(path("a.fa.fai")));
  expect_reads_match(data, records);
  FastaSequences again(path("a.fa"));  // through the existing index
  expect_reads_match(again, records);
}

TEST_F(Data, FastaBgzipIsReadThroughFaidx) {
  const auto records = sample_records();
  write_compressed(path("a.fa.gz"), fasta_text(records), "w");
  ASSERT_EQ(compression_of(path("a.fa.gz")), 2);  // bgzf
  FastaSequences data(path("a.fa.gz"));
  EXPECT_FALSE(data.in_memory());
  EXPECT_TRUE(fs::exists(path("a.fa.gz.fai")));
  EXPECT_TRUE(fs::exists(path("a.fa.gz.gzi")));
  expect_reads_match(data, records);
}

TEST_F(Data, FastaGzipIsReadIntoMemory) {
  const auto records = sample_records();
  write_compressed(path("a.fa.gz"), fasta_text(records), "wg");
  ASSERT_EQ(compression_of(path("a.fa.gz")), 1);  // plain gzip
  const auto data = open_sequences(path("a.fa.gz"));
  EXPECT_TRUE(dynamic_cast<const FastaSequences&>(*data).in_memory());
  expect_reads_match(*data, records);
}

TEST_F(Data, FastaWithUnequalLinesFallsBackToMemory) {
  const auto records = sample_records();
  // chr1 in lines of 70, 30, then 70 bases: faidx needs equal lines.
  const std::string& chr1 = records[0].bases;
  std::string text = ">chr1\n" + chr1.substr(0, 70) + "\n" + chr1.substr(70, 30) + "\n";
  for (size_t at = 100; at < chr1.size(); at += 70) text += chr1.substr(at, 70) + "\n";
  text += fasta_text({records[1], records[2]}, 50);
  write_plain(path("ragged.fa"), text);
  FastaSequences data(path("ragged.fa"));
  EXPECT_TRUE(data.in_memory());
  expect_reads_match(data, records);
}

TEST_F(Data, FastaWhoseIndexCannotBeWrittenFallsBackToMemory) {
  // A directory where the .fai should go: neither loadable nor writable, even for root.
  const auto records = sample_records();
  write_plain(path("a.fa"), fasta_text(records));
  fs::create_directories(path("a.fa.fai"));
  FastaSequences data(path("a.fa"));
  EXPECT_TRUE(data.in_memory());
  expect_reads_match(data, records);
}

TEST_F(Data, FastaChromosomeSelection) {
  const auto records = sample_records();
  write_plain(path("a.fa"), fasta_text(records));
  write_compressed(path("a.fa.gz"), fasta_text(records), "wg");
  for (const std::string& file : {path("a.fa"), path("a.fa.gz")}) {
    SequenceOptions options;
    options.names = {"chr3", "chr1"};
    const auto data = open_sequences(file, options);
    expect_reads_match(*data, {records[2], records[0]});
    options.names = {"chr1", "chr9"};
    EXPECT_ERROR(open_sequences(file, options), "no sequence named 'chr9'", file, "chr1, chr2, chr3");
    options.names = {"chr2", "chr2"};
    EXPECT_ERROR(open_sequences(file, options), "'chr2' is selected twice");
  }
}

TEST_F(Data, FastaErrorsNameTheFileAndPlace) {
  EXPECT_ERROR(FastaSequences(path("missing.fa")), "FASTA file not found", path("missing.fa"));
  write_plain(path("bad.fa"), ">s1\nACGT\nACXT\n");
  FastaSequences indexed(path("bad.fa"));
  EXPECT_ERROR(indexed.read(0, 0, 8), "'X'", "byte 88", "position 6", path("bad.fa"), "sequence 's1'");
  write_compressed(path("bad.fa.gz"), ">s1\nACGT\nACXT\n", "wg");
  EXPECT_ERROR(FastaSequences(path("bad.fa.gz")), path("bad.fa.gz"), "line 3", "sequence 's1'", "'X'",
               "position 6");
  FastaOptions lenient;
  lenient.lenient = true;
  FastaSequences tolerant(path("bad.fa.gz"), lenient);
  EXPECT_EQ(tolerant.read(0, 4, 4), (std::vector<int32_t>{kTokenA, kTokenC, kTokenUnk, kTokenT}));
  write_compressed(path("headless.fa.gz"), "ACGT\n>s1\nACGT\n", "wg");
  EXPECT_ERROR(FastaSequences(path("headless.fa.gz")), "line 1", "before the first '>' header");
  EXPECT_ERROR(open_sequences(path("x.txt")), "cannot tell the format", "x.txt");
}

// ---------------------------------------------------------------------------------------------
// Raw uint32 token streams

TEST_F(Data, U32StreamRoundTripAndVocabularyCheck) {
  std::vector<int32_t> tokens(1000);
  for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<int32_t>((k * 7) % 50);
  tokens[777] = 123;
  write_u32_tokens(path("t.u32"), tokens);
  EXPECT_EQ(fs::file_size(path("t.u32")), 4000u);
  {  // little-endian on disk
    std::ifstream file(path("t.u32"), std::ios::binary);
    unsigned char bytes[8];
    file.read(reinterpret_cast<char*>(bytes), 8);
    EXPECT_EQ(bytes[4], 7);
    EXPECT_EQ(bytes[5] | bytes[6] | bytes[7], 0);
  }
  SequenceOptions options;
  options.vocab_size = 124;
  const auto data = open_sequences(path("t.u32"), options);
  ASSERT_EQ(data->size(), 1);
  EXPECT_EQ(data->name(0), "t.u32");
  EXPECT_EQ(data->read(0, 0, 1000), tokens);
  EXPECT_EQ(data->read(0, 770, 10), std::vector<int32_t>(tokens.begin() + 770, tokens.begin() + 780));

  U32Sequences small(path("t.u32"), 100);
  EXPECT_EQ(small.read(0, 0, 777), std::vector<int32_t>(tokens.begin(), tokens.begin() + 777));
  EXPECT_ERROR(small.read(0, 700, 100), "token id 123", "position 777", "byte offset 3108",
               "vocabulary of 100", path("t.u32"));

  write_plain(path("odd.u32"), "abcdefg");
  EXPECT_ERROR(U32Sequences(path("odd.u32"), 0), "7 bytes", "not a multiple of 4");
  EXPECT_ERROR(U32Sequences(path("none.u32"), 0), "token file not found", path("none.u32"));
}

// ---------------------------------------------------------------------------------------------
// Megatron indexed datasets

std::vector<unsigned char> file_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(file), {});
}

TEST_F(Data, MegatronLayoutMatchesTheReference) {
  // Two sequences (3 and 1 tokens, uint16) in one document, byte for byte as Megatron writes it.
  MegatronWriter writer(path("two"), MegatronDType::U16);
  writer.add_sequence(std::vector<int32_t>{1, 2, 258});
  writer.add_sequence(std::vector<int32_t>{65535});
  writer.finish();
  const std::vector<unsigned char> expected_idx = {
      'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0,                       // magic
      1,   0,   0,   0,   0,   0,   0,   0,                          // version
      8,                                                             // dtype code: uint16
      2,   0,   0,   0,   0,   0,   0,   0,                          // sequences
      2,   0,   0,   0,   0,   0,   0,   0,                          // document index entries
      3,   0,   0,   0,   1,   0,   0,   0,                          // lengths (int32)
      0,   0,   0,   0,   0,   0,   0,   0, 6, 0, 0, 0, 0, 0, 0, 0,  // byte offsets (int64)
      0,   0,   0,   0,   0,   0,   0,   0, 2, 0, 0, 0, 0, 0, 0, 0,  // document index (int64)
  };
  EXPECT_EQ(file_bytes(path("two.idx")), expected_idx);
  EXPECT_EQ(file_bytes(path("two.bin")), (std::vector<unsigned char>{1, 0, 2, 0, 2, 1, 255, 255}));
  EXPECT_FALSE(fs::exists(path("two.bin.tmp.megatron")));
}

TEST_F(Data, MegatronRoundTrip) {
  Random random(3);
  std::vector<std::vector<int32_t>> sequences;
  for (int s = 0; s < 7; ++s) {
    std::vector<int32_t> tokens(static_cast<size_t>(random.next() % 300 + (s == 3 ? 0 : 1)));
    if (s == 3) tokens.clear();  // an empty sequence is legal
    for (auto& t : tokens) t = static_cast<int32_t>(random.next() % 120);
    sequences.push_back(tokens);
  }
  for (MegatronDType dtype : {MegatronDType::U8, MegatronDType::I8, MegatronDType::I16, MegatronDType::U16,
                              MegatronDType::I32, MegatronDType::I64}) {
    const std::string prefix = path(std::string("ds_") + megatron_dtype_name(dtype));
    MegatronWriter writer(prefix, dtype);
    for (int s = 0; s < 7; ++s) {
      writer.add_sequence(sequences[static_cast<size_t>(s)]);
      if (s == 2 || s == 6) writer.end_document();
    }
    writer.finish();
    for (const std::string& name : {prefix, prefix + ".bin", prefix + ".idx"}) {
      SequenceOptions options;
      options.format = name == prefix ? "megatron" : "auto";
      options.vocab_size = 120;
      const auto data = open_sequences(name, options);
      const auto& megatron = dynamic_cast<const MegatronDataset&>(*data);
      EXPECT_EQ(megatron.dtype(), dtype);
      EXPECT_EQ(megatron.document_index(), (std::vector<int64_t>{0, 3, 7}));
      ASSERT_EQ(data->size(), 7);
      for (int s = 0; s < 7; ++s) {
        const auto& expected = sequences[static_cast<size_t>(s)];
        ASSERT_EQ(data->length(s), static_cast<int64_t>(expected.size()));
        EXPECT_EQ(data->read(s, 0, data->length(s)), expected) << megatron_dtype_name(dtype) << " " << s;
      }
      if (data->length(1) > 5) {
        EXPECT_EQ(data->read(1, 2, 3),
                  std::vector<int32_t>(sequences[1].begin() + 2, sequences[1].begin() + 5));
      }
    }
  }
}

TEST_F(Data, MegatronErrors) {
  write_megatron(path("ds"), {{1, 2, 3}, {4, 200}}, MegatronDType::U8);
  MegatronDataset narrow(path("ds"), 100);
  EXPECT_ERROR(narrow.read(1, 0, 2), "token id 200", "position 1 of sequence 1", "vocabulary of 100");
  EXPECT_ERROR(write_megatron(path("x"), {{1, 300}}, MegatronDType::U8), "token id 300", "position 1",
               "uint8");
  EXPECT_ERROR(MegatronWriter(path("f"), MegatronDType::F32), "float32");
  EXPECT_FALSE(fs::exists(path("x.bin")));
  EXPECT_FALSE(fs::exists(path("x.bin.tmp.megatron")));

  auto idx = file_bytes(path("ds.idx"));
  auto write_idx = [&](const std::vector<unsigned char>& bytes) {
    std::ofstream file(path("ds.idx"), std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  auto bad = idx;
  bad[0] = 'X';
  write_idx(bad);
  EXPECT_ERROR(MegatronDataset(path("ds"), 0), "MMIDIDX", path("ds.idx"));
  bad = idx;
  bad[17] = 7;
  write_idx(bad);
  EXPECT_ERROR(MegatronDataset(path("ds"), 0), "float32", "integer dtype");
  bad = idx;
  bad.resize(bad.size() - 4);
  write_idx(bad);
  EXPECT_ERROR(MegatronDataset(path("ds"), 0), "too short", "truncated");
  write_idx(idx);
  fs::resize_file(path("ds.bin"), 4);
  EXPECT_ERROR(MegatronDataset(path("ds"), 0), "sequence 1", "outside", path("ds.bin"));
  EXPECT_ERROR(MegatronDataset(path("nothing"), 0), "Megatron index not found", path("nothing.idx"));
}

// ---------------------------------------------------------------------------------------------
// Token runs, windows

// Sequences held in memory, for sampler tests.
class VectorSequences : public TokenSequences {
 public:
  explicit VectorSequences(std::vector<std::vector<int32_t>> tokens) : tokens_(std::move(tokens)) {}
  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  std::string name(int64_t i) const override { return "s" + std::to_string(i); }
  int64_t length(int64_t i) const override {
    return static_cast<int64_t>(tokens_[static_cast<size_t>(i)].size());
  }
  void read(int64_t i, int64_t start, int64_t count, int32_t* out) const override {
    check_range(i, start, count);
    std::copy_n(tokens_[static_cast<size_t>(i)].begin() + start, count, out);
  }
  using TokenSequences::read;
  const std::string& source() const override { return source_; }

 private:
  std::vector<std::vector<int32_t>> tokens_;
  std::string source_ = "memory";
};

// Random bases with N runs at the given [begin, end) ranges.
std::vector<int32_t> bases_with_runs(int64_t length, const std::vector<std::pair<int64_t, int64_t>>& runs,
                                     uint64_t seed) {
  Random random(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(length));
  for (auto& t : tokens) t = kTokenA + static_cast<int32_t>(random.next() % 4);
  for (auto [b, e] : runs) std::fill(tokens.begin() + b, tokens.begin() + e, kTokenN);
  return tokens;
}

int64_t count_n(const std::vector<int32_t>& tokens) {
  return std::count(tokens.begin(), tokens.end(), kTokenN);
}

TEST(TokenRuns, CountsMatchBruteForce) {
  Random random(9);
  std::vector<int32_t> tokens(3000);
  for (auto& t : tokens) t = random.next() % 5 == 0 ? kTokenN : kTokenA;  // many short runs
  std::fill(tokens.begin() + 100, tokens.begin() + 600, kTokenN);
  tokens.back() = kTokenN;
  const VectorSequences data({tokens, std::vector<int32_t>(50, kTokenC)});
  const TokenRuns runs(data, kTokenN);
  EXPECT_EQ(runs.total(0), count_n(tokens));
  EXPECT_EQ(runs.total(1), 0);
  EXPECT_EQ(runs.longest_gap(1), 50);
  for (int trial = 0; trial < 2000; ++trial) {
    const auto start = static_cast<int64_t>(random.next() % 3000);
    const auto length = static_cast<int64_t>(random.next() % (3000 - start + 1));
    EXPECT_EQ(runs.count(0, start, length),
              std::count(tokens.begin() + start, tokens.begin() + start + length, kTokenN));
  }
  for (int64_t length : {1, 7, 40, 500, 2999, 3000}) {
    int64_t best = length + 1, best_start = -1;
    for (int64_t s = 0; s + length <= 3000; ++s) {
      const int64_t n = std::count(tokens.begin() + s, tokens.begin() + s + length, kTokenN);
      if (n < best) best = n, best_start = s;
    }
    EXPECT_EQ(runs.fewest(0, length), std::make_pair(best_start, best)) << length;
  }
}

// A run's one window (bench, route, select): a token text's first tokens, or an N-free window of
// a sequence file, the same every time.
TEST_F(Data, TokenSourceReadsTextsAndSequenceWindows) {
  write_plain(path("t.txt"), "3 1 4\n1 5\n");
  const TokenSource text(path("t.txt"));
  EXPECT_TRUE(text.is_text());
  EXPECT_EQ(text.text_size(), 5);
  EXPECT_EQ(text.window(3, "--length"), (std::vector<int32_t>{3, 1, 4}));
  EXPECT_ERROR(text.window(6, "--seq-len"), "has 5 tokens, --seq-len 6 needs more");

  const std::string bases = "ACGTTGCAACGGTTCA";  // no window of 8 repeats another
  write_plain(path("s.fa"), ">s\nNNNNNN" + bases + "NNNNNN\n");
  const TokenSource fasta(path("s.fa"));
  EXPECT_FALSE(fasta.is_text());
  const std::vector<int32_t> window = fasta.window(8, "--length");
  EXPECT_EQ(fasta.window(8, "--length"), window);
  const std::vector<int32_t> encoded = NucleotideTokenizer().encode(bases);
  EXPECT_NE(std::search(encoded.begin(), encoded.end(), window.begin(), window.end()), encoded.end())
      << "the window is not a stretch of the sequence's N-free bases";
}

TEST(WindowSampler, SameSeedSameWindows) {
  const VectorSequences data({bases_with_runs(5000, {}, 1), bases_with_runs(800, {}, 2)});
  WindowSampler a(data, 100, 42), b(data, 100, 42), c(data, 100, 43);
  int differ = 0;
  for (int k = 0; k < 1000; ++k) {
    const Window wa = a.next(), wb = b.next(), wc = c.next();
    EXPECT_EQ(wa, wb);
    differ += !(wa == wc);
    EXPECT_LE(wa.start + 100, data.length(wa.sequence));
  }
  EXPECT_GT(differ, 900);
  EXPECT_EQ(a.position(), 1000);
}

TEST(WindowSampler, SeekThenNextEqualsTheNextDraw) {
  const VectorSequences data({bases_with_runs(5000, {{1000, 1400}}, 1), bases_with_runs(900, {{0, 100}}, 2)});
  WindowPolicy policy;
  policy.length = 200;
  policy.max_n_fraction = 0.05;
  WindowSampler fresh(data, policy, 7);
  std::vector<Window> draws;
  for (int k = 0; k < 30001; ++k) draws.push_back(fresh.next());

  WindowSampler resumed(data, policy, 7);
  for (int64_t n : {0, 1, 17, 999, 30000, 5}) {  // forward, then back
    resumed.seek(n);
    EXPECT_EQ(resumed.position(), n);
    EXPECT_EQ(resumed.next(), draws[static_cast<size_t>(n)]) << n;
  }
  const auto begin = std::chrono::steady_clock::now();
  resumed.seek(0);
  resumed.seek(30000);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  EXPECT_LT(seconds, 1.0) << "replaying 30000 draws should take milliseconds";
  EXPECT_EQ(resumed.next(), draws[30000]);
}

TEST(WindowSampler, SequencesWeightedByWindowStarts) {
  // 951 and 51 window starts: the first sequence should get ~94.9% of the draws.
  const VectorSequences data({bases_with_runs(1000, {}, 1), bases_with_runs(100, {}, 2)});
  WindowSampler sampler(data, 50, 1);
  int first = 0;
  std::vector<int> starts(951, 0);
  for (int k = 0; k < 40000; ++k) {
    const Window w = sampler.next();
    if (w.sequence == 0) ++first, ++starts[static_cast<size_t>(w.start)];
  }
  EXPECT_NEAR(first / 40000.0, 951.0 / 1002.0, 0.01);
  EXPECT_GT(starts.front() + starts.back(), 0);  // both ends reachable
}

TEST(WindowSampler, NPolicyRejectsWindowsOverNRuns) {
  const std::vector<int32_t> tokens = bases_with_runs(4000, {{1000, 1500}, {3000, 3010}}, 4);
  const VectorSequences data({tokens});
  WindowSampler strict(data, 300, 11, 0.0);
  std::vector<int32_t> window(300);
  for (int k = 0; k < 2000; ++k) {
    const Window w = strict.next(window.data());
    EXPECT_EQ(count_n(window), 0) << w.start;
    EXPECT_EQ(window, std::vector<int32_t>(tokens.begin() + w.start, tokens.begin() + w.start + 300));
  }
  WindowSampler loose(data, 300, 11, 0.1);  // at most 30 N per window
  bool saw_some_n = false;
  for (int k = 0; k < 2000; ++k) {
    const Window w = loose.next(window.data());
    EXPECT_LE(count_n(window), 30);
    saw_some_n |= count_n(window) > 0;
    (void)w;
  }
  EXPECT_TRUE(saw_some_n);
}

TEST(WindowSampler, ClearErrors) {
  const VectorSequences data({bases_with_runs(1000, {}, 1), bases_with_runs(600, {}, 2)});
  EXPECT_ERROR(WindowSampler(data, 2000, 1), "window of 2000 tokens is longer than every sequence", "'s0'",
               "1000 tokens");
  EXPECT_ERROR(WindowSampler(data, 0, 1), "window length must be positive");
  EXPECT_ERROR(WindowSampler(data, 10, 1, 1.5), "max_n_fraction", "1.5");
  const VectorSequences gappy({bases_with_runs(1000, {{100, 110}, {300, 310}, {500, 510}, {700, 710}}, 3)});
  EXPECT_ERROR(WindowSampler(gappy, 400, 1, 0.0), "no window of 400 tokens", "at most 0 N",
               "the fewest is 10", "longest N-free stretch is 290");
  WindowSampler fine(gappy, 400, 1, 0.025);  // 10 N allowed
  EXPECT_LE(TokenRuns(gappy, kTokenN).count(0, fine.next().start, 400), 10);
}

TEST(EvaluationWindows, NonOverlappingStableAndNFree) {
  const VectorSequences data(
      {bases_with_runs(10000, {{2000, 2600}}, 1), bases_with_runs(3000, {}, 2), bases_with_runs(90, {}, 3)});
  const std::vector<Window> windows = evaluation_windows(data, 100, 40, 0.0);
  ASSERT_EQ(windows.size(), 40u);
  EXPECT_EQ(windows, evaluation_windows(data, 100, 40, 0.0));  // stable
  std::set<int64_t> sequences;
  for (size_t k = 0; k < windows.size(); ++k) {
    const Window& w = windows[k];
    sequences.insert(w.sequence);
    EXPECT_LE(w.start + 100, data.length(w.sequence));
    EXPECT_EQ(count_n(data.read(w.sequence, w.start, 100)), 0);
    if (k > 0) {
      EXPECT_GE(w.sequence, windows[k - 1].sequence);
      if (windows[k - 1].sequence == w.sequence) {
        EXPECT_GE(w.start, windows[k - 1].start + 100);
      }
    }
  }
  EXPECT_EQ(sequences, (std::set<int64_t>{0, 1}));  // spread over both long sequences
  EXPECT_LT(windows.front().start, 500);
  EXPECT_GT(windows[29].start, 0);

  // More than there are: all 124 acceptable windows (100 + 30 - 6 over the N run).
  EXPECT_EQ(evaluation_windows(data, 100, 1000, 0.0).size(), 124u);
  EXPECT_ERROR(evaluation_windows(VectorSequences({std::vector<int32_t>(500, kTokenN)}), 100, 4, 0.5),
               "none of the 5 consecutive windows of 100 tokens", "at most 50 N");
  EXPECT_ERROR(evaluation_windows(data, 20000, 4, 0.0), "longer than every sequence", "10000 tokens");
}

TEST_F(Data, WindowsOverARealFastaFile) {
  auto records = sample_records();
  write_compressed(path("a.fa.gz"), fasta_text(records), "w");
  const auto data = open_sequences(path("a.fa.gz"));
  WindowSampler sampler(*data, 64, 3, 0.0);
  std::vector<int32_t> window(64);
  for (int k = 0; k < 200; ++k) {
    const Window w = sampler.next(window.data());
    EXPECT_NE(w.sequence, 2);  // 20 bases: too short
    EXPECT_EQ(count_n(window), 0);
  }
}

// ---------------------------------------------------------------------------------------------
// SHA-256

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_F(Data, Sha256OfAMegabyteInPieces) {
  // byte i = (131 i + i / 256) mod 256; digest checked with sha256sum when this test was written.
  std::string buffer(1 << 20, '\0');
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<char>((i * 131 + (i >> 8)) & 0xff);
  const std::string expected = "c5a21e51df649a4dac048e947d52ab1164616932732d122c8fc75e5955f0b589";
  EXPECT_EQ(sha256_hex(buffer), expected);
  Sha256 hash;
  for (size_t at = 0, piece = 1; at < buffer.size(); at += piece, piece = piece * 3 % 1000 + 1) {
    hash.update(buffer.data() + at, std::min(piece, buffer.size() - at));
  }
  EXPECT_EQ(hash.hex_digest(), expected);
  EXPECT_EQ(hash.hex_digest(), sha256_hex(""));  // starts over after a digest
  write_plain(path("mb.bin"), buffer);
  EXPECT_EQ(sha256_file(path("mb.bin")), expected);
  EXPECT_ERROR(sha256_file(path("none")), "cannot read", path("none"));
}

// ---------------------------------------------------------------------------------------------
// Running programs, `spindle data get` (with a local stand-in for apt-get)

TEST(Process, ExitCodeOutputAndErrors) {
  const ProcessResult result = run_process({"sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(result.exit_code, 3);
  EXPECT_EQ(result.output, "out\n");
  EXPECT_EQ(result.errors, "err\n");
  EXPECT_ERROR(run_process({"no-such-program-spindle"}), "'no-such-program-spindle' not found on PATH");
}

class DataGet : public Data {
 protected:
  void SetUp() override {
    Data::SetUp();
    if (!find_program("dpkg-deb") || !find_program("tar")) GTEST_SKIP() << "needs dpkg-deb and tar";
    // A tiny package with a FASTA file and its index, like vt-examples.
    const fs::path root = dir_ / "pkg";
    fs::create_directories(root / "DEBIAN");
    fs::create_directories(root / "usr/share/doc/fake/ref");
    std::ofstream(root / "DEBIAN/control")
        << "Package: fake-examples\nVersion: 1.0\nArchitecture: all\n"
           "Maintainer: Spindle <spindle@example.org>\nDescription: test\n";
    content_ = ">s\nACGTACGTNN\n";
    write_plain((root / "usr/share/doc/fake/ref/x.fa").string(), content_);
    write_plain((root / "usr/share/doc/fake/ref/x.fa.fai").string(), "s\t10\t3\t10\t11\n");
    // Debian gzips some files under /usr/share/doc: the .gzi comes as .gzi.gz, as in vt-examples.
    write_compressed((root / "usr/share/doc/fake/ref/x.fa.gzi.gz").string(), "gzi bytes", "wg");
    deb_ = path("fake-examples_1.0_all.deb");
    const ProcessResult built =
        run_process({"dpkg-deb", "--root-owner-group", "-Zgzip", "--build", root.string(), deb_});
    ASSERT_EQ(built.exit_code, 0) << built.errors;

    file_ = {"fake", "a test file",        "fake-examples", "./usr/share/doc/fake/ref/x.fa",
             "x.fa", sha256_hex(content_), {".fai", ".gzi"}};
    download_ = [this](const std::string& package, const std::string& into) {
      ++downloads_;
      EXPECT_EQ(package, "fake-examples");
      const std::string copy = (fs::path(into) / fs::path(deb_).filename()).string();
      fs::copy_file(deb_, copy);
      return copy;
    };
    out_dir_ = path("out");
  }

  std::string content_, deb_, out_dir_;
  DataFile file_;
  PackageDownloader download_;
  int downloads_ = 0;
};

TEST_F(DataGet, ExtractsChecksAndSkipsWhenPresent) {
  std::ostringstream log;
  const std::string target = fetch_data_file(file_, out_dir_, download_, log);
  EXPECT_EQ(target, out_dir_ + "/x.fa");
  EXPECT_EQ(downloads_, 1);
  std::ifstream in(target);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), content_);
  EXPECT_TRUE(fs::exists(target + ".fai"));
  std::ifstream gzi(target + ".gzi");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(gzi), {}), "gzi bytes");
  EXPECT_NE(
      log.str().find("wrote " + target + " (" + std::to_string(content_.size()) + " bytes, SHA-256 ok)"),
      std::string::npos)
      << log.str();
  // Only the file and its index are left behind.
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(out_dir_)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"x.fa", "x.fa.fai", "x.fa.gzi"}));

  std::ostringstream again;
  fetch_data_file(file_, out_dir_, download_, again);
  EXPECT_EQ(downloads_, 1);
  EXPECT_NE(again.str().find("already present, SHA-256 ok; not downloaded again"), std::string::npos);

  write_plain(target, "damaged");
  std::ostringstream repair;
  fetch_data_file(file_, out_dir_, download_, repair);
  EXPECT_EQ(downloads_, 2);
  EXPECT_NE(repair.str().find("fetching it again"), std::string::npos);
  EXPECT_EQ(sha256_file(target), file_.sha256);
}

TEST_F(DataGet, ChecksumMismatchKeepsNothing) {
  file_.sha256 = std::string(64, '0');
  std::ostringstream log;
  EXPECT_ERROR(fetch_data_file(file_, out_dir_, download_, log), "SHA-256 mismatch",
               "expected " + std::string(64, '0'), "got " + sha256_hex(content_), "not kept");
  EXPECT_TRUE(fs::is_empty(out_dir_));
}

TEST_F(DataGet, MissingPathListsSimilarOnes) {
  file_.member = "./usr/share/doc/fake/examples/x.fa";
  std::ostringstream log;
  EXPECT_ERROR(fetch_data_file(file_, out_dir_, download_, log), "fake-examples_1.0_all.deb has no file",
               "./usr/share/doc/fake/examples/x.fa", "similar paths", "./usr/share/doc/fake/ref/x.fa");
  EXPECT_TRUE(fs::is_empty(out_dir_));
}

TEST_F(DataGet, DownloadFailureIsReported) {
  const PackageDownloader broken = [](const std::string& package, const std::string&) -> std::string {
    fail("`apt-get download ", package, "` failed (exit 100):\nE: Unable to locate package ", package);
  };
  std::ostringstream log;
  EXPECT_ERROR(fetch_data_file(file_, out_dir_, broken, log), "apt-get download fake-examples",
               "Unable to locate package");
  FetchOptions options;
  options.only = {"chr21"};
  EXPECT_ERROR(fetch_data(options, log), "unknown data set 'chr21'", "chr22, chrX or chr20");
}

TEST_F(Data, AptDownloadFailuresAreClear) {
  {  // no apt-get on PATH
    const std::string saved = std::getenv("PATH") ? std::getenv("PATH") : "";
    setenv("PATH", path("empty").c_str(), 1);
    const std::string message = error_of([&] { apt_download("hisat2", dir_.string()); });
    setenv("PATH", saved.c_str(), 1);
    EXPECT_NE(message.find("apt-get not found on PATH"), std::string::npos) << message;
  }
  if (!find_program("apt-get")) GTEST_SKIP() << "no apt-get here";
  // An unknown package fails locally, without the network; apt-get's own message is shown.
  EXPECT_ERROR(apt_download("spindle-no-such-package", dir_.string()),
               "`apt-get download spindle-no-such-package` failed",
               "Unable to locate package spindle-no-such-package", "apt-get update");
}

TEST(DataGetCatalogue, MatchesTheDataReadme) {
  const auto& files = reference_data();
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0].package, "hisat2");
  EXPECT_EQ(files[0].member, "./usr/share/doc/hisat2/examples/reference/22_20-21M.fa");
  EXPECT_EQ(files[1].package, "smalt-examples");
  EXPECT_EQ(files[2].file_name, "20.fa.gz");
  for (const auto& f : files) EXPECT_EQ(f.sha256.size(), 64u);
}

}  // namespace
}  // namespace spindle
