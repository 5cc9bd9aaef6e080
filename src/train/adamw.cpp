#include "train/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/dtype.h"
#include "core/parallel.h"
#include "train/float_dispatch.h"

namespace spindle {

double host_adamw_host_share() {
  const char* text = std::getenv("SPINDLE_HOST_ADAMW_SHARE");
  if (text == nullptr) return kHostAdamWHostShare;
  char* end = nullptr;
  const double share = std::strtod(text, &end);
  check(end != text && *end == '\0' && share > 0 && share <= 1,
        "SPINDLE_HOST_ADAMW_SHARE must be a number in (0, 1] (the host AdamW's share of the values), got '",
        text, "'");
  return share;
}

namespace {

constexpr int64_t kGrain = int64_t{1} << 15;

// The trained entries of `table`, in order: the slots of the optimizer line up with these.
std::vector<Param> trained(std::vector<Param> table) {
  std::vector<Param> out;
  for (Param& p : table)
    if (role_trained(p.role)) out.push_back(std::move(p));
  return out;
}

// The master's value stored as the weight, as Tensor::copy_from converts it.
template <class W>
W weight_from_master(float master) {
  if constexpr (std::is_same_v<W, uint16_t>)
    return float_to_bf16(master);
  else
    return static_cast<W>(master);
}

// Entries [begin, end) of one tensor, in fp64 (the CPU reference's arithmetic); the weight is
// written in the same pass, rounded from the master as write_weights() rounds it: a second pass
// over billions of values cost as much as the update (host AdamW). Also compiled for AVX2 and
// picked at run time: on the H200 machine's host the vectorised loop is twice as fast
// (bench/host_adamw.cpp), with the same IEEE operations in the same order, so the same bits.
template <class G, class W>
__attribute__((target_clones("arch=x86-64-v3", "default"))) void update_range(const AdamWConstants& c,
                                                                              const G* g, float* p, float* m,
                                                                              float* v, W* w, int64_t begin,
                                                                              int64_t end) {
  const double b1 = c.beta1, b2 = c.beta2;
  for (int64_t k = begin; k < end; ++k) {
    const double gk = static_cast<double>(g[k]);
    const double mk = b1 * m[k] + (1.0 - b1) * gk;
    const double vk = b2 * v[k] + (1.0 - b2) * gk * gk;
    const double pk = c.decay * p[k] - c.step_size * mk / (std::sqrt(vk) / c.bc2_sqrt + c.eps);
    m[k] = static_cast<float>(mk);
    v[k] = static_cast<float>(vk);
    p[k] = static_cast<float>(pk);
    w[k] = weight_from_master<W>(p[k]);
  }
}

}  // namespace

void validate_adamw_options(const AdamWOptions& o) {
  check(std::isfinite(o.lr) && o.lr >= 0, "AdamW: lr must be finite and >= 0, got ", o.lr);
  check(o.beta1 >= 0 && o.beta1 < 1, "AdamW: beta1 must be in [0, 1), got ", o.beta1);
  check(o.beta2 >= 0 && o.beta2 < 1, "AdamW: beta2 must be in [0, 1), got ", o.beta2);
  check(std::isfinite(o.eps) && o.eps > 0, "AdamW: eps must be finite and > 0, got ", o.eps);
  check(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
        "AdamW: weight_decay must be finite and >= 0, got ", o.weight_decay);
}

bool role_decays(ParamRole role) { return role == ParamRole::Matrix || role == ParamRole::Embedding; }

bool role_trained(ParamRole role) { return role != ParamRole::RouterBias; }

AdamW::AdamW(const ModelConfig& config, ModelWeights& weights, const AdamWOptions& options,
             const AdamWStateStorage& storage)
    : config_(config), options_(options) {
  validate_adamw_options(options_);
  for (Param& p : trained(parameter_table(config, weights))) {
    check(p.tensor.is_contiguous(), "AdamW: parameter ", p.name, " is not contiguous");
    Slot slot{p.name, p.role, role_decays(p.role), false, p.tensor, {}, {}, {}};
    const int64_t n = p.tensor.numel();
    float* place = storage.at ? storage.at(slots_.size(), n) : nullptr;
    if (place == nullptr) {
      slot.master = p.tensor.to(DType::F32, MemoryCategory::Optimizer);
      slot.exp_avg = Tensor::zeros(p.tensor.shape(), DType::F32, MemoryCategory::Optimizer);
      slot.exp_avg_sq = Tensor::zeros(p.tensor.shape(), DType::F32, MemoryCategory::Optimizer);
    } else {
      slot.master = Tensor::borrow(storage.owner, place, p.tensor.shape(), DType::F32);
      slot.master.copy_from(p.tensor);
      slot.exp_avg = Tensor::borrow(storage.owner, place + n, p.tensor.shape(), DType::F32);
      slot.exp_avg.fill_zero();
      slot.exp_avg_sq = Tensor::borrow(storage.owner, place + 2 * n, p.tensor.shape(), DType::F32);
      slot.exp_avg_sq.fill_zero();
    }
    slots_.push_back(std::move(slot));
  }
}

void AdamW::set_steps(int64_t steps) {
  check(steps >= 0, "AdamW: step count must be >= 0, got ", steps);
  steps_ = steps;
}

void AdamW::set_options(const AdamWOptions& options) {
  validate_adamw_options(options);
  options_ = options;
}

void AdamW::step(ModelWeights& grads) { step(grads, options_.lr); }

void AdamW::step(ModelWeights& grads, double lr, const AdamWBatches& batches) {
  check(std::isfinite(lr) && lr >= 0, "AdamW: learning rate must be finite and >= 0, got ", lr);
  const std::vector<Param> table = trained(parameter_table(config_, grads));
  check(table.size() == slots_.size(), "AdamW: the gradients list ", table.size(),
        " trained parameters, the optimizer ", slots_.size(), " (allocated for a different config?)");
  // Validate every gradient before touching any state, so a bad call changes nothing.
  for (size_t i = 0; i < slots_.size(); ++i) {
    check(table[i].name == slots_[i].name, "AdamW: gradient ", i, " is ", table[i].name, ", expected ",
          slots_[i].name);
    check(table[i].tensor.shape() == slots_[i].master.shape(), "AdamW: gradient ", table[i].name,
          " has shape ", shape_string(table[i].tensor.shape()), ", expected ",
          shape_string(slots_[i].master.shape()));
    check(table[i].tensor.is_contiguous(), "AdamW: gradient ", table[i].name, " is not contiguous");
    // The dtypes here too: the update dispatches on them inside worker threads, where an error
    // could not be reported.
    dispatch_float(table[i].tensor.dtype(), "AdamW: gradient " + table[i].name, []<class G>(G) {});
    dispatch_weight(slots_[i].weight.dtype(), "AdamW: weight " + slots_[i].name, []<class W>(W) {});
  }

  ++steps_;
  const AdamWConstants decaying = constants(true, lr, steps_), plain = constants(false, lr, steps_);
  // Slot i's entries [begin, end).
  const auto update = [&](size_t i, int64_t begin, int64_t end) {
    Slot& s = slots_[i];
    const AdamWConstants& c = s.decays ? decaying : plain;
    float* p = s.master.data<float>();
    float* m = s.exp_avg.data<float>();
    float* v = s.exp_avg_sq.data<float>();
    // The dtypes were checked above, by name; here no name is built for every range of every slot.
    dispatch_float(table[i].tensor.dtype(), "AdamW", [&]<class G>(G) {
      dispatch_weight(s.weight.dtype(), "AdamW", [&]<class W>(W) {
        update_range(c, table[i].tensor.data<G>(), p, m, v, static_cast<W*>(s.weight.raw()), begin, end);
      });
    });
  };

  // Each batch as one range of values over all the cores (slot by slot, small slots would leave
  // most cores idle and start threads hundreds of times a step).
  const size_t slots = std::min(batches.slots, slots_.size());
  for (size_t first = 0; first < slots;) {
    std::vector<int64_t> offsets{0};  // of the batch's slots in its range; frozen slots are empty
    size_t last = first;
    while (last < slots && (offsets.back() < batches.elements || last == first || batches.elements == 0)) {
      offsets.push_back(offsets.back() + (slots_[last].frozen ? 0 : slots_[last].master.numel()));
      ++last;
    }
    if (batches.before) batches.before(first, last);
    for (size_t i = first; i < last; ++i)
      if (slots_[i].frozen) slots_[i].weight.copy_from(slots_[i].master);  // as write_weights() would
    parallel_for(offsets.back(), kGrain, [&](int64_t begin, int64_t end) {
      size_t j =
          static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
      for (; j + 1 < offsets.size() && offsets[j] < end; ++j)
        if (offsets[j + 1] > offsets[j])
          update(first + j, std::max(begin, offsets[j]) - offsets[j],
                 std::min(end, offsets[j + 1]) - offsets[j]);
    });
    if (batches.after) batches.after(first, last);
    first = last;
  }
}

AdamWConstants AdamW::constants(bool decays, double lr, int64_t step) const {
  const double t = static_cast<double>(step), b1 = options_.beta1, b2 = options_.beta2;
  return {b1,
          b2,
          lr / (1.0 - std::pow(b1, t)),
          std::sqrt(1.0 - std::pow(b2, t)),
          options_.eps,
          decays ? 1.0 - lr * options_.weight_decay : 1.0};
}

void AdamW::write_weights() {
  for (Slot& s : slots_) s.weight.copy_from(s.master);
}

}  // namespace spindle
