#!/usr/bin/env bash
# The main job on the embedded default: set up, build, fetch the chr22 1 Mbp window from Debian's
# hisat2 package, train a small GLM-5.3-Flash-shaped model on it for a few minutes on the CPU,
# then evaluate before and after on the held-out last 20% and print the per-position table.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
build/spindle data get --dir data --only chr22

run=runs/chr22-$(date +%Y%m%d-%H%M%S)
mkdir -p "$run"
run=$(cd "$run" && pwd)
build/spindle init --config configs/small-dna.json --out "$run/init" --seed 1
build/spindle info --model "$run/init"
sed -e "s#MODEL_DIR#$run/init#" -e "s#RUN_DIR#$run/checkpoints#" configs/chr22-default.toml > "$run/run.toml"
sed -i "s#\.\./data/#$PWD/data/#" "$run/run.toml"
build/spindle train --config "$run/run.toml"

final="$run/checkpoints/$(cat "$run/checkpoints/latest")"
build/spindle eval --model "$final" --compare "$run/init" --data data/22_20-21M.fa --holdout 0.2 \
  --seq-len 2048 --bucket 256 --windows 8 --out "$run/before-after"
echo
echo "trained model:   $final"
echo "metrics:         $run/checkpoints/metrics.jsonl"
echo "table and plot:  $run/before-after.csv, $run/before-after.svg (open the .svg in a browser)"
