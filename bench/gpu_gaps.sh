#!/usr/bin/env bash
# Where the GPU waits for the host in a streamed step: nsys traces two steps of the 4-layer slice
# (bench/glm53-flash-4b-4layers.json) and bench/gpu_gaps.py sums the idle time between kernels in
# the last one, by the kernels on either side of each gap. On the GPU machine, after
# scripts/prepare_device.sh:
#     bash bench/gpu_gaps.sh OUT_DIR [SEQ_LEN] [CHUNK]
# The GPU machine's nsys (nsight-compute's copy) needs libdw and libelf, which it lacks: copy them
# from this machine into build/nsyslibs (cp -L /usr/lib/x86_64-linux-gnu/lib{dw,elf}.so.1
# build/nsyslibs) and carry that folder.
set -euo pipefail
out=$1 seq_len=${2:-32768} chunk=${3:-16384}
cd "$(dirname "$0")/.."
source bench/nsys_env.sh
mkdir -p "$out"
"$nsys" profile -t cuda --sample=none --cpuctxsw=none -o "$out/trace" -f true ./build/spindle bench \
  --model bench/glm53-flash-4b-4layers.json --seq-len "$seq_len" --chunk "$chunk" --steps 1 --warmup 1 \
  --tokens data/hs37chrXtrunc.fa.gz > "$out/bench.json" 2> "$out/bench.log"
"$nsys" export --type sqlite -o "$out/trace.sqlite" -f true "$out/trace.nsys-rep" > /dev/null
step=$(grep -o '"step_seconds":\[[0-9.e-]*' "$out/bench.json" | tail -1 | cut -d[ -f2)
python3 bench/gpu_gaps.py "$out/trace.sqlite" "$step" 30 | tee "$out/gaps.txt"
