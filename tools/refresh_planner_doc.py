#!/usr/bin/env python3
"""Re-runs every `spindle plan` output quoted in docs/PLANNER.md and puts the new output in place.

Each quoted block starts with the plan's header line ("spindle plan: MODEL, T tokens, G GPUs of M
GiB ..., host H GiB per GPU"), from which the command is rebuilt; multi-GPU plans keep the first
three rows that do not fit. Run after a change to the planner or its calibration:
    python3 tools/refresh_planner_doc.py [build/spindle] [docs/PLANNER.md]
"""
import re
import subprocess
import sys

HEADER = re.compile(r"^spindle plan: (\S+), (\d+) tokens, (\d+) GPUs? of ([\d.]+) GiB .*host ([\d.]+) GiB per GPU$")


def trimmed(output):
    """The multi-GPU plans, as the document quotes them: rows that do not fit after the first three
    dropped (hundreds of tensor-parallel variants)."""
    kept, misfits = [], 0
    for line in output:
        if "does not fit" in line:
            misfits += 1
            if misfits > 3:
                continue
        kept.append(line)
    return kept


def main():
    spindle = sys.argv[1] if len(sys.argv) > 1 else "build/spindle"
    path = sys.argv[2] if len(sys.argv) > 2 else "docs/PLANNER.md"
    lines = open(path).read().split("\n")
    out, i, refreshed = [], 0, 0
    while i < len(lines):
        out.append(lines[i])
        match = HEADER.match(lines[i + 1]) if lines[i] == "```" and i + 1 < len(lines) else None
        if not match:
            i += 1
            continue
        model, tokens, gpus, gpu_mem, host_mem = match.groups()
        command = [spindle, "plan", "--model", model, "--seq-len", tokens, "--gpus", gpus, "--gpu-mem", gpu_mem,
                   "--host-mem", host_mem]
        result = subprocess.run(command, capture_output=True, text=True)
        # A plan where nothing fits exits with an error, its table still the output.
        if not result.stdout.startswith("spindle plan:"):
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr}")
        out.extend(trimmed(result.stdout.rstrip("\n").split("\n")) if gpus != "1" else
                   result.stdout.rstrip("\n").split("\n"))
        i = lines.index("```", i + 1)  # the block's closing fence, kept by the next pass
        refreshed += 1
    open(path, "w").write("\n".join(out))
    print(f"{path}: {refreshed} plan outputs refreshed")


if __name__ == "__main__":
    main()
