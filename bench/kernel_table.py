"""Sums an ncu --csv run of gpu__time_duration.sum by kernel name (cuBLAS's GEMM kernels as one
line), largest first: python3 bench/kernel_table.py KERNELS.csv [ROWS]. See bench/kernel_profile.sh."""
import collections
import csv
import re
import sys

UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}


def short_name(name):
    for noise in ("(anonymous namespace)::", "<unnamed>::", "void ", "spindle::cuda::", "spindle::"):
        name = name.replace(noise, "")
    name = re.sub(r"[(<].*$", "", name)
    return "cuBLAS GEMM (nvjet)" if name.startswith("nvjet") else name


def main():
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    total, calls = collections.Counter(), collections.Counter()
    header = None
    with open(sys.argv[1], newline="") as f:
        for row in csv.reader(f):
            if header is None:
                if "Kernel Name" in row:
                    header = {key: i for i, key in enumerate(row)}
                continue
            try:
                value = float(row[header["Metric Value"]].replace(",", ""))
            except (ValueError, IndexError):
                continue
            name = short_name(row[header["Kernel Name"]])
            total[name] += value * UNITS.get(row[header["Metric Unit"]], 1e-6)
            calls[name] += 1
    if header is None:
        sys.exit(f"{sys.argv[1]}: no ncu CSV header (the run failed? see its log)")
    all_ms = sum(total.values())
    print(f"{all_ms:.1f} ms in {sum(calls.values())} kernels (ncu clocks)")
    for name, ms in total.most_common(rows):
        print(f"{ms:10.2f} ms {100 * ms / all_ms:5.1f}% {calls[name]:6d}  {name}")


if __name__ == "__main__":
    main()
