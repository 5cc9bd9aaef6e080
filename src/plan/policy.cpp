#include "plan/policy.h"

namespace spindle::plan {

const char* activation_policy_name(ActivationPolicy policy) {
  switch (policy) {
    case ActivationPolicy::KeepSites:
      return "keep";
    case ActivationPolicy::KeepLayerInputs:
      return "recompute";
    case ActivationPolicy::OffloadLayerInputs:
      return "offload";
    case ActivationPolicy::Stream:
      return "stream";
  }
  return "?";
}

std::string Policy::name() const {
  std::string text = activation_policy_name(activations);
  if (activations == ActivationPolicy::Stream) {
    const bool kilo = chunk_tokens % 1024 == 0;
    text += " " + std::to_string(kilo ? chunk_tokens / 1024 : chunk_tokens) + (kilo ? "k" : "");
    if (indexer_again) text += ", indexer twice";
    if (outputs_again) text += ", outputs again";
    if (kda_matrices_again) text += ", KDA matrices again";
    if (ffn_inputs_again) text += ", feed-forward inputs again";
    if (kda_projections_kept > 0)
      text += ", KDA projections kept in " + std::to_string(kda_projections_kept) + " layers";
  }
  if (optimizer_on_host) text += gradients_to_host ? " + host AdamW and gradients" : " + host AdamW";
  if (tensor_parallel > 1) text += " tp" + std::to_string(tensor_parallel);
  return text;
}

}  // namespace spindle::plan
