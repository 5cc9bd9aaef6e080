# Sourced by the nsys scripts (bench/gpu_gaps.sh, bench/step_profile.sh), from the repository root:
# the libraries the binaries and nsys need (build/devlibs; build/nsyslibs: libdw and libelf, which the
# GPU machine's nsys lacks, copied from this machine) and $nsys, the nsys to run.
for libs in build/devlibs build/nsyslibs; do
  if [ -d "$libs" ]; then export LD_LIBRARY_PATH="$PWD/$libs:${LD_LIBRARY_PATH:-}"; fi
done
nsys=${NSYS:-$(command -v nsys || ls /opt/nvidia/nsight-*/*/host/target-linux-x64/nsys 2>/dev/null | head -1)}
