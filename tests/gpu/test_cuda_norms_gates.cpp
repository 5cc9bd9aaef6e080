// The normalisations, the embedding and stream mean, KDA's gates and the fp32/bf16 conversions
// against the CPU reference (double, on the same bf16-rounded inputs), on fresh random inputs.
// Written outputs are NaN-poisoned first (every element must be written); accumulated outputs
// start from random values and the increment (got - start) is compared with the reference.
// Shapes cover each way a row is spread over threads (a warp or a block, one or several vectors
// per thread, vector widths 8, 4, 2 and 1) and rows or tokens beyond one resident grid, so that
// threads visit several rows and their gradient sums are combined. Offset 1 puts every buffer
// one element off its alignment, which forces the scalar paths.
// Bounds: bf16 outputs 1e-2 (one bf16 rounding is ~3e-3 relative; fp32 math adds far less);
// fp32 gradient sums 1e-3 (only fp32 arithmetic and the atomics' order differ from the
// reference); elementwise fp32 results 1e-5 (a few ulp of expf and friends); copies and
// conversions exactly.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "core/error.h"
#include "gpu_test_util.h"
#include "kernels/cpu/norms.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/norms.h"

namespace spindle::cuda {
namespace {

constexpr double kBf16Bound = 1e-2;
constexpr double kFp32Bound = 1e-3;
constexpr double kElementwiseBound = 1e-5;

// A device copy of `host` placed `offset` elements into its buffer (offset 1 misaligns it).
template <class T>
class Placed {
 public:
  Placed(const std::vector<T>& host, size_t offset)
      : buffer_(host.size() + offset, MemoryCategory::Activations), offset_(offset) {
    std::vector<T> padded(offset);
    padded.insert(padded.end(), host.begin(), host.end());
    buffer_.upload(padded);
  }
  // n elements of NaN (all bits set).
  static Placed poisoned(size_t n, size_t offset) { return Placed(std::vector<T>(n, poison()), offset); }

  T* get() { return buffer_.data() + offset_; }
  std::vector<T> download() const {
    const std::vector<T> all = buffer_.download();
    return std::vector<T>(all.begin() + static_cast<std::ptrdiff_t>(offset_), all.end());
  }

