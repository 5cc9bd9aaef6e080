#include "model/init.h"

#include <cmath>

#include "core/random.h"

namespace spindle {

namespace {

void fill(Tensor& t, Random& rng, double (*draw)(Random&, const ModelConfig&), const ModelConfig& c) {
  const int64_t n = t.numel();
  Tensor values = Tensor::empty({n}, DType::F64);
  double* v = values.data<double>();
  for (int64_t i = 0; i < n; ++i) v[i] = draw(rng, c);
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
  Random rng(seed);
  for (Param& p : parameter_table(c, w)) {
    switch (p.role) {
      case ParamRole::Matrix:
        fill(p.tensor, rng, draw_normal, c);
        break;
      case ParamRole::Embedding: {
        fill(p.tensor, rng, draw_normal, c);
        if (c.pad_token_id && *c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size) {
          Tensor row = p.tensor.select(*c.pad_token_id);
          row.fill_zero();
        }
        break;
      }
      case ParamRole::HcFn:
        fill(p.tensor, rng, draw_normal_002, c);
        break;
      case ParamRole::Norm:
      case ParamRole::HcScale:
      case ParamRole::CompressGate:
        fill(p.tensor, rng, draw_one, c);
        break;
      case ParamRole::NormBias:
      case ParamRole::HcBase:
      case ParamRole::CompressApe:
      case ParamRole::RouterBias:
        fill(p.tensor, rng, draw_zero, c);
        break;
      case ParamRole::ALog:
        fill(p.tensor, rng, draw_a_log, c);
        break;
      case ParamRole::DtBias:
        fill(p.tensor, rng, draw_dt_bias, c);
        break;
    }
  }
}

}  // namespace spindle
