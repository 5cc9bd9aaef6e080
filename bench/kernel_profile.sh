#!/usr/bin/env bash
# Where a streamed step's GPU time goes, kernel by kernel: ncu times every kernel of one step of the
# 4-layer slice of the 4B model (bench/glm53-flash-4b-4layers.json; 3 KDA + 1 DSA layers, MoE on the
# last) and bench/kernel_table.py sums them by name (docs/PERF.md, "TMA for the sparse MLA
# forward, and a profile of the streamed step"). ncu runs at its own fixed clocks, about 1.25x the
# kernels' times at the GPU's boost clocks. On the GPU machine, after scripts/prepare_device.sh:
#     bash bench/kernel_profile.sh OUT_DIR [SEQ_LEN] [CHUNK]
# For ncu's source view (stalls and bank conflicts by line), build with line tables first:
# cmake -S . -B build -DSPINDLE_LINEINFO=ON (the binaries double in size).
set -euo pipefail
out=$1 seq_len=${2:-32768} chunk=${3:-16384}
cd "$(dirname "$0")/.."
if [ -d build/devlibs ]; then export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"; fi
ncu=${NCU:-/usr/local/cuda/bin/ncu}
mkdir -p "$out"
"$ncu" --metrics gpu__time_duration.sum --csv ./build/spindle bench --model bench/glm53-flash-4b-4layers.json \
  --seq-len "$seq_len" --chunk "$chunk" --steps 1 --warmup 0 --tokens data/hs37chrXtrunc.fa.gz \
  > "$out/kernels.csv" 2> "$out/ncu.log"
python3 bench/kernel_table.py "$out/kernels.csv" | tee "$out/kernels.txt"
