#include "train/grad_accum.h"

#include <cmath>

#include "core/parallel.h"
#include "train/adamw.h"
#include "train/float_dispatch.h"

namespace spindle {

namespace {

constexpr int64_t kGrain = int64_t{1} << 15;

}  // namespace

void zero_grads(const ModelConfig& config, ModelWeights& grads) {
  for (Param& p : parameter_table(config, grads)) p.tensor.fill_zero();
}

void add_grads(const ModelConfig& config, ModelWeights& dst, ModelWeights& src, double scale) {
  check(std::isfinite(scale), "add_grads: scale must be finite, got ", scale);
  std::vector<Param> to = parameter_table(config, dst);
  const std::vector<Param> from = parameter_table(config, src);
  check(to.size() == from.size(), "add_grads: destination lists ", to.size(), " tensors, source ",
        from.size());
  for (size_t i = 0; i < to.size(); ++i) {
    check(to[i].name == from[i].name && to[i].tensor.shape() == from[i].tensor.shape(), "add_grads: tensor ",
          i, " is ", to[i].name, shape_string(to[i].tensor.shape()), " in the destination but ", from[i].name,
          shape_string(from[i].tensor.shape()), " in the source");
    check(to[i].tensor.is_contiguous() && from[i].tensor.is_contiguous(), "add_grads: ", to[i].name,
          " is not contiguous");
  }
  for (size_t i = 0; i < to.size(); ++i) {
    dispatch_float(to[i].tensor.dtype(), "add_grads: destination " + to[i].name, [&]<class D>(D) {
      dispatch_float(from[i].tensor.dtype(), "add_grads: source " + from[i].name, [&]<class S>(S) {
        D* d = to[i].tensor.data<D>();
        const S* s = from[i].tensor.data<S>();
        parallel_for(to[i].tensor.numel(), kGrain, [&](int64_t begin, int64_t end) {
          for (int64_t k = begin; k < end; ++k)
            d[k] = static_cast<D>(static_cast<double>(d[k]) + scale * static_cast<double>(s[k]));
        });
      });
    });
  }
}

void scale_grads(const ModelConfig& config, ModelWeights& grads, double factor, bool trained_only) {
  check(std::isfinite(factor), "scale_grads: factor must be finite, got ", factor);
  for (Param& p : parameter_table(config, grads)) {
    if (trained_only && !role_trained(p.role)) continue;
    check(p.tensor.is_contiguous(), "scale_grads: ", p.name, " is not contiguous");
    dispatch_float(p.tensor.dtype(), "scale_grads: " + p.name, [&]<class T>(T) {
      T* g = p.tensor.data<T>();
      parallel_for(p.tensor.numel(), kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) g[k] = static_cast<T>(static_cast<double>(g[k]) * factor);
      });
    });
  }
}

}  // namespace spindle
