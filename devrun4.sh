#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=$PWD/build/devlibs
t0=$(date +%s)
tar xJf build/xz/a.tar.xz -C build; cp build/a/spindle build/spindle; mkdir -p build/tests; cp build/a/spindle_gpu_tests build/tests/; cp build/a/bench_* build/
FREEZE_STEPS=10 STEPS=20 timeout 220 bash bench/trained_1m_h200.sh build/tf train > $OUT/train.log 2>&1; echo "train rc $? at $(( $(date +%s) - t0 )) s"
cp build/tf/run/metrics.jsonl $OUT/ 2>/dev/null
timeout 200 bash bench/trained_1m_h200.sh build/tf bench > $OUT/bench.log 2>&1; echo "bench rc $? at $(( $(date +%s) - t0 )) s"
cp build/tf/spindle.jsonl build/tf/spindle.log $OUT/ 2>/dev/null; grep -h "attention_backward" build/tf/spindle.log | head -3
python3 -c "
import json;d=json.loads(open('build/tf/spindle.jsonl').readline());print(d['step_seconds'],d['mfu'],d['peak_memory']['peak_total_bytes'],d['predicted_peak_bytes'],d['final_loss'],d['peak_host_bytes']);print(d['seconds_by_layer_kind'])"
left=$(( 370 - ($(date +%s) - t0) ))
if [ $left -gt 30 ]; then timeout $left ./build/bench_sparse_mla 1048576 16384 8 > $OUT/mla.log 2>&1; echo "mla rc $?"; cat $OUT/mla.log; fi
