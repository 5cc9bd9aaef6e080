// The CUDA backend behind spindle::DeviceModel: the GPU model (model/cuda) plus the optimizer
// state on the device (fp32 masters for bf16 weights; fp32 weights are their own masters) or, when
// asked, on the host (backend/cuda/host_optimizer.h).
#include <cuda_profiler_api.h>

#include <cmath>
#include <map>
#include <memory>
#include <sstream>

#include "backend/cuda/check.h"
#include "backend/cuda/host_optimizer.h"
#include "backend/cuda/register.h"
#include "backend/device_model.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/model.h"

namespace spindle::cuda {

namespace {

class CudaDeviceModel final : public DeviceModel {
 public:
  CudaDeviceModel(const ModelConfig& config, const ModelWeights& host, const DeviceModelOptions& options)
      : model_(config, host, options.strict_kernels, options.absorbed_mla),
        chunk_tokens_(options.chunk_tokens) {}

  std::vector<float> log_probs(const std::vector<int32_t>& tokens) override {
    return model_.log_probs(tokens, chunk_tokens_);
  }

  std::vector<float> log_probs_and_selections(const std::vector<int32_t>& tokens,
                                              const SelectionSink& seen) override {
    return model_.log_probs(tokens, chunk_tokens_,
                            [&](size_t layer, int64_t first, const DeviceBuffer<int32_t>& selection) {
                              model_.context().synchronize();
                              seen(static_cast<int64_t>(layer), first, selection.download());
                            });
  }

  LossResult loss_and_gradients(const std::vector<int32_t>& tokens, const LossOptions& options) override {
    return model_.loss_and_gradients(tokens, options);
  }

  void zero_gradients() override { model_.grads().zero(stream()); }

  double clip_gradients(double max_norm) override {
    const TimedScope timed = model_.context().timed("optimizer");
    DeviceWeights& grads = model_.grads();
    auto* values = static_cast<float*>(grads.tensors().embed_tokens.raw());  // the arena's first tensor
    const auto n = static_cast<int64_t>(grads.bytes() / sizeof(float));
    DeviceBuffer<double> sum(1, MemoryCategory::Workspace);
    SPINDLE_CUDA(cudaMemsetAsync(sum.data(), 0, sizeof(double), stream()));
    sum_squares(values, n, sum.data(), stream());
    const double norm = std::sqrt(sum.download()[0]);
    if (max_norm > 0 && std::isfinite(norm)) {
      const double factor = max_norm / (norm + 1e-6);
      if (factor < 1.0) scale_values(values, n, static_cast<float>(factor), stream());
    }
    return norm;
  }

  void download_gradients(ModelWeights& host) override {
    model_.context().synchronize();
    model_.grads().download(host);
  }

  void upload_gradients(const ModelWeights& host) override {
    model_.context().synchronize();
    model_.grads().upload(host);
  }

  void download_weights(ModelWeights& host) override {
    model_.context().synchronize();
    model_.weights().download(host);
  }

  void set_optimizer_on_host(bool on, double host_share) override {
    optimizer_on_host_ = on;
    host_share_ = host_share;
  }

  void load_optimizer(const AdamW& host) override {
    model_.context().synchronize();
    slots_.clear();
    host_optimizer_.reset();
    if (optimizer_on_host_) {
      host_optimizer_ = std::make_unique<HostOptimizer>(model_, host_share_);
      host_optimizer_->load(host);
      return;
    }
    std::map<std::string, Tensor> device_params;
    for (Param& p : parameter_table(model_.config(), model_.weights().tensors()))
      device_params[p.name] = p.tensor;
    std::map<std::string, Tensor> device_grads;
    for (Param& p : parameter_table(model_.config(), model_.grads().tensors()))
      device_grads[p.name] = p.tensor;
    slots_.clear();
    for (const AdamW::Slot& h : host.slots()) {
      Slot s;
      s.frozen = h.frozen;
      s.decays = h.decays;
      s.weight = device_params.at(h.name);
      s.grad = device_grads.at(h.name);
      check(s.weight.numel() == h.master.numel(), "load_optimizer: ", h.name, " has ", h.master.numel(),
            " values on the host, ", s.weight.numel(), " on the device");
      slots_.push_back(std::move(s));
    }
    allocate_state();
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      const AdamW::Slot& h = host.slots()[i];
      const auto bytes = static_cast<size_t>(h.master.numel()) * sizeof(float);
      const bool own_master = s.weight.dtype() == DType::F32;
      copy_to_device(own_master ? s.weight.raw() : s.master, h.master.raw(), bytes);
      copy_to_device(s.exp_avg, h.exp_avg.raw(), bytes);
      copy_to_device(s.exp_avg_sq, h.exp_avg_sq.raw(), bytes);
      // The bf16 weight rounds its master, as the host's write_weights() would.
      if (!own_master)
        f32_to_bf16(s.master, static_cast<__nv_bfloat16*>(s.weight.raw()), s.weight.numel(), stream());
    }
  }

