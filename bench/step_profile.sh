#!/usr/bin/env bash
# Where one training step's GPU time goes, kernel by kernel, at any length: nsys traces the last step
# of `spindle bench --profile` (its capture range, so not the setup before it) and
# bench/step_kernels.py sums the kernels by name. On the GPU machine, after scripts/prepare_device.sh:
#     bash bench/step_profile.sh OUT_DIR MODEL SEQ_LEN [more spindle bench options]
# e.g. the trained checkpoint of bench/trained_1m_h200.sh at 1M:
#     bash bench/step_profile.sh OUT /tmp/tf/run/$(cat /tmp/tf/run/latest) 1048576 --host-optimizer
# The GPU machine's nsys needs libdw and libelf (see bench/nsys_env.sh: build/nsyslibs). With
# SPINDLE_NO_PDL=1 in the environment the kernels launch plainly, so that each kernel's span in the
# table is its own: a programmatic dependent's span also holds its wait for the kernel before it.
set -euo pipefail
out=$1 model=$2 seq_len=$3
shift 3
cd "$(dirname "$0")/.."
source bench/nsys_env.sh
mkdir -p "$out"
"$nsys" profile -t cuda --sample=none --cpuctxsw=none --capture-range=cudaProfilerApi \
  --capture-range-end=stop -o "$out/step" -f true ./build/spindle bench --model "$model" --seq-len "$seq_len" \
  --steps 1 --warmup 0 --tokens data/hs37chrXtrunc.fa.gz --profile "$@" > "$out/bench.json" 2> "$out/bench.log"
"$nsys" export --type sqlite -o "$out/step.sqlite" -f true "$out/step.nsys-rep" > /dev/null
python3 bench/step_kernels.py "$out/step.sqlite" | tee "$out/kernels.txt"
