"""Which of the GPU's idle gaps wait on the host, and what the host was doing meanwhile: from an nsys
trace exported to SQLite (bench/step_profile.sh). A gap is the host's when the call that launched the
work after it returned after the GPU went idle (the GPU had nothing queued); else the GPU's own (a
wait on another stream, a launch's latency). For the host's gaps, the launching thread's time from
the GPU going idle to that launch is split by the CUDA calls in it (the rest: host code between
calls), and the gaps are counted by the call that launched the work after them.
    python3 bench/host_gaps.py TRACE.sqlite [ROWS]"""
import collections
import sqlite3
import sys
from bisect import bisect_left

from gpu_gaps import intervals


def runtime_calls(db, names):
    """Per host thread, its CUDA calls sorted by start: (start, end, name); and by correlation id."""
    by_thread = collections.defaultdict(list)
    by_correlation = {}
    for start, end, tid, corr, name in db.execute(
            "select start, end, globalTid, correlationId, nameId from CUPTI_ACTIVITY_KIND_RUNTIME"):
        call = (start, end, names.get(name, "?"))
        by_thread[tid].append(call)
        by_correlation[corr] = (tid, call)
    for calls in by_thread.values():
        calls.sort()
    return by_thread, by_correlation


def short(name):
    return name.split("_v")[0] if name.startswith("cuda") else name


def main():
    db = sqlite3.connect(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    names = dict(db.execute("select id, value from StringIds"))
    work = intervals(db)
    by_thread, by_correlation = runtime_calls(db, names)
    starts = {tid: [c[0] for c in calls] for tid, calls in by_thread.items()}

    host_idle = gpu_idle = 0
    host_gaps = gpu_gaps = 0
    in_calls = collections.Counter()       # host thread's time in each call during the host's gaps
    between_calls = 0                      # and outside any call
    by_launch = collections.Counter()      # the host's gaps by what came after them
    by_launch_count = collections.Counter()
    busy_end = work[0][0]
    previous = work[0][2]
    for start, end, name, corr in work:
        if start > busy_end:
            gap = start - busy_end
            launch = by_correlation.get(corr)
            if launch is not None and launch[1][1] > busy_end:
                tid, call = launch
                host_idle += gap
                host_gaps += 1
                key = (previous[:40], short(call[2]), name[:40])
                by_launch[key] += gap
                by_launch_count[key] += 1
                calls = by_thread[tid]
                lo, hi = busy_end, call[0]
                covered = 0
                i = max(0, bisect_left(starts[tid], lo) - 1)
                while i < len(calls) and calls[i][0] < hi:
                    overlap = min(calls[i][1], hi) - max(calls[i][0], lo)
                    if overlap > 0:
                        in_calls[short(calls[i][2])] += overlap
                        covered += overlap
                    i += 1
                between_calls += max(0, hi - lo - covered)
            else:
                gpu_idle += gap
                gpu_gaps += 1
        if end > busy_end:
            busy_end = end
            previous = name
    span = busy_end - work[0][0]
    print(f"span {span / 1e6:.1f} ms: idle waiting on the host {host_idle / 1e6:.1f} ms in {host_gaps} gaps, "
          f"idle otherwise {gpu_idle / 1e6:.1f} ms in {gpu_gaps} gaps")
    print(f"the launching thread in those gaps: between CUDA calls {between_calls / 1e6:.1f} ms; in calls:")
    for call, ns in in_calls.most_common(top):
        print(f"  {ns / 1e6:9.2f} ms  {call}")
    print("the host's gaps by (work before, the launching call, work after):")
    for key, ns in by_launch.most_common(top):
        print(f"  {ns / 1e6:9.2f} ms {by_launch_count[key]:6d}  {key[0]} | {key[1]} | {key[2]}")
    totals = collections.Counter()
    counts = collections.Counter()
    for calls in by_thread.values():
        for s, e, name in calls:
            totals[short(name)] += e - s
            counts[short(name)] += 1
    print("every thread's CUDA calls over the trace:")
    for call, ns in totals.most_common(top):
        print(f"  {ns / 1e6:9.2f} ms {counts[call]:7d}  {call}")


if __name__ == "__main__":
    main()