  void set_frozen(const AdamW& host) override {
    if (host_optimizer_) {
      host_optimizer_->set_frozen(host);
      return;
    }
    check(host.slots().size() == slots_.size(), "set_frozen: the host optimizer has ", host.slots().size(),
          " slots, the device ", slots_.size());
    for (size_t i = 0; i < slots_.size(); ++i) slots_[i].frozen = host.slots()[i].frozen;
  }

  void optimizer_step(const AdamWOptions& options, double lr, int64_t step) override {
    const TimedScope timed = model_.context().timed("optimizer");
    if (host_optimizer_) {
      host_optimizer_->step(options, lr, step);
      return;
    }
    for (Slot& s : slots_) {
      if (s.frozen) continue;
      const bool own_master = s.weight.dtype() == DType::F32;
      float* master = own_master ? static_cast<float*>(s.weight.raw()) : s.master;
      __nv_bfloat16* weight = own_master ? nullptr : static_cast<__nv_bfloat16*>(s.weight.raw());
      const AdamWStep update{static_cast<float>(lr),
                             static_cast<float>(options.beta1),
                             static_cast<float>(options.beta2),
                             static_cast<float>(options.eps),
                             static_cast<float>(s.decays ? options.weight_decay : 0.0),
                             step};
      adamw_update(master, s.exp_avg, s.exp_avg_sq, static_cast<const float*>(s.grad.raw()), weight,
                   s.weight.numel(), update, stream());
    }
  }

  void save_optimizer(AdamW& host) override {
    model_.context().synchronize();
    if (host_optimizer_) {
      host_optimizer_->save(host);
      return;
    }
    check(host.slots().size() == slots_.size(), "save_optimizer: the host optimizer has ",
          host.slots().size(), " slots, the device ", slots_.size());
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      AdamW::Slot& h = host.slots()[i];
      const auto bytes = static_cast<size_t>(h.master.numel()) * sizeof(float);
      const float* master =
          s.weight.dtype() == DType::F32 ? static_cast<const float*>(s.weight.raw()) : s.master;
      SPINDLE_CUDA(cudaMemcpy(h.master.raw(), master, bytes, cudaMemcpyDeviceToHost));
      SPINDLE_CUDA(cudaMemcpy(h.exp_avg.raw(), s.exp_avg, bytes, cudaMemcpyDeviceToHost));
      SPINDLE_CUDA(cudaMemcpy(h.exp_avg_sq.raw(), s.exp_avg_sq, bytes, cudaMemcpyDeviceToHost));
    }
    host.write_weights();
  }

  void init_optimizer() override {
    slots_.clear();
    host_optimizer_.reset();
    if (optimizer_on_host_) {
      host_optimizer_ = std::make_unique<HostOptimizer>(model_, host_share_);
      return;
    }
    std::vector<Param> grads = parameter_table(model_.config(), model_.grads().tensors());
    std::vector<Param> params = parameter_table(model_.config(), model_.weights().tensors());
    for (size_t i = 0; i < params.size(); ++i) {
      if (!role_trained(params[i].role)) continue;
      Slot s;
      s.decays = role_decays(params[i].role);
      s.weight = params[i].tensor;
      s.grad = grads[i].tensor;
      slots_.push_back(std::move(s));
    }
    allocate_state();
    SPINDLE_CUDA(cudaMemsetAsync(state_.data(), 0, state_.size() * sizeof(float), stream()));
    for (Slot& s : slots_)
      if (s.weight.dtype() == DType::BF16)
        bf16_to_f32(static_cast<const __nv_bfloat16*>(s.weight.raw()), s.master, s.weight.numel(), stream());
  }

