#!/usr/bin/env python3
"""Runs `spindle logprobs` on a golden case and compares with transformers' log-probs.

    check_golden.py SPINDLE CASE_DIR f64|f32 [EXTRA SPINDLE OPTIONS...]

(e.g. --chunk 37: the streaming executor must meet the same bounds.)

Bounds (issue 2): f64: mean |diff| <= 1e-5, max <= 1e-4; f32: mean <= 1e-4, max <= 1e-3.
Standard library only, so that CI needs nothing beyond python3.
"""
import os
import subprocess
import sys
import tempfile

BOUNDS = {"f64": (1e-5, 1e-4), "f32": (1e-4, 1e-3)}


def read_numbers(path):
    with open(path) as f:
        return [float(line) for line in f if line.strip()]


def main():
    spindle, case_dir, dtype = sys.argv[1:4]
    extra = sys.argv[4:]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logprobs.txt")
        cmd = [spindle, "logprobs", "--model", case_dir, "--tokens", os.path.join(case_dir, "tokens.txt"),
               "--dtype", dtype, "--out", out] + extra
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stderr)
            print(f"FAIL: spindle exited with {result.returncode}")
            return 1
        got = read_numbers(out)
    want = read_numbers(os.path.join(case_dir, "logprobs.txt"))
    if len(got) != len(want):
        print(f"FAIL: {len(got)} log-probs, reference has {len(want)}")
        return 1
    diffs = [abs(a - b) for a, b in zip(got, want)]
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    worst_at = diffs.index(worst) + 1
    mean_bound, max_bound = BOUNDS[dtype]
    ok = mean <= mean_bound and worst <= max_bound
    print(f"{os.path.basename(os.path.normpath(case_dir))} {dtype} {' '.join(extra)}: {len(diffs)} positions, mean |diff| {mean:.3e} (bound {mean_bound:g}), "
          f"max |diff| {worst:.3e} at position {worst_at} (bound {max_bound:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
