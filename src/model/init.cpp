#include "model/init.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "core/random.h"

namespace spindle {

namespace {

// Each block of a tensor draws from its own generator, seeded by (seed, parameter, block), so that
// the blocks fill in parallel and the weights do not depend on the number of threads.
constexpr int64_t kBlock = int64_t{1} << 16;

uint64_t block_seed(uint64_t seed, size_t param, int64_t block) {
  uint64_t x = seed;
  for (const uint64_t word : {static_cast<uint64_t>(param), static_cast<uint64_t>(block)}) {
    x = (x ^ word) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
  }
  return x;
}

void fill(Tensor& t, uint64_t seed, size_t param, double (*draw)(Random&, const ModelConfig&),
          const ModelConfig& c) {
  const int64_t n = t.numel(), blocks = (n + kBlock - 1) / kBlock;
  Tensor values = Tensor::empty({n}, DType::F64);
  double* v = values.data<double>();
  parallel_for(blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      Random rng(block_seed(seed, param, b));
      for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) v[i] = draw(rng, c);
    }
  });
  t.copy_from(values.reshape(t.shape()));
}

double draw_normal(Random& rng, const ModelConfig& c) { return rng.normal() * c.initializer_range; }
double draw_normal_002(Random& rng, const ModelConfig&) { return rng.normal() * 0.02; }
double draw_zero(Random&, const ModelConfig&) { return 0.0; }
double draw_one(Random&, const ModelConfig&) { return 1.0; }
// FLA's A_log without a lower bound: log of uniform(1, 16); with the safe bound, zero.
double draw_a_log(Random& rng, const ModelConfig& c) {
  return c.linear_lower_bound ? 0.0 : std::log(rng.uniform(1.0, 16.0));
}
// dt in [1e-3, 1e-1] log-uniformly, stored as its inverse softplus.
double draw_dt_bias(Random& rng, const ModelConfig&) {
  const double dt = std::max(std::exp(rng.uniform(std::log(1e-3), std::log(1e-1))), 1e-4);
  return dt + std::log(-std::expm1(-dt));
}

}  // namespace

void init_weights(const ModelConfig& c, ModelWeights& w, uint64_t seed) {
  std::vector<Param> params = parameter_table(c, w);
  for (size_t index = 0; index < params.size(); ++index) {
    Param& p = params[index];
    const auto fill_with = [&](double (*draw)(Random&, const ModelConfig&)) {
      fill(p.tensor, seed, index, draw, c);
    };
    switch (p.role) {
      case ParamRole::Matrix:
        fill_with(draw_normal);
        break;
      case ParamRole::Embedding: {
        fill_with(draw_normal);
        if (c.pad_token_id && *c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size) {
          Tensor row = p.tensor.select(*c.pad_token_id);
          row.fill_zero();
        }
        break;
      }
      case ParamRole::HcFn:
        fill_with(draw_normal_002);
        break;
      case ParamRole::Norm:
      case ParamRole::HcScale:
      case ParamRole::CompressGate:
        fill_with(draw_one);
        break;
      case ParamRole::NormBias:
      case ParamRole::HcBase:
      case ParamRole::CompressApe:
      case ParamRole::RouterBias:
        fill_with(draw_zero);
        break;
      case ParamRole::ALog:
        fill_with(draw_a_log);
        break;
      case ParamRole::DtBias:
        fill_with(draw_dt_bias);
        break;
    }
  }
}

}  // namespace spindle
