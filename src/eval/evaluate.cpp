#include "eval/evaluate.h"

#include <chrono>

#include "core/error.h"
#include "model/forward.h"

namespace spindle {

template <class T>
BucketLoss evaluate_bucket_loss(const Model& model, int64_t count,
                                const std::function<std::vector<int32_t>(int64_t)>& window,
                                const BucketEvalOptions& options) {
  check(count >= 1, "need at least one evaluation window, got ", count);
  BucketLoss loss(options.bucket_size);
  WindowProgress progress;
  progress.count = count;
  for (int64_t k = 0; k < count; ++k) {
    const std::vector<int32_t> tokens = window(k);
    check(tokens.size() >= 2, "evaluation window ", k + 1, " has ", tokens.size(),
          " tokens; a next-token loss needs at least 2");
    for (size_t i = 0; i < tokens.size(); ++i) {
      check(tokens[i] >= 0 && tokens[i] < model.config.vocab_size, "token id ", tokens[i], " at position ", i,
            " of evaluation window ", k + 1, " is outside the model's vocabulary of ",
            model.config.vocab_size);
    }
    ForwardOptions forward;
    if (options.on_layer) forward.on_layer = [&](int64_t layer) { options.on_layer(k, layer); };
    const auto start = std::chrono::steady_clock::now();
    std::vector<T> log_probs;
    if (options.device != nullptr) {
      const std::vector<float> values = options.device->log_probs(tokens);
      log_probs.assign(values.begin(), values.end());
    } else {
      log_probs = sequence_log_probs<T>(model.config, model.weights, tokens, forward);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    loss.add_window(std::span<const T>(log_probs));

    progress.index = k;
    progress.tokens = static_cast<int64_t>(tokens.size());
    progress.seconds = seconds;
    progress.total_tokens += progress.tokens;
    progress.total_seconds += seconds;
    progress.running_loss = loss.overall_mean();
    if (options.on_window) options.on_window(progress);
  }
  return loss;
}

template BucketLoss evaluate_bucket_loss<float>(const Model&, int64_t,
                                                const std::function<std::vector<int32_t>(int64_t)>&,
                                                const BucketEvalOptions&);
template BucketLoss evaluate_bucket_loss<double>(const Model&, int64_t,
                                                 const std::function<std::vector<int32_t>(int64_t)>&,
                                                 const BucketEvalOptions&);

}  // namespace spindle
