#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=$PWD/build/devlibs
tar xJf build/xz/a.tar.xz -C build; mkdir -p build/tests; cp build/a/spindle_gpu_tests build/tests/; cp build/a/bench_* build/
(cd build/tests && ./spindle_gpu_tests --gtest_filter='CudaSparse*:CudaIndexer*') > $OUT/test.log 2>&1; echo "test rc $?"
grep -E "OK|FAILED|Failure" $OUT/test.log | head -20
for sh in 8 1; do timeout 40 ./build/bench_sparse_mla 1048576 16384 $sh; done 2>&1 | tee $OUT/mla.log
