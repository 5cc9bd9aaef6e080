#!/usr/bin/env bash
# The 4B model (configs/glm53-flash-4b.json) on one H200 at long lengths, on an N-free chrX window
# (data/hs37chrXtrunc.fa.gz; carry it to the device), two training steps per length with the
# planner's policy, results as JSON lines in OUT_DIR (docs/PERF.md, "The 4B model from 32k to a
# million tokens"). The JSON keeps the steps in order: the first with its one-time costs (what
# earlier sessions measured, one step per call), the second the steady state. 1M keeps the AdamW
# state on the host to stay under 130 GB, and is the only length of its call: its two steps and
# setup take 7 of a call's 10 minutes. One process places the AdamW state once, where its longest
# length needs it: the host from 512k on, so run 512k on its own for the shorter lengths to keep
# it on the device.
#     bash bench/run_4b_h200.sh OUT_DIR "32768,131072"
#     bash bench/run_4b_h200.sh OUT_DIR 524288
#     bash bench/run_4b_h200.sh OUT_DIR 1048576
set -uo pipefail
out=$1 lengths=$2
cd "$(dirname "$0")/.."
if [ -d build/devlibs ]; then export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"; fi
mkdir -p "$out"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
extra=()
if [ "$lengths" = 1048576 ]; then extra=(--host-optimizer --gpu-mem 123); fi  # 130 GB at most at 1M
./build/spindle bench --model configs/glm53-flash-4b.json --seq-len "$lengths" --steps 2 --warmup 0 \
  --tokens data/hs37chrXtrunc.fa.gz "${extra[@]}" --out "$out/spindle.jsonl" 2> "$out/spindle.log"
status=$?
cat "$out/spindle.jsonl"
exit $status
