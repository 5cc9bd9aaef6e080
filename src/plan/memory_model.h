// Predicted peak memory of one training step (forward, backward, AdamW) on one GPU for a
// sequence of `tokens` tokens under a Policy. The device side replays the CUDA executor's
// allocations on a Ledger (plan/ledger.h): the model state (plan/state_memory.h), then
// model/cuda/model.cpp's loss_and_gradients buffer by buffer, the sublayers from
// plan/sublayer_memory.h. KeepSites is the executor as it exists; the other policies change
// what the forward stores (documented at each) and are predictions for code not yet written.
#pragma once

#include <cstdint>
#include <limits>

#include "core/allocator.h"
#include "model/config.h"
#include "plan/parallel.h"
#include "plan/policy.h"
#include "plan/state_memory.h"

namespace spindle::plan {

struct StepOptions {
  bool absorbed = false;    // MLA over the shared latent (spindle bench --mla absorbed)
  bool indexer_kl = false;  // the indexer's KL training (spindle train's default; bench --indexer-kl)
};

// Host memory the process holds beyond what a plan allocates: the CUDA runtime, cuBLASLt, the
// program and its tokens. Measured as the peak resident set (VmHWM) of the 4B config's steps on
// the H200 machine, 982a7bc: 18.1 GiB at 32k and 128k against 15.5 GiB of fp32 host weights; 86.1
// and 86.3 GiB at 512k and 1M with the host AdamW against 85.5 GiB of weights, copies and state.
constexpr int64_t kProcessHostBytes = int64_t{2} << 30;

struct MemoryPrediction {
  MemoryStats device;       // peaks per category and of the total, as spindle bench reports them
  int64_t host = 0;         // the process, the fp32 weights it loaded, the pinned pool, host AdamW
  int64_t pinned_pool = 0;  // offloaded layer inputs: exactly their sum, one pool reused every step
};

MemoryPrediction predict_memory(const Shapes& shapes, const StateBytes& state, int64_t tokens,
                                const Policy& policy, const StepOptions& options = {});

// The most pools a 16-bit pool list holds (kernels/cuda/selection_pools.h, pool_lists_fit_16_bits):
// pools 0 .. 65534, the largest uint16_t standing for none.
constexpr int64_t kPoolsIn16BitLists = std::numeric_limits<uint16_t>::max();

// Bytes of what the streaming executor keeps for the whole step (docs/STREAMING.md): per KDA
// layer the fp32 state at each later chunk start and the conv window (kernel - 1 rows of q, k,
// v), and their gradients for one boundary; per DSA layer the bf16 latent cache [tokens,
// kv_lora_rank + rope] and its fp32 gradient, per indexer the bf16 pooled keys (and their fp32
// gradient when the indexer trains), its keys and gates before pooling (the sequence's, or the last
// chunk's where chunks start on pools and the indexer does not train) and, with kept_selections,
// the selections as pool lists
// (topk / kpool per token: 16 bits where every pool of the chunk's fits, else int32) of every chunk
// but the last, which the forward pass leaves to its recomputation.
int64_t streaming_carry_bytes(const Shapes& shapes, int64_t tokens, int64_t chunk_tokens,
                              const StepOptions& options, bool kept_selections);

}  // namespace spindle::plan
