"""Where one kernel's stall samples go, phase by phase: reads ncu's SASS source page as CSV (`ncu -i
REPORT --page source --csv --print-source sass`) and sums the samples and executed instructions
between barriers (BAR) and exits, the kernel's phases, with each phase's busiest opcodes. Phases
under 1% of the samples are left out. First, the executed instructions by opcode over the whole
kernel (how the scorer's per-tile index arithmetic and the union kernels' wgmma descriptors showed
up: docs/PERF.md). See bench/kernel_sass.sh.
    python3 bench/sass_phases.py SASS.csv"""
import collections
import csv
import sys


def opcode(source):
    words = source.split()
    if not words:
        return None
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # past a predicate
    return op.split(".")[0]


def main():
    rows = list(csv.reader(open(sys.argv[1], newline="")))
    header = next((i for i, row in enumerate(rows) if "Warp Stall Sampling (All Samples)" in row), None)
    if header is None:
        sys.exit(f"{sys.argv[1]}: no SASS page with stall samples (ncu --set full? see its log)")
    col = {name: i for i, name in enumerate(rows[header])}
    phases, phase = [], None
    executed = collections.Counter()
    for row in rows[header + 1 :]:
        if len(row) < len(col):
            continue
        op = opcode(row[col["Source"]])
        if op is None:
            continue
        if phase is None:
            phase = {"first": row[col["Address"]], "samples": 0.0, "instructions": 0.0, "ops": collections.Counter()}
        samples = float(row[col["Warp Stall Sampling (All Samples)"]] or 0)
        count = float(row[col["Instructions Executed"]] or 0)
        phase["samples"] += samples
        phase["instructions"] += count
        executed[op] += count
        phase["ops"][op] += samples
        if op in ("BAR", "EXIT"):
            phase["last"] = row[col["Address"]]
            phases.append(phase)
            phase = None
    if phase is not None:
        phase["last"] = "end"
        phases.append(phase)
    total = sum(p["samples"] for p in phases) or 1.0
    instructions = sum(p["instructions"] for p in phases)
    print(f"{total:.0f} stall samples, {instructions:.4g} warp instructions executed, {len(phases)} phases")
    print("executed: " + ", ".join(f"{op} {100 * n / (instructions or 1.0):.1f}%" for op, n in executed.most_common(12)))
    for k, p in enumerate(phases):
        if p["samples"] / total < 0.01:
            continue
        ops = ", ".join(f"{op} {100 * v / p['samples']:.0f}%" for op, v in p["ops"].most_common(6))
        print(f"phase {k:3d} {p['first']}..{p['last']}: {100 * p['samples'] / total:5.1f}% of samples, "
              f"{p['instructions']:.3g} instructions: {ops}")


if __name__ == "__main__":
    main()