  void set_router_biases(const ModelWeights& host) override {
    model_.context().synchronize();
    if (host_optimizer_) host_optimizer_->set_router_biases(host);
    ModelWeights& device = model_.weights().tensors();
    for (size_t l = 0; l < device.layers.size(); ++l) {
      if (device.layers[l].mlp != MlpKind::Sparse) continue;
      const Tensor staged = host.layers[l].moe.correction_bias.to(DType::F32);
      copy_to_device(device.layers[l].moe.correction_bias.raw(), staged.raw(), staged.nbytes());
    }
  }

  std::string kernel_report() const override {
    std::ostringstream out;
    for (const auto& [site, e] : const_cast<CudaModel&>(model_).context().record.entries())
      out << site << ": " << e.implementation << (e.fallback ? " (FALLBACK)" : "") << " x" << e.calls << '\n';
    const Gemm::PlanStats& gemm = const_cast<CudaModel&>(model_).context().gemm.plan_stats();
    out << "gemm: " << gemm.plans << " plans in " << gemm.seconds << " s of host time, " << gemm.timed
        << " of them timed (" << gemm.switched << " faster than the heuristic's first); "
        << gemm.bucket_reuses << " products took a bucket's plan, " << gemm.exact_fallbacks
        << " refused it\n";
    return out.str();
  }
  bool any_fallback() const override {
    return const_cast<CudaModel&>(model_).context().record.any_fallback();
  }
  MemoryStats memory() const override { return DeviceAllocator::instance().stats(); }
  void reset_memory_peak() override { DeviceAllocator::instance().reset_peak(); }
  void set_timing(bool on) override { model_.set_timer(on ? &timer_ : nullptr); }
  std::map<std::string, double> collect_timing() override {
    std::map<std::string, double> ms;
    timer_.collect(ms);
    return ms;
  }
  void synchronize() override { model_.context().synchronize(); }
  void profile_range(bool begin) override { SPINDLE_CUDA(begin ? cudaProfilerStart() : cudaProfilerStop()); }
  int64_t memory_outside_allocator() const override { return DeviceAllocator::instance().outside_bytes(); }
  AllocatorCounts allocator_counts() const override {
    const DeviceAllocator& a = DeviceAllocator::instance();
    return {a.driver_allocations(), a.cache_flushes()};
  }
  int64_t memory_capacity() const override {
    size_t free = 0, total = 0;
    SPINDLE_CUDA(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(total);
  }
  std::string device_name() const override {
    cudaDeviceProp properties{};
    int device = 0;
    SPINDLE_CUDA(cudaGetDevice(&device));
    SPINDLE_CUDA(cudaGetDeviceProperties(&properties, device));
    return properties.name;
  }

  CudaModel& model() { return model_; }

 private:
  struct Slot {
    bool frozen = false, decays = false;
    Tensor weight, grad;      // device views
    float* master = nullptr;  // bf16 weights only
    float *exp_avg = nullptr, *exp_avg_sq = nullptr;
  };
  // Every slot's fp32 state in one arena (a cudaMalloc per tensor would take whole 2 MiB pages for
  // each of thousands), 256-byte aligned per tensor.
  void allocate_state() {
    const auto aligned = [](int64_t n) { return (n + 63) / 64 * 64; };
    int64_t floats = 0;
    for (const Slot& s : slots_)
      floats += (s.weight.dtype() == DType::BF16 ? 3 : 2) * aligned(s.weight.numel());
    state_ = DeviceBuffer<float>(static_cast<size_t>(floats), MemoryCategory::Optimizer);
    float* at = state_.data();
    for (Slot& s : slots_) {
      const int64_t n = aligned(s.weight.numel());
      s.exp_avg = at;
      s.exp_avg_sq = at + n;
      at += 2 * n;
      if (s.weight.dtype() != DType::BF16) continue;
      s.master = at;
      at += n;
    }
  }
  cudaStream_t stream() { return model_.context().stream(); }

  CudaModel model_;
  int64_t chunk_tokens_;
  std::vector<Slot> slots_;
  DeviceBuffer<float> state_;  // the slots' arena
  bool optimizer_on_host_ = false;
  double host_share_ = kHostAdamWHostShare;
  std::unique_ptr<HostOptimizer> host_optimizer_;  // the state on the host, instead of slots_
  KindTimer timer_;
};

}  // namespace

void register_backend() {
  register_device_backend(Device::CUDA,
                          [](const ModelConfig& config, const ModelWeights& host,
                             const DeviceModelOptions& options) -> std::unique_ptr<DeviceModel> {
                            return std::make_unique<CudaDeviceModel>(config, host, options);
                          });
}

}  // namespace spindle::cuda
