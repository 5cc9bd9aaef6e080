#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=$PWD/build/devlibs
tar xJf build/xz/a.tar.xz -C build; mkdir -p build/tests; cp build/a/spindle_gpu_tests build/tests/; cp build/a/bench_* build/
(cd build/tests && time ./spindle_gpu_tests) > $OUT/suite.log 2>&1; echo "suite rc $?"
grep -E "PASSED|FAILED|Failure" $OUT/suite.log | head -20; tail -4 $OUT/suite.log
for sh in 1 2 8; do timeout 60 ./build/bench_sparse_mla 1048576 16384 $sh; done > $OUT/mla.log 2>&1; cat $OUT/mla.log