 private:
  static T poison() {
    T value;
    std::memset(static_cast<void*>(&value), 0xff, sizeof(T));
    return value;
  }
  DeviceBuffer<T> buffer_;
  size_t offset_ = 0;
};

struct NormCase {
  int64_t rows, D;
  size_t offset;
};

// By how a row is spread (V-wide vectors, C per thread): a warp with C = 1 for V = 1, 2, 4
// (20011 rows: several per warp; 3 rows: fewer than a block's 8) and C > 1 for V = 8, 4, 2, 1
// (misaligned); a block with C = 1 for V = 8 (5003 rows: several per block), 4, 2, and with
// C > 1 for V = 8, 4, 2, 1, up to the largest D.
const NormCase kNormCases[] = {{1001, 7, 0},  {333, 64, 0},  {20011, 128, 0}, {3, 96, 0},      {300, 512, 0},
                               {100, 260, 0}, {77, 130, 0},  {257, 128, 1},   {5003, 1000, 0}, {77, 3000, 0},
                               {70, 1020, 0}, {60, 1022, 0}, {45, 8192, 0},   {40, 4100, 0},   {50, 2050, 0},
                               {33, 8191, 0}, {63, 513, 0}};

std::string where(const NormCase& c) {
  return " rows=" + std::to_string(c.rows) + " D=" + std::to_string(c.D) +
         " offset=" + std::to_string(c.offset);
}

TEST(CudaNormsGates, LayerNormForwardAndBackward) {
  for (const NormCase& c : kNormCases) {
    const int64_t R = c.rows, D = c.D, n = R * D;
    auto x = random_floats(n);
    for (float& v : x) v += 2.0f;  // rows with a mean to remove
    x = rounded(x);
    const auto w = rounded(random_floats(D, 0.5f)), b = rounded(random_floats(D, 0.5f));
    const auto dy = rounded(random_floats(n));
    const auto dw0 = random_floats(D), db0 = random_floats(D);
    Stream stream;
    Placed<bf16> xb(to_bf16(x), c.offset), wb(to_bf16(w), c.offset), bb(to_bf16(b), c.offset),
        dyb(to_bf16(dy), c.offset);
    auto y = Placed<bf16>::poisoned(n, c.offset), dx = Placed<bf16>::poisoned(n, c.offset);
    auto dwb = device(dw0, MemoryCategory::Gradients), dbb = device(db0, MemoryCategory::Gradients);
    layer_norm_forward(xb.get(), wb.get(), bb.get(), y.get(), R, D, 1e-5f, stream.get());
    layer_norm_backward(xb.get(), wb.get(), dyb.get(), dx.get(), dwb.data(), dbb.data(), R, D, 1e-5f,
                        stream.get());
    stream.synchronize();
    const auto xd = to_double(x), wd = to_double(w), bd = to_double(b), dyd = to_double(dy);
    std::vector<double> y_ref(n), dx_ref(n), dw_ref(D, 0.0), db_ref(D, 0.0);
    cpu::layer_norm(xd.data(), wd.data(), bd.data(), y_ref.data(), R, D, 1e-5);
    cpu::layer_norm_backward(xd.data(), wd.data(), dyd.data(), dx_ref.data(), dw_ref.data(), db_ref.data(), R,
                             D, 1e-5);
    EXPECT_LT(relative_error(y.download(), y_ref), kBf16Bound) << "y" << where(c);
    EXPECT_LT(relative_error(dx.download(), dx_ref), kBf16Bound) << "dx" << where(c);
    EXPECT_LT(increment_error(dwb.download(), dw0, dw_ref), kFp32Bound) << "dweight" << where(c);
    EXPECT_LT(increment_error(dbb.download(), db0, db_ref), kFp32Bound) << "dbias" << where(c);
  }
}

TEST(CudaNormsGates, RmsNormPlainAndGatedForwardAndBackward) {
  for (const NormCase& c : kNormCases) {
    const int64_t R = c.rows, D = c.D, n = R * D;
    const auto x = rounded(random_floats(n)), w = rounded(random_floats(D, 0.5f));
    const auto gate = rounded(random_floats(n, 2.0f)), dy = rounded(random_floats(n));
    const auto dy32 = random_floats(n);  // an fp32 gradient, not rounded to bf16 (the mHC site's)
    const auto dw0 = random_floats(D), dwg0 = random_floats(D);
    Stream stream;
    Placed<bf16> xb(to_bf16(x), c.offset), wb(to_bf16(w), c.offset), gb(to_bf16(gate), c.offset),
        dyb(to_bf16(dy), c.offset);
    Placed<float> dy32b(dy32, c.offset);
    auto dx32 = Placed<bf16>::poisoned(n, c.offset);
    auto dw32b = device(dw0, MemoryCategory::Gradients);
    auto y = Placed<bf16>::poisoned(n, c.offset), dx = Placed<bf16>::poisoned(n, c.offset);
    auto yg = Placed<bf16>::poisoned(n, c.offset), dxg = Placed<bf16>::poisoned(n, c.offset),
         dgate = Placed<bf16>::poisoned(n, c.offset);
    auto dwb = device(dw0, MemoryCategory::Gradients), dwgb = device(dwg0, MemoryCategory::Gradients);
    rms_norm_forward(xb.get(), wb.get(), y.get(), R, D, 1e-6f, stream.get());
    rms_norm_backward(xb.get(), wb.get(), dyb.get(), dx.get(), dwb.data(), R, D, 1e-6f, stream.get());
    rms_norm_backward(xb.get(), wb.get(), dy32b.get(), dx32.get(), dw32b.data(), R, D, 1e-6f, stream.get());
    gated_rms_norm_forward(xb.get(), wb.get(), gb.get(), yg.get(), R, D, 1e-6f, stream.get());
    gated_rms_norm_backward(xb.get(), wb.get(), gb.get(), dyb.get(), dxg.get(), dgate.get(), dwgb.data(), R,
                            D, 1e-6f, stream.get());
    stream.synchronize();
    const auto xd = to_double(x), wd = to_double(w), gd = to_double(gate), dyd = to_double(dy);
    std::vector<double> y_ref(n), dx_ref(n), dw_ref(D, 0.0), yg_ref(n), dxg_ref(n), dgate_ref(n),
        dwg_ref(D, 0.0);
    cpu::rms_norm(xd.data(), wd.data(), y_ref.data(), R, D, 1e-6);
    cpu::rms_norm_backward(xd.data(), wd.data(), dyd.data(), dx_ref.data(), dw_ref.data(), R, D, 1e-6);
    std::vector<double> dx32_ref(n), dw32_ref(D, 0.0);
    cpu::rms_norm_backward(xd.data(), wd.data(), to_double(dy32).data(), dx32_ref.data(), dw32_ref.data(), R,
                           D, 1e-6);
    cpu::gated_rms_norm(xd.data(), wd.data(), gd.data(), yg_ref.data(), R, D, 1e-6);
    cpu::gated_rms_norm_backward(xd.data(), wd.data(), gd.data(), dyd.data(), dxg_ref.data(),
                                 dgate_ref.data(), dwg_ref.data(), R, D, 1e-6);
    EXPECT_LT(relative_error(y.download(), y_ref), kBf16Bound) << "rms y" << where(c);
    EXPECT_LT(relative_error(dx.download(), dx_ref), kBf16Bound) << "rms dx" << where(c);
    EXPECT_LT(increment_error(dwb.download(), dw0, dw_ref), kFp32Bound) << "rms dweight" << where(c);
    EXPECT_LT(relative_error(dx32.download(), dx32_ref), kBf16Bound) << "rms dx, fp32 dy" << where(c);
    EXPECT_LT(increment_error(dw32b.download(), dw0, dw32_ref), kFp32Bound)
        << "rms dweight, fp32 dy" << where(c);
    EXPECT_LT(relative_error(yg.download(), yg_ref), kBf16Bound) << "gated y" << where(c);
    EXPECT_LT(relative_error(dxg.download(), dxg_ref), kBf16Bound) << "gated dx" << where(c);
    EXPECT_LT(relative_error(dgate.download(), dgate_ref), kBf16Bound) << "gated dgate" << where(c);
    EXPECT_LT(increment_error(dwgb.download(), dwg0, dwg_ref), kFp32Bound) << "gated dweight" << where(c);
  }
}

// Rows that are columns of wider buffers (model/cuda/dsa.cpp's projections side by side): x's rows
// `ld` apart from column `col` on, the outputs' `out_ld` apart from `out_col` on.
struct StridedCase {
  int64_t rows, D, ld, col, out_ld, out_col;
};

// The DSA projections' shapes (a warp per row, vectors of 8), an ld that only single elements
// divide, a column start that misaligns the rows, and block rows.
const StridedCase kStridedCases[] = {{3001, 1024, 1792, 0, 1536, 0},  {3001, 512, 1792, 1024, 1536, 1024},
                                     {2003, 128, 1792, 1536, 128, 0}, {501, 500, 1001, 1, 777, 3},
                                     {77, 4100, 4104, 4, 8300, 4200}, {129, 64, 96, 32, 64, 0}};

// The columns [col, col + D) of every row of a [rows, ld] buffer.
template <class T>
std::vector<T> columns(const std::vector<T>& all, const StridedCase& c, int64_t ld, int64_t col) {
  std::vector<T> out(static_cast<size_t>(c.rows * c.D));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.D; ++j) out[r * c.D + j] = all[r * ld + col + j];
  return out;
}

// Every element of `all` outside the columns [col, col + D) still holds `fill`.
bool untouched_outside(const std::vector<bf16>& all, const StridedCase& c, int64_t ld, int64_t col,
                       float fill) {
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < ld; ++j)
      if ((j < col || j >= col + c.D) && __bfloat162float(all[r * ld + j]) != fill) return false;
  return true;
}

