"""Where the GPU waits for the host: from an nsys trace exported to SQLite (nsys export --type sqlite),
the union of kernel, copy and memset intervals over the last WINDOW seconds of the trace, the idle
time between them, and the largest idle totals by the kernel that ended each gap. See
bench/gpu_gaps.sh. python3 bench/gpu_gaps.py TRACE.sqlite WINDOW_SECONDS [ROWS]"""
import collections
import sqlite3
import sys


def intervals(db):
    """The GPU's kernels, copies and memsets, sorted: (start, end, name, the launching call's correlation id)."""
    names = dict(db.execute("select id, value from StringIds"))
    rows = []
    for start, end, name, corr in db.execute(
            "select start, end, shortName, correlationId from CUPTI_ACTIVITY_KIND_KERNEL"):
        rows.append((start, end, names.get(name, "?"), corr))
    for table, label in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
        try:
            for start, end, corr in db.execute(f"select start, end, correlationId from {table}"):
                rows.append((start, end, label, corr))
        except sqlite3.OperationalError:
            pass
    return sorted(rows)


def main():
    db = sqlite3.connect(sys.argv[1])
    window = float(sys.argv[2]) * 1e9
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    rows = intervals(db)
    last = max(r[1] for r in rows)
    rows = [r for r in rows if r[0] >= last - window]
    busy_end, busy, idle = rows[0][0], 0, 0
    gaps_after = collections.Counter()
    gap_count = collections.Counter()
    previous = rows[0][2]
    for start, end, name, _ in rows:
        if start > busy_end:
            gap = start - busy_end
            idle += gap
            gaps_after[(previous, name)] += gap
            gap_count[(previous, name)] += 1
            busy += end - start
            busy_end = end
            previous = name
        elif end > busy_end:
            busy += end - busy_end
            busy_end = end
            previous = name
    span = busy_end - rows[0][0]
    print(f"window {span / 1e6:.1f} ms: GPU busy {busy / 1e6:.1f} ms, idle {idle / 1e6:.1f} ms "
          f"({100 * idle / span:.1f}%) in {sum(gap_count.values())} gaps")
    for (before, after), ns in gaps_after.most_common(top):
        print(f"{ns / 1e6:9.2f} ms {gap_count[(before, after)]:6d}  {before[:50]} -> {after[:50]}")


if __name__ == "__main__":
    main()
