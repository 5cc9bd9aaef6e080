#!/usr/bin/env bash
# One device call over builds packed here, each against the others on the same GPU. The GPU machine's
# session ends 30 s after a call, taking /tmp (and a trained checkpoint) with it, so a call does
# all that needs the checkpoint. Here, after building each variant (git checkout, cmake --build):
#     bash bench/device_ab.sh pack NAME [BENCH..]  # build/xz/NAME.tar.xz: spindle, spindle_gpu_tests
#                                           # and the kernel benches named (bench_indexer_layer ..),
#                                           # stripped (all of them would pass the 64 MiB carry)
# then, carrying build/xz, build/devlibs (scripts/prepare_device.sh), build/nsyslibs for PROFILE
# (bench/nsys_env.sh) and data, on the device (every part optional, in this order):
#     VARIANTS="main new"                     # unpack build/xz/{main,new}.tar.xz; the first's is build/spindle
#     SUITE=1                                 # main's whole GPU suite and tests/gpu_train_checks.sh
#                                             # (SUITE=NAME: that variant's)
#     TESTS="new=CudaKda*:CudaModel.*"        # a variant's GPU tests by gtest filter
#     TESTS_GATE=1                            # a failed TESTS run skips every later part (no 1M
#                                             # step for a variant that is wrong)
#     BENCH="bench_indexer_layer 1048576"     # a kernel bench's command line, each variant's binary
#                                             # in turn (BENCH_VARIANTS, default VARIANTS), twice, ABAB
#     SLICE="main new"                        # the 4B config's four layers (bench/glm53-flash-4b-4layers.json),
#                                             # 64k tokens in 16k chunks (the 1M step's chunk), 8 timed
#                                             # steps after 3, each variant in turn, twice (ABAB): the
#                                             # median step and its time by kind
#     STEPS=262144 STEP_VARIANTS="main new"   # two steps from random weights (configs/glm53-flash-4b.json)
#     STEPS1M="main new new:kl main:b"        # a trained checkpoint (bench/trained_1m_h200.sh train,
#                                             # about 150 s), then one 1M step from it per entry
#                                             # (:kl with the indexers' KL training, :b with
#                                             # --plan-policy "$POLICY_B": another of the planner's
#                                             # policies, e.g. POLICY_B="stream 16k + host AdamW"; :cap
#                                             # with --gpu-mem ${GPU_MEM:-123}: planned for 121 GiB,
#                                             # 129.9 GB, the issue's 130 GB at 1M; :warm timing the
#                                             # second step, after one untimed: no first-step
#                                             # allocations, about 80 s more; :untimed with
#                                             # SPINDLE_GEMM_TUNE=0: cuBLASLt's first algorithm
#                                             # for every product, as before the timed plans;
#                                             # :nokinds with --no-kind-times: no time by kind,
#                                             # the step as training runs it)
#     TRAIN=1                                 # the checkpoint without STEPS1M (for PROFILE alone)
#     REUSE_CHECKPOINT=1                      # the checkpoint an earlier call left on this machine
#                                             # (still warm: called within 30 s), not trained again;
#                                             # the profile's model too
#     PROFILE=262144                          # an nsys trace of the first variant's step at that
#                                             # length from the checkpoint (or configs/glm53-flash-4b.json
#                                             # without STEPS1M): bench/step_kernels.py,
#                                             # bench/gpu_gaps.py and bench/host_gaps.py
#     PROFILE_ARGS=--host-optimizer           # more options for that step (word-split)
#     PROFILE_NEEDS=240                       # seconds it needs (default 120), else skipped
#     PROFILE_NO_PDL=1                        # the profiled step without programmatic dependent launches
#                                             # (SPINDLE_NO_PDL=1, kernels/cuda/launch.cuh): each kernel's
#                                             # span its own, not its wait for the one before
#     OUT=... bash bench/device_ab.sh run
# A part that would not finish inside the call's 600 s (LIMIT) is skipped and says so.
set -fuo pipefail
cd "$(dirname "$0")/.." || exit
mode=${1:-run}
if [ "$mode" = pack ]; then
  name=$2 dir=$(mktemp -d)
  benches=("${@:3}")
  cp build/spindle build/tests/spindle_gpu_tests "${benches[@]/#/build/}" "$dir/" &&
    find "$dir" -type f -exec strip {} + && mkdir -p build/xz &&
    tar cJf "build/xz/$name.tar.xz" -C "$dir" . && rm -rf "$dir" && ls -l "build/xz/$name.tar.xz"
  exit