std::string where(const StridedCase& c) {
  return " rows=" + std::to_string(c.rows) + " D=" + std::to_string(c.D) + " ld=" + std::to_string(c.ld) +
         " col=" + std::to_string(c.col) + " out_ld=" + std::to_string(c.out_ld) +
         " out_col=" + std::to_string(c.out_col);
}

TEST(CudaNormsGates, RmsAndLayerNormsOverColumnsOfWiderRows) {
  constexpr float kFill = 7.0f;  // the outputs' other columns, which no norm may write
  for (const StridedCase& c : kStridedCases) {
    const int64_t R = c.rows, D = c.D, n = R * D;
    const auto x_all = rounded(random_floats(static_cast<size_t>(R * c.ld)));
    const auto x = columns(x_all, c, c.ld, c.col);
    const auto w = rounded(random_floats(D, 0.5f)), b = rounded(random_floats(D, 0.5f));
    const auto dy = rounded(random_floats(n));
    const auto dw0 = random_floats(D);
    const std::vector<float> filled(static_cast<size_t>(R * c.out_ld), kFill);
    Stream stream;
    auto xb = device(to_bf16(x_all)), wb = device(to_bf16(w)), bb = device(to_bf16(b)),
         dyb = device(to_bf16(dy));
    auto y = device(to_bf16(filled)), dx = device(to_bf16(filled));
    auto ln = poisoned<bf16>(n);
    auto dwb = device(dw0, MemoryCategory::Gradients);
    rms_norm_forward(xb.data() + c.col, c.ld, wb.data(), y.data() + c.out_col, c.out_ld, R, D, 1e-6f,
                     stream.get());
    rms_norm_backward(xb.data() + c.col, c.ld, wb.data(), dyb.data(), dx.data() + c.out_col, c.out_ld,
                      dwb.data(), R, D, 1e-6f, stream.get());
    layer_norm_forward(xb.data() + c.col, c.ld, wb.data(), bb.data(), ln.data(), R, D, 1e-5f, stream.get());
    stream.synchronize();
    const auto xd = to_double(x), wd = to_double(w), bd = to_double(b), dyd = to_double(dy);
    std::vector<double> y_ref(n), dx_ref(n), dw_ref(D, 0.0), ln_ref(n);
    cpu::rms_norm(xd.data(), wd.data(), y_ref.data(), R, D, 1e-6);
    cpu::rms_norm_backward(xd.data(), wd.data(), dyd.data(), dx_ref.data(), dw_ref.data(), R, D, 1e-6);
    cpu::layer_norm(xd.data(), wd.data(), bd.data(), ln_ref.data(), R, D, 1e-5);
    const std::vector<bf16> y_all = y.download(), dx_all = dx.download();
    EXPECT_LT(relative_error(columns(y_all, c, c.out_ld, c.out_col), y_ref), kBf16Bound)
        << "rms y" << where(c);
    EXPECT_LT(relative_error(columns(dx_all, c, c.out_ld, c.out_col), dx_ref), kBf16Bound)
        << "rms dx" << where(c);
    EXPECT_TRUE(untouched_outside(y_all, c, c.out_ld, c.out_col, kFill)) << "rms y" << where(c);
    EXPECT_TRUE(untouched_outside(dx_all, c, c.out_ld, c.out_col, kFill)) << "rms dx" << where(c);
    EXPECT_LT(increment_error(dwb.download(), dw0, dw_ref), kFp32Bound) << "rms dweight" << where(c);
    EXPECT_LT(relative_error(ln.download(), ln_ref), kBf16Bound) << "layer norm y" << where(c);
  }
}

