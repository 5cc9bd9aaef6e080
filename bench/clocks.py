"""The GPU's SM clock and power over each step's window, from bench/device_ab.sh's samples.

    python3 bench/clocks.py clocks.csv windows.txt

clocks.csv: nvidia-smi's "timestamp, utilization.gpu, clocks.sm, clocks.max.sm, power.draw,
temperature.gpu, clocks_event_reasons.active" rows, one a second. windows.txt: "name start|end
HH:MM:SS" lines. Only the samples with the GPU busy (utilization 90% or more) count, so that a
step's setup on the host does not dilute them.
"""
import sys
from collections import defaultdict


def seconds(clock):
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def number(field):
    return float(field.split()[0])


def main():
    samples = []
    for line in open(sys.argv[1]):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 7:
            continue
        try:
            samples.append((seconds(fields[0].split()[1]), number(fields[1]), number(fields[2]),
                            number(fields[3]), number(fields[4]), number(fields[5]), fields[6]))
        except (ValueError, IndexError):
            continue  # a header or an error line
    windows = defaultdict(dict)
    for line in open(sys.argv[2]):
        name, edge, clock = line.split()
        windows[name][edge] = seconds(clock)
    print("window: busy samples, SM clock MHz mean / min (max), power W mean / max, temperature C max, "
          "clock event reasons seen")
    for name, w in windows.items():
        if "start" not in w or "end" not in w:
            continue
        busy = [s for s in samples if w["start"] <= s[0] <= w["end"] and s[1] >= 90]
        if not busy:
            print(f"{name}: no busy samples")
            continue
        clocks = [s[2] for s in busy]
        power = [s[4] for s in busy]
        reasons = sorted({s[6] for s in busy})
        print(f"{name}: {len(busy)}, {sum(clocks) / len(clocks):.0f} / {min(clocks):.0f} ({busy[0][3]:.0f}), "
              f"{sum(power) / len(power):.0f} / {max(power):.0f}, {max(s[5] for s in busy):.0f}, "
              f"{' '.join(reasons)}")


if __name__ == "__main__":
    main()
