#!/usr/bin/env bash
# Spindle and transformers side by side on one H200: `spindle bench` and bench/transformers_peer.py
# on the same config, lengths and real DNA tokens, results as JSON lines in OUT_DIR.
#     bash bench/run_h200.sh OUT_DIR CONFIG "SPINDLE_LENGTHS" "PEER_LENGTHS" [STEPS]
set -uo pipefail
out=$1 config=$2 spindle_lengths=$3 peer_lengths=$4 steps=${5:-2}
cd "$(dirname "$0")/.."
if [ -d build/devlibs ]; then export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"; fi
mkdir -p "$out"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
if [ -n "$spindle_lengths" ]; then
  ./build/spindle bench --model "$config" --seq-len "$spindle_lengths" --steps "$steps" --warmup 1 \
    --out "$out/spindle.jsonl" 2> "$out/spindle.log"
fi
if [ -n "$peer_lengths" ]; then
  # shellcheck disable=SC2086
  python3 bench/transformers_peer.py --config "$config" --seq-lens $peer_lengths --tokens bench/chr22_70k.tokens \
    --steps "$steps" --out "$out/peer.jsonl" > "$out/peer.log" 2>&1
fi
cat "$out"/*.jsonl