TEST(CudaNormsGates, L2NormalizeForwardAndBackward) {
  for (const NormCase& c : kNormCases) {
    const int64_t R = c.rows, D = c.D, n = R * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const auto x = rounded(random_floats(n)), dy = rounded(random_floats(n));
    Stream stream;
    Placed<bf16> xb(to_bf16(x), c.offset), dyb(to_bf16(dy), c.offset);
    auto y = Placed<bf16>::poisoned(n, c.offset), dx = Placed<bf16>::poisoned(n, c.offset);
    l2_normalize_forward(xb.get(), y.get(), R, D, 1e-6f, scale, stream.get());
    l2_normalize_backward(xb.get(), dyb.get(), dx.get(), R, D, 1e-6f, scale, stream.get());
    stream.synchronize();
    const auto xd = to_double(x), dyd = to_double(dy);
    std::vector<double> y_ref = xd, dx_ref(n);
    cpu::l2_normalize(y_ref.data(), R, D, 1e-6);
    cpu::l2_normalize_backward(xd.data(), dyd.data(), dx_ref.data(), R, D, 1e-6);
    for (int64_t i = 0; i < n; ++i) {
      y_ref[i] *= scale;
      dx_ref[i] *= scale;  // y is scaled after normalising, so is the gradient reaching x
    }
    EXPECT_LT(relative_error(y.download(), y_ref), kBf16Bound) << "y" << where(c);
    EXPECT_LT(relative_error(dx.download(), dx_ref), kBf16Bound) << "dx" << where(c);
  }
}

