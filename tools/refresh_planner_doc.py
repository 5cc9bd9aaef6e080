#!/usr/bin/env python3
"""Re-runs every `spindle plan` output quoted in docs/PLANNER.md and puts the new output in place.

Each quoted block starts with the plan's header line ("spindle plan: MODEL, T tokens, G GPUs of M
GiB ..., host H GiB per GPU"), from which the command is rebuilt (run from the repository root,
the document's parent folder's parent); multi-GPU plans keep the first three rows that do not fit.
Run after a change to the planner or its calibration; with --check (a CPU test) it changes nothing
and fails if the document is out of date:
    python3 tools/refresh_planner_doc.py [--check] [build/spindle] [docs/PLANNER.md]
"""
import os
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


def refreshed(spindle, path):
    """The document's text with every quoted plan run again, and how many there were."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    lines = open(path).read().split("\n")
    out, i, count = [], 0, 0
    while i < len(lines):
        out.append(lines[i])
        match = HEADER.match(lines[i + 1]) if lines[i] == "```" and i + 1 < len(lines) else None
        if not match:
            i += 1
            continue
        model, tokens, gpus, gpu_mem, host_mem = match.groups()
        command = [os.path.abspath(spindle), "plan", "--model", model, "--seq-len", tokens, "--gpus", gpus,
                   "--gpu-mem", gpu_mem, "--host-mem", host_mem]
        result = subprocess.run(command, capture_output=True, text=True, cwd=root)
        # A plan where nothing fits exits with an error, its table still the output.
        if not result.stdout.startswith("spindle plan:"):
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr}")
        output = result.stdout.rstrip("\n").split("\n")
        out.extend(trimmed(output) if gpus != "1" else output)
        i = lines.index("```", i + 1)  # the block's closing fence, kept by the next pass
        count += 1
    return "\n".join(out), count


def main():
    args = sys.argv[1:]
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    spindle = args[0] if args else "build/spindle"
    path = args[1] if len(args) > 1 else "docs/PLANNER.md"
    text, count = refreshed(spindle, path)
    if check:
        if text != open(path).read():
            sys.exit(f"{path} is out of date with the planner: run python3 tools/refresh_planner_doc.py")
        print(f"{path}: its {count} plan outputs are the planner's")
        return
    open(path, "w").write(text)
    print(f"{path}: {count} plan outputs refreshed")


if __name__ == "__main__":
    main()
