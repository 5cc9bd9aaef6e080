// The subcommands of `spindle`, one file each under cli/commands/.
#pragma once

#include <string>
#include <vector>

namespace spindle {

int run_info(const std::vector<std::string>& args);
int run_init(const std::vector<std::string>& args);
int run_logprobs(const std::vector<std::string>& args);
int run_eval(const std::vector<std::string>& args);
int run_data(const std::vector<std::string>& args);
int run_grads(const std::vector<std::string>& args);
int run_train(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);
int run_plan(const std::vector<std::string>& args);
int run_route(const std::vector<std::string>& args);
int run_select(const std::vector<std::string>& args);

}  // namespace spindle