TEST(CudaNormsGates, NormsRejectRowsLongerThanTheLimit) {
  Stream stream;
  EXPECT_THROW(layer_norm_forward(nullptr, nullptr, nullptr, nullptr, 1, kMaxNormD + 1, 1e-5f, stream.get()),
               Error);
  EXPECT_THROW(l2_normalize_forward(nullptr, nullptr, 1, 0, 1e-6f, 1.0f, stream.get()), Error);
}

struct StreamCase {
  int64_t tokens, H, D;
  size_t offset;
};

// D of vectors 8 (64, 1000, 4096), 2 (6), 1 (7, and 128 misaligned).
const StreamCase kStreamCases[] = {{1000, 4, 64, 0},  {333, 4, 1000, 0}, {77, 2, 7, 0},
                                   {130, 1, 4096, 0}, {257, 4, 128, 1},  {50, 3, 6, 0}};

std::string where(const StreamCase& c) {
  return " tokens=" + std::to_string(c.tokens) + " H=" + std::to_string(c.H) + " D=" + std::to_string(c.D) +
         " offset=" + std::to_string(c.offset);
}

TEST(CudaNormsGates, EmbedStreamsAndBackward) {
  constexpr int64_t kVocab = 37;
  int index = 0;
  for (const StreamCase& c : kStreamCases) {
    const int64_t T = c.tokens, H = c.H, D = c.D;
    const int32_t skip_id = index++ % 2 == 0 ? 5 : -1;
    std::uniform_int_distribution<int32_t> pick(0, kVocab - 1);
    std::vector<int32_t> tokens(T);
    for (int32_t& t : tokens) t = pick(rng());
    tokens[0] = 5;  // the skipped id occurs at least once
    const auto embed = rounded(random_floats(kVocab * D)), dstreams = rounded(random_floats(T * H * D));
    const auto dembed0 = random_floats(kVocab * D);
    Stream stream;
    auto tok = device(tokens);
    Placed<bf16> eb(to_bf16(embed), c.offset);
    Placed<bf16> dsb(to_bf16(dstreams), c.offset);
    Placed<float> deb(dembed0, c.offset);
    auto streams = Placed<bf16>::poisoned(T * H * D, c.offset);
    embed_streams(tok.data(), eb.get(), streams.get(), T, H, D, stream.get());
    embed_backward(tok.data(), dsb.get(), deb.get(), T, H, D, skip_id, stream.get());
    stream.synchronize();
    std::vector<double> streams_ref(T * H * D), dembed_ref(kVocab * D, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          streams_ref[(t * H + h) * D + d] = embed[tokens[t] * D + d];
          if (tokens[t] != skip_id) dembed_ref[tokens[t] * D + d] += dstreams[(t * H + h) * D + d];
        }
    EXPECT_EQ(relative_error(streams.download(), streams_ref), 0.0) << "streams" << where(c);
    const auto dembed = deb.download();
    EXPECT_LT(increment_error(dembed, dembed0, dembed_ref), kFp32Bound) << "dembed" << where(c);
    if (skip_id >= 0) {
      for (int64_t d = 0; d < D; ++d)
        EXPECT_EQ(dembed[skip_id * D + d], dembed0[skip_id * D + d]) << "skipped row, d=" << d << where(c);
    }
  }
}

TEST(CudaNormsGates, StreamMeanAndBackward) {
  for (const StreamCase& c : kStreamCases) {
    const int64_t T = c.tokens, H = c.H, D = c.D;
    const auto streams = rounded(random_floats(T * H * D)), dmean = rounded(random_floats(T * D));
    Stream stream;
    Placed<bf16> sb(to_bf16(streams), c.offset), dmb(to_bf16(dmean), c.offset);
    auto mean = Placed<bf16>::poisoned(T * D, c.offset);
    auto dstreams = Placed<bf16>::poisoned(T * H * D, c.offset);
    stream_mean(sb.get(), mean.get(), T, H, D, stream.get());
    stream_mean_backward(dmb.get(), dstreams.get(), T, H, D, stream.get());
    stream.synchronize();
    std::vector<double> mean_ref(T * D, 0.0), dstreams_ref(T * H * D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          mean_ref[t * D + d] += double(streams[(t * H + h) * D + d]) / double(H);
          dstreams_ref[(t * H + h) * D + d] = double(dmean[t * D + d]) / double(H);
        }
    EXPECT_LT(relative_error(mean.download(), mean_ref), kBf16Bound) << "mean" << where(c);
    EXPECT_LT(relative_error(dstreams.download(), dstreams_ref), kBf16Bound) << "dstreams" << where(c);
  }
}

