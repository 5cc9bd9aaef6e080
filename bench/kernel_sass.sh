#!/usr/bin/env bash
# One kernel of a benchmark under ncu's full set (its first launch), read back as the SASS source
# page and summed by phase (bench/sass_phases.py: stall samples and instructions between barriers,
# each phase's busiest opcodes), with the headline metrics of the details page. On the GPU machine:
#     bash bench/kernel_sass.sh OUT_DIR KERNEL BINARY [ARGS...]
#     e.g. bash bench/kernel_sass.sh OUT kda_bwd_grad_kernel build/bench_kda
# Build with line tables for ncu's source view if wanted (cmake -DSPINDLE_LINEINFO=ON); the SASS
# page needs none. Writes OUT_DIR/KERNEL.{ncu-rep,sass.csv,txt}.
set -euo pipefail
out=$1 kernel=$2
shift 2
cd "$(dirname "$0")/.."
if [ -d build/devlibs ]; then export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"; fi
ncu=${NCU:-/usr/local/cuda/bin/ncu}
mkdir -p "$out"
"$ncu" -k "regex:$kernel" -c 1 --set full -f -o "$out/$kernel" "$@" > "$out/$kernel.log" 2>&1
"$ncu" -i "$out/$kernel.ncu-rep" --page source --csv --print-source sass > "$out/$kernel.sass.csv"
{
  "$ncu" -i "$out/$kernel.ncu-rep" --page details | grep -E "Duration|Registers Per|Dynamic Shared|Achieved Occupancy|Issued Ipc Active|No Eligible|Warp Cycles Per Issued|Bank|uncoalesced" || true
  python3 bench/sass_phases.py "$out/$kernel.sass.csv"
} | tee "$out/$kernel.txt"
