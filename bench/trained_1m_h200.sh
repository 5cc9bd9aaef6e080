#!/usr/bin/env bash
# The 1M step from trained weights. The benches run the 4B model from random weights, whose indexer
# picks pools that neighbouring queries hardly share; a trained indexer's neighbours share most of
# theirs (docs/PERF.md, "Do neighbouring queries select the same pools?"), and the sparse
# attention's gathers and gradient reductions then meet in the L2. Fine-tuning at full length
# starts from trained weights, so this measures that case. Caveats: 80 steps at 32k teach the 4B
# model little beyond the bases' frequencies, and trained from the start 4 or 5 of its 11 indexers
# die in the first 10 steps (every relu closed: docs/PERF.md, "Dead indexers"); FREEZE_STEPS=10 (one
# run) or FROZEN_STEPS=10 (two) keeps them alive (measured at 54b3ac3 and 62788fe: "The 1M step from
# live indexers on the pairs' kernel", "Frozen first, then trained"). The select phase says whether
# a checkpoint's selections are content-dependent. Phases:
#   train: trains the model from its config (seed 1) at SEQ_LEN tokens (32k) on an N-free chrX
#          window for STEPS steps (80) on the GPU and keeps the last checkpoint without the AdamW
#          state ([checkpoint] optimizer = false: the fp32 model, 16.7 GB for the 4B model, where
#          the state would add 50 GB to the device's 64 GB disk);
#   bench: one step at BENCH_LEN tokens (1,048,576) from it, as run_4b_h200.sh does from random
#          weights;
#   select: the overlap of neighbouring queries' selections in it (`spindle select --device`),
#          over an N-free window of SELECT_LEN tokens of chrX (65,536).
# Each phase fits one device call (train: about 5 min of steps at 3.9 s with the indexers' KL
# training, measured at 75726c6, and 1.5-2 min of setup and checkpoint; FREEZE_STEPS=10 STEPS=20
# about 3 min in all, measured at bd87664; bench: about 3 min). The
# checkpoint stays on the device machine, so bench must follow at once (an idle machine is given
# back), or both phases run in one call with STEPS=30 (7 min, as measured). CONFIG and DEVICE
# override the model config and the device (a CPU dry run: CONFIG=tests/configs/tiny.json
# SEQ_LEN=256 STEPS=2 DEVICE=cpu; bench needs a GPU), LR and MIN_LR the schedule (1e-3 to 1e-4),
# FROZEN_STEPS the steps run first, as a run of their own, with the indexers frozen (0; see the
# train phase), FREEZE_STEPS the same inside the one run ([indexer] freeze_steps, 0).
#     bash bench/trained_1m_h200.sh OUT_DIR train
#     bash bench/trained_1m_h200.sh OUT_DIR bench
#     bash bench/trained_1m_h200.sh OUT_DIR select
set -euo pipefail
out=$(realpath -m "$1") phase=$2
cd "$(dirname "$0")/.."
if [ -d build/devlibs ]; then export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"; fi
config=$(realpath "${CONFIG:-configs/glm53-flash-4b.json}")
seq_len=${SEQ_LEN:-32768} steps=${STEPS:-80} bench_len=${BENCH_LEN:-1048576} device=${DEVICE:-cuda}
lr=${LR:-1e-3} min_lr=${MIN_LR:-1e-4}
tokens=$(realpath data/hs37chrXtrunc.fa.gz)
mkdir -p "$out"
write_toml() {  # write_toml FILE MODEL_LINES STEPS FREEZE_LINE CHECKPOINT_DIR TRAIN_SEED
  cat > "$1" <<TOML
# Written by bench/trained_1m_h200.sh.
[model]
$2

[data]
train = "$tokens"

[train]
seq_len = $seq_len
steps = $3
seed = $6

[optim]
lr = $lr
min_lr = $min_lr
warmup = $(($3 < 10 ? $3 : 10))

[indexer]
$4

[checkpoint]
dir = "$5"
every = 0
keep = 1
optimizer = false
TOML
}
case "$phase" in
  train)
    # FROZEN_STEPS > 0: first that many steps with the indexers frozen (their relus die in the first
    # steps of their KL training from random weights: docs/PERF.md, "Dead indexers"), then STEPS
    # more from that checkpoint with them trained (a new AdamW state and schedule, new windows).
    frozen_steps=${FROZEN_STEPS:-0}
    model_line="config = \"$config\"
seed = 1"
    if [ "$frozen_steps" -gt 0 ]; then
      write_toml "$out/frozen.toml" "$model_line" "$frozen_steps" "freeze = true" "$out/frozen" 1
      ./build/spindle train --config "$out/frozen.toml" --device "$device" 2> >(tee "$out/frozen.log" >&2)
      model_line="dir = \"$out/frozen/$(cat "$out/frozen/latest")\""
    fi
    write_toml "$out/run.toml" "$model_line" "$steps" "freeze_steps = ${FREEZE_STEPS:-0}" "$out/run" \
      $((frozen_steps > 0 ? 2 : 1))
    ./build/spindle train --config "$out/run.toml" --device "$device" 2> >(tee "$out/train.log" >&2)
    ;;
  bench)
    model="$out/run/$(cat "$out/run/latest")"
    extra=()
    if [ "$bench_len" -ge 524288 ]; then extra=(--host-optimizer); fi
    if [ "$bench_len" -ge 1048576 ]; then extra+=(--gpu-mem 123); fi  # the 130 GB the 1M step must stay in
    ./build/spindle bench --model "$model" --seq-len "$bench_len" --steps 1 --warmup 0 --tokens "$tokens" \
      "${extra[@]}" --out "$out/spindle.jsonl" 2> "$out/spindle.log"
    cat "$out/spindle.jsonl"
    ;;
  select)
    # How much neighbouring queries' selections overlap in the trained model (docs/PERF.md, "Do
    # neighbouring queries select the same pools?"), from the GPU's forward over 64k tokens of chrX.
    model="$out/run/$(cat "$out/run/latest")"
    ./build/spindle select --model "$model" --tokens "$tokens" --length "${SELECT_LEN:-65536}" \
      --chunk 16384 --device "$device" --out "$out/select.json" 2> "$out/select.log"
    ;;
  *)
    echo "usage: bash bench/trained_1m_h200.sh OUT_DIR train|bench|select" >&2
    exit 2
    ;;
esac