struct DecayCase {
  int64_t tokens, heads, head_dim;
  bool bounded;
};

// 20000 tokens: several tiles; head_dim 7 and 16: several heads per block; 300: a head across
// blocks. Channels a thread: 4 where the row holds a multiple of 4 (35 channels: 1; 18: 2); 640
// channels: two blocks of 4 a thread, the second partial; 40 heads of 4: many heads in one block.
const DecayCase kDecayCases[] = {{333, 4, 128, true},  {333, 4, 128, false},  {1000, 3, 64, false},
                                 {77, 5, 7, true},     {20000, 2, 16, false}, {20000, 2, 16, true},
                                 {50, 1, 300, true},   {333, 3, 6, false},    {333, 3, 6, true},
                                 {300, 5, 128, false}, {100, 40, 4, true}};

TEST(CudaNormsGates, KdaDecayForwardAndBackward) {
  constexpr float kLowerBound = -5.0f;
  for (const DecayCase& c : kDecayCases) {
    const int64_t T = c.tokens, H = c.heads, dh = c.head_dim, C = H * dh, n = T * C;
    auto f = random_floats(n, 2.0f);
    std::uniform_real_distribution<float> large(30.0f, 40.0f);  // where softplus passes x through
    for (int64_t i = 0; i < n; i += 101) f[i] = large(rng());
    const auto dt_bias = random_floats(C), A_log = random_uniform(H, -1.0f, 1.0f), dg = random_floats(n);
    const auto ddt0 = random_floats(C), dA0 = random_floats(H);
    const KdaDecayShape s{T, H, dh, c.bounded, kLowerBound};
    Stream stream;
    auto fb = device(f), bb = device(dt_bias), ab = device(A_log), dgb = device(dg);
    auto g = poisoned<float>(n);
    auto df = poisoned<bf16>(n);
    auto ddt = device(ddt0, MemoryCategory::Gradients), dA = device(dA0, MemoryCategory::Gradients);
    kda_decay_forward(s, fb.data(), bb.data(), ab.data(), g.data(), stream.get());
    kda_decay_backward(s, fb.data(), bb.data(), ab.data(), dgb.data(), df.data(), ddt.data(), dA.data(),
                       stream.get());
    stream.synchronize();
    // kda_forward's and kda_backward's loops, in double.
    std::vector<double> g_ref(n), df_ref(n), ddt_ref(C, 0.0), dA_ref(H, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < C; ++i) {
        const int64_t at = t * C + i;
        const double rate = std::exp(double(A_log[i / dh])), pre = double(f[at]) + double(dt_bias[i]);
        double dpre, drate;
        if (c.bounded) {
          const double sg = cpu::sigmoid(rate * pre);
          g_ref[at] = kLowerBound * sg;
          const double du = dg[at] * double(kLowerBound) * sg * (1 - sg);
          dpre = du * rate;
          drate = du * pre;
        } else {
          g_ref[at] = -rate * cpu::softplus_thresholded(pre);
          dpre = -rate * (pre > 20 ? 1.0 : cpu::sigmoid(pre)) * dg[at];
          drate = -cpu::softplus_thresholded(pre) * dg[at];
        }
        dA_ref[i / dh] += drate * rate;
        ddt_ref[i] += dpre;
        df_ref[at] = dpre;
      }
    const std::string at = " tokens=" + std::to_string(T) + " heads=" + std::to_string(H) +
                           " head_dim=" + std::to_string(dh) + (c.bounded ? " bounded" : "");
    EXPECT_LT(relative_error(g.download(), g_ref), kElementwiseBound) << "g" << at;
    EXPECT_LT(relative_error(df.download(), df_ref), kBf16Bound) << "df" << at;
    EXPECT_LT(increment_error(ddt.download(), ddt0, ddt_ref), kFp32Bound) << "d_dt_bias" << at;
    EXPECT_LT(increment_error(dA.download(), dA0, dA_ref), kFp32Bound) << "d_A_log" << at;
  }
}

