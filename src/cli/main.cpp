// spindle: train and evaluate hybrid linear/sparse-attention MoE models on long sequences.
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

#ifdef SPINDLE_HAVE_CUDA
#include "backend/cuda/register.h"
#endif

namespace {

const char* kUsage = R"(usage: spindle <command> [options]

commands:
  info      --model DIR                         layer plan, parameter counts, bytes
  init      --config FILE --out DIR [--seed N] [--dtype f32|bf16|f64]
                                                random weights (transformers' init), saved loadable
  logprobs  --model DIR --tokens FILE [--dtype f32|f64] [--out FILE]
            [--device cpu|cuda] [--strict-kernels] [--mla expanded|absorbed] [--chunk N]
                                                log p(token_i | tokens before i), one line per i >= 1
                                                (cuda: bf16 weights and activations, fp32 math)
  eval      --model DIR --data PATH --seq-len L --bucket B [--windows N] [--chromosomes a,b]
            [--max-n-fraction F] [--holdout F] [--compare DIR2] [--out PREFIX] [--dtype f32|f64]
                                                held-out loss per position bucket: table, PREFIX.csv/.svg
  route     --model DIR (--tokens FILE | --random-tokens) [--length N] [--seed N] [--chunk N]
            [--dtype f32|f64] [--out FILE.json]
                                                routed-expert load per MoE layer (CPU forward): busiest
                                                expert / mean, CV, idle experts, over the sequence and
                                                per chunk (default 4096 tokens); --tokens: a token text
                                                or a sequence file (an N-free window of --length N);
                                                random ids are uniform over the vocabulary
  select    --model DIR (--tokens FILE | --random-tokens) [--length N] [--seed N] [--chunk N]
            [--dtype f32|f64] [--device cpu|cuda] [--out FILE.json]
                                                how much neighbouring queries' DSA selections overlap,
                                                per DSA layer (CPU forward, or the GPU's in bf16): pools
                                                shared by t and t+1, and the union of G neighbours'
                                                pools over their sum
  grads     --model DIR --tokens FILE --out FILE.safetensors [--dtype f32|f64] [--chunk N]
                                                gradient of the mean next-token loss, on-disk names
  data      get [--dir DIR] [--only chr22,chrX,chr20]
                                                fetch reference DNA from Debian packages (checked)
  data      info --input FILE [--format F] [--names A,B] [--vocab N]
                                                sequences, lengths and N runs of a data file
  train     --config RUN.toml [--resume] [--stop-after N] [--device cpu|cuda] [--strict-kernels] [--chunk N]
            [--host-optimizer] [--gpu-mem GB]
                                                train (see README: RUN.toml), checkpoints, metrics
  bench     --model DIR|CONFIG.json --seq-len L [--steps N] [--warmup N] [--data FASTA]
            [--random-tokens] [--strict-kernels] [--mla expanded|absorbed] [--chunk N]
            [--host-optimizer] [--indexer-kl] [--profile] [--out FILE.json] [--plan-policy NAME]
            [--gpu-mem GB] [--no-kind-times]
                                                GPU forward+backward+AdamW steps: JSON with tokens/s,
                                                time by layer kind (none with --no-kind-times, as
                                                training runs), peak memory by category, MFU,
                                                the memory policy (the planner's pick unless --chunk,
                                                or --plan-policy: a policy as spindle plan names it;
                                                --gpu-mem: planned for that much of the GPU)
  plan      --model DIR|CONFIG.json --seq-len L [--gpus N] [--gpu-mem GB] [--host-mem GB]
            [--mla expanded|absorbed] [--indexer-kl] [--mfu F]
                                                every memory policy with predicted peak device and
                                                host memory and step time, and the pick: the fastest
                                                that fits (L: 131072, 128k or 1M; GB = GiB; defaults:
                                                1 GPU, 141 GB, 128 GB host per GPU; exit 1 if none fits)
  help                                          this text
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
#ifdef SPINDLE_HAVE_CUDA
  spindle::cuda::register_backend();
#endif
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "info") return spindle::run_info(args);
    if (command == "init") return spindle::run_init(args);
    if (command == "logprobs") return spindle::run_logprobs(args);
    if (command == "eval") return spindle::run_eval(args);
    if (command == "data") return spindle::run_data(args);
    if (command == "grads") return spindle::run_grads(args);
    if (command == "train") return spindle::run_train(args);
    if (command == "bench") return spindle::run_bench(args);
    if (command == "plan") return spindle::run_plan(args);
    if (command == "route") return spindle::run_route(args);
    if (command == "select") return spindle::run_select(args);
    if (command == "help" || command == "--help" || command == "-h") {
      std::cout << kUsage;
      return 0;
    }
    std::cerr << "spindle: unknown command '" << command << "'\n" << kUsage;
    return 2;
  } catch (const spindle::Error& e) {
    std::cerr << "spindle: error: " << e.what() << '\n';
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "spindle: internal error: " << e.what() << '\n';
    return 3;
  }
}
