"""Sums the kernels of an nsys trace exported to SQLite by name (cuBLAS's as one line), largest first,
with the span of the trace, the time the GPU was busy and each kernel's share:
python3 bench/step_kernels.py TRACE.sqlite [ROWS]. See bench/step_profile.sh."""
import collections
import sqlite3
import sys

from kernel_table import short_name


def main():
    db = sqlite3.connect(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    names = dict(db.execute("select id, value from StringIds"))
    rows = sorted(db.execute("select start, end, demangledName from CUPTI_ACTIVITY_KIND_KERNEL"))
    if not rows:
        sys.exit(f"{sys.argv[1]}: no kernels (was the step inside the capture range? see its log)")
    total, calls = collections.Counter(), collections.Counter()
    busy, busy_start, busy_end = 0, rows[0][0], rows[0][0]
    for start, end, name in rows:
        label = short_name(names.get(name, "?"))
        total[label] += (end - start) / 1e6
        calls[label] += 1
        if start > busy_end:  # the union of the kernels' intervals (streams overlap)
            busy += busy_end - busy_start
            busy_start = start
        busy_end = max(busy_end, end)
    busy += busy_end - busy_start
    span = rows[-1][1] - rows[0][0]
    all_ms = sum(total.values())
    print(f"span {span / 1e6:.1f} ms, GPU busy {busy / 1e6:.1f} ms ({100 * busy / span:.1f}%), "
          f"kernels {all_ms:.1f} ms in {len(rows)} launches")
    for name, ms in total.most_common(top):
        print(f"{ms:10.2f} ms {100 * ms / all_ms:5.1f}% {calls[name]:7d}  {name}")


if __name__ == "__main__":
    main()
