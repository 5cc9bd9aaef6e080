#include "train/grad_clip.h"

#include <cmath>

#include "train/adamw.h"
#include "train/float_dispatch.h"
#include "train/grad_accum.h"

namespace spindle {

double global_grad_norm(const ModelConfig& config, ModelWeights& grads) {
  double sum = 0;
  for (const Param& p : parameter_table(config, grads)) {
    if (!role_trained(p.role)) continue;
    check(p.tensor.is_contiguous(), "gradient ", p.name, " is not contiguous");
    dispatch_float(p.tensor.dtype(), "gradient " + p.name, [&]<class T>(T) {
      const T* g = p.tensor.data<T>();
      for (int64_t i = 0; i < p.tensor.numel(); ++i)
        sum += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    });
  }
  return std::sqrt(sum);
}

double clip_grad_norm(const ModelConfig& config, ModelWeights& grads, double max_norm) {
  check(std::isfinite(max_norm) && max_norm >= 0, "gradient clipping: max_norm must be finite and >= 0, got ",
        max_norm);
  const double norm = global_grad_norm(config, grads);
  if (max_norm == 0 || !std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) scale_grads(config, grads, coef, /*trained_only=*/true);
  return norm;
}

}  // namespace spindle
