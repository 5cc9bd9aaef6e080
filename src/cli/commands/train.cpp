#include <iostream>

#include "backend/device_model.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "plan/execution.h"
#include "train/trainer.h"

namespace spindle {

int run_train(const std::vector<std::string>& argv) {
  const Args args("train", argv, {"config", "stop-after", "device", "chunk", "policy", "gpu-mem"},
                  {"resume", "strict-kernels", "host-optimizer"});
  const RunConfig run = load_run_config(args.required("config"));
  TrainOptions options;
  options.resume = args.flag("resume");
  options.stop_after = args.int_or("stop-after", -1);
  options.device = parse_device(args.value_or("device", "cpu"), "--device");
  options.strict_kernels = args.flag("strict-kernels");
  check(options.device == Device::CUDA || !options.strict_kernels,
        "--strict-kernels applies to --device cuda");
  if (args.flag("host-optimizer")) {
    check(options.device == Device::CUDA, "--host-optimizer applies to --device cuda");
    options.optimizer_on_host = true;
  }
  if (args.optional("chunk")) {
    options.chunk_tokens = args.int_or("chunk", 0);
    check(options.device == Device::CUDA,
          "--chunk applies to --device cuda (the planner picks it otherwise)");
    check(*options.chunk_tokens >= 0, "--chunk must be a number of tokens >= 1 (or 0: no chunks), got ",
          *options.chunk_tokens);
  }
  if (const auto name = args.optional("policy")) {
    check(options.device == Device::CUDA, "--policy applies to --device cuda (the CPU keeps every site)");
    check(!options.chunk_tokens, "--chunk and --policy exclude each other (--chunk N streams)");
    options.site_policy = plan::parse_site_policy(*name);
  }
  if (args.optional("gpu-mem")) {
    check(options.device == Device::CUDA, "--gpu-mem applies to --device cuda");
    options.gpu_bytes = args.gib_bytes("gpu-mem");
  }
  const std::string dir = train(run, options);
  std::cout << "final checkpoint: " << dir << "\n";
  return 0;
}

}  // namespace spindle