TEST(CudaNormsGates, SigmoidForwardAndBackward) {
  for (auto [n, offset] : {std::pair<int64_t, size_t>{100003, 0}, {1001, 1}, {5, 0}}) {
    const auto x = random_floats(n, 4.0f), dy = random_floats(n);
    std::vector<float> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + std::exp(-x[i]));
    Stream stream;
    Placed<float> xb(x, offset), yb(y, offset), dyb(dy, offset);
    auto got_y = Placed<float>::poisoned(n, offset);
    auto dx = Placed<bf16>::poisoned(n, offset);
    sigmoid_forward(xb.get(), got_y.get(), n, stream.get());
    sigmoid_backward(yb.get(), dyb.get(), dx.get(), n, stream.get());
    stream.synchronize();
    std::vector<double> y_ref(n), dx_ref(n);
    for (int64_t i = 0; i < n; ++i) {
      y_ref[i] = cpu::sigmoid(double(x[i]));
      dx_ref[i] = double(dy[i]) * y[i] * (1.0 - y[i]);
    }
    EXPECT_LT(relative_error(got_y.download(), y_ref), kElementwiseBound)
        << "y, n=" << n << " offset=" << offset;
    EXPECT_LT(relative_error(dx.download(), dx_ref), kBf16Bound) << "dx, n=" << n << " offset=" << offset;
  }
}

TEST(CudaNormsGates, ConversionsMatchTheHostRounding) {
  for (auto [n, offset] : {std::pair<int64_t, size_t>{100003, 0}, {1001, 1}, {3, 0}}) {
    auto x = random_floats(n);
    for (int64_t i = 0; i < n; ++i) x[i] *= std::pow(10.0f, static_cast<float>(i % 13 - 6));  // 1e-6 .. 1e6
    const auto xb16 = to_bf16(random_floats(n));
    Stream stream;
    Placed<float> in32(x, offset);
    Placed<bf16> in16(xb16, offset);
    auto out16 = Placed<bf16>::poisoned(n, offset);
    auto out32 = Placed<float>::poisoned(n, offset);
    f32_to_bf16(in32.get(), out16.get(), n, stream.get());
    bf16_to_f32(in16.get(), out32.get(), n, stream.get());
    stream.synchronize();
    const auto got16 = out16.download();
    const auto got32 = out32.download();
    int64_t wrong16 = 0, wrong32 = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bf16 want = __float2bfloat16(x[i]);
      wrong16 += std::memcmp(&got16[i], &want, sizeof(bf16)) != 0;
      wrong32 += got32[i] != __bfloat162float(xb16[i]);
    }
    EXPECT_EQ(wrong16, 0) << "f32_to_bf16, n=" << n << " offset=" << offset;
    EXPECT_EQ(wrong32, 0) << "bf16_to_f32, n=" << n << " offset=" << offset;
  }
}

// y[r, c] += x[r, c] over bf16 rows: the fp32 sum rounded once, bit for bit, rows apart by their own
// strides; y's values between its rows untouched.
TEST(CudaNormsGates, AddBf16RowsRoundsTheSumOnce) {
  for (auto [rows, cols, x_ld, y_ld] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{3, 2048, 2048, 6416},
                                        {100, 1001, 1003, 1001},
                                        {1, 3, 3, 3},
                                        {7, 33, 40, 70}}) {
    const auto x = to_bf16(random_floats(rows * x_ld)), y = to_bf16(random_floats(rows * y_ld));
    Stream stream;
    auto dx = device(x), dy = device(y);
    add_bf16_rows(dx.data(), x_ld, dy.data(), y_ld, rows, cols, stream.get());
    stream.synchronize();
    const auto got = dy.download();
    int64_t wrong = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < y_ld; ++c) {
        const int64_t i = r * y_ld + c;
        const bf16 want =
            c < cols ? __float2bfloat16(__bfloat162float(x[r * x_ld + c]) + __bfloat162float(y[i])) : y[i];
        wrong += std::memcmp(&got[i], &want, sizeof(bf16)) != 0;
      }
    EXPECT_EQ(wrong, 0) << rows << " rows of " << cols << ", x_ld " << x_ld << ", y_ld " << y_ld;
  }
}

}  // namespace
}  // namespace spindle::cuda