fi
start=$(date +%s)
left() { echo $((${LIMIT:-585} - ($(date +%s) - start))); }
at() { echo "at $(($(date +%s) - start)) s"; }
export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"
for v in ${VARIANTS:-main}; do mkdir -p "build/a/$v" && tar xJf "build/xz/$v.tar.xz" -C "build/a/$v"; done
variants=(${VARIANTS:-main})
cp "build/a/${variants[0]}/spindle" build/spindle  # for the scripts that run build/spindle
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# The SM clock, power and temperature each second through the call (bench/clocks.py reads them
# over each step's window), to tell a slower kernel from a throttled GPU.
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 1000 > "$OUT/clocks.csv" 2>&1 &
sampler=$!
trap 'kill $sampler 2> /dev/null' EXIT
window() { echo "$1 $2 $(date +%T)" >> "$OUT/windows.txt"; }
tokens=data/hs37chrXtrunc.fa.gz
if [ -n "${SUITE:-}" ]; then
  sv=${SUITE/#1/main}
  timeout 240 "build/a/$sv/spindle_gpu_tests" > "$OUT/suite.log" 2>&1
  echo "suite of $sv rc=$? $(at)"; grep -E '^\[  PASSED|^\[  FAILED|tests ran' "$OUT/suite.log" | head -20
  timeout 120 bash tests/gpu_train_checks.sh "build/a/$sv/spindle" > "$OUT/train_checks.log" 2>&1
  echo "train_checks rc=$? $(at)"; tail -3 "$OUT/train_checks.log"
fi
tests_failed=0
for vf in ${TESTS:-}; do
  v=${vf%%=*}
  timeout 200 "build/a/$v/spindle_gpu_tests" --gtest_filter="${vf#*=}" > "$OUT/tests_$v.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && tests_failed=1
  echo "tests $v rc=$rc $(at)"; grep -E '^\[  PASSED|^\[  FAILED|tests ran' "$OUT/tests_$v.log" | head
done
if [ -n "${TESTS_GATE:-}" ] && [ "$tests_failed" = 1 ]; then
  echo "TESTS failed: every later part skipped (TESTS_GATE)"
  BENCH='' SLICE='' STEP_VARIANTS='' STEPS1M='' TRAIN='' PROFILE=''
fi
if [ -n "${BENCH:-}" ]; then
  set -- $BENCH
  for round in 1 2; do
    for v in ${BENCH_VARIANTS:-${VARIANTS:-main}}; do
      window "bench_${v}_$round" start
      timeout 120 "build/a/$v/$1" "${@:2}" > "$OUT/bench_${v}_$round.txt" 2>&1
      echo "bench $v round $round rc=$? $(at)"; window "bench_${v}_$round" end; cat "$OUT/bench_${v}_$round.txt"
    done
  done
fi
for round in 1 2; do
  for v in ${SLICE:-}; do
    window "slice_${v}_$round" start
    timeout 100 "build/a/$v/spindle" bench --model bench/glm53-flash-4b-4layers.json --seq-len 65536 \
      --chunk 16384 --steps 8 --warmup 3 --tokens "$tokens" --out "$OUT/slice_${v}_$round.jsonl" \
      > /dev/null 2> "$OUT/slice_${v}_$round.log"
    echo "slice $v round $round rc=$? $(at)"; window "slice_${v}_$round" end
    python3 - "$OUT/slice_${v}_$round.jsonl" << 'EOF'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith('{'):
        d = json.loads(line)
        kinds = d.get('seconds_by_layer_kind') or {}
        print(f"  median {d['step_seconds_median']:.4f} s ", ' '.join(f'{k}={v:.4f}' for k, v in sorted(kinds.items())))
EOF
  done
done
for v in ${STEP_VARIANTS:-}; do
  [ "$(left)" -lt 150 ] && { echo "skip the ${STEPS:-262144} step of $v: $(left) s left"; continue; }
  window "step_$v" start
  "build/a/$v/spindle" bench --model configs/glm53-flash-4b.json --seq-len "${STEPS:-262144}" --steps 2 \
    --warmup 0 --tokens "$tokens" --out "$OUT/step_$v.jsonl" 2> "$OUT/step_$v.log"
  window "step_$v" end
  echo "$v rc=$? $(at)"; head -c 2500 "$OUT/step_$v.jsonl"; echo
done
model=configs/glm53-flash-4b.json
if [ -n "${REUSE_CHECKPOINT:-}" ] && [ -s /tmp/tf/run/latest ]; then
  model=/tmp/tf/run/$(cat /tmp/tf/run/latest)
  echo "the checkpoint an earlier call trained on this machine: $model"
elif [ -n "${STEPS1M:-}${TRAIN:-}" ]; then
  FREEZE_STEPS=10 STEPS=20 bash bench/trained_1m_h200.sh /tmp/tf train > "$OUT/train.log" 2>&1
  echo "train rc=$? $(at)"; tail -2 "$OUT/train.log"
  model=/tmp/tf/run/$(cat /tmp/tf/run/latest)
fi
for vk in ${STEPS1M:-}; do
  warmup=0 needs=145
  [[ ":$vk:" == *":warm:"* ]] && warmup=1 needs=230
  [ "$(left)" -lt "$needs" ] && { echo "skip the 1M step of $vk: $(left) s left"; continue; }
  v=${vk%%:*} name=${vk//:/_} extra=() tune=1
  [[ ":$vk:" == *":kl:"* ]] && extra+=(--indexer-kl)
  [[ ":$vk:" == *":b:"* ]] && extra+=(--plan-policy "$POLICY_B")
  [[ ":$vk:" == *":cap:"* ]] && extra+=(--gpu-mem "${GPU_MEM:-123}")
  [[ ":$vk:" == *":untimed:"* ]] && tune=0
  [[ ":$vk:" == *":nokinds:"* ]] && extra+=(--no-kind-times)
  window "step1m_$name" start
  SPINDLE_GEMM_TUNE=$tune "build/a/$v/spindle" bench --model "$model" --seq-len 1048576 --steps 1 --warmup "$warmup" --tokens "$tokens" \
    --host-optimizer "${extra[@]}" --out "$OUT/step1m_$name.jsonl" 2> "$OUT/step1m_$name.log"
  window "step1m_$name" end
  echo "$vk rc=$? $(at)"; head -c 2500 "$OUT/step1m_$name.jsonl"; echo
done
if [ -n "${PROFILE:-}" ] && [ "$(left)" -lt "${PROFILE_NEEDS:-120}" ]; then
  echo "skip the profile: $(left) s left"
elif [ -n "${PROFILE:-}" ]; then
  SPINDLE_NO_PDL=${PROFILE_NO_PDL:-0} bash bench/step_profile.sh /tmp/prof "$model" "$PROFILE" ${PROFILE_ARGS:-} \
    > "$OUT/profile.log" 2>&1
  echo "profile rc=$? $(at)"
  python3 bench/step_kernels.py /tmp/prof/step.sqlite 120 > "$OUT/kernels.txt" 2>&1
  (cd bench && python3 gpu_gaps.py /tmp/prof/step.sqlite 1000 40) > "$OUT/gaps.txt" 2>&1
  python3 bench/host_gaps.py /tmp/prof/step.sqlite 40 > "$OUT/host_gaps.txt" 2>&1
  cp /tmp/prof/bench.json "$OUT/profile_bench.json" 2> /dev/null
  head -40 "$OUT/kernels.txt"; head -12 "$OUT/gaps.txt"; head -90 "$OUT/host_gaps.txt"
fi
if [ -s "$OUT/windows.txt" ]; then python3 bench/clocks.py "$OUT/clocks.csv" "$OUT/windows.txt"; fi
