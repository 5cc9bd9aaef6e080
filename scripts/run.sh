#!/usr/bin/env bash
# The main job on the embedded default. For now (foundation stage): build, initialise a small
# GLM-5.3-Flash-shaped model and compute next-token log-probs over a 16k-token sequence on the
# CPU reference path. Training on the chr22 window replaces this once `spindle train` lands.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
work=${SPINDLE_WORK:-runs/default}
mkdir -p "$work"
build/spindle init --config configs/small-dna.json --out "$work/model" --seed 1
build/spindle info --model "$work/model"
python3 - "$work/tokens.txt" <<'PY'
import random, sys
random.seed(0)
open(sys.argv[1], "w").write(" ".join(str(random.randrange(4)) for _ in range(16384)))
PY
build/spindle logprobs --model "$work/model" --tokens "$work/tokens.txt" --out "$work/logprobs.txt"
python3 - "$work/logprobs.txt" <<'PY'
import sys
values = [float(x) for x in open(sys.argv[1])]
print(f"{len(values)} next-token log-probs, mean loss {-sum(values) / len(values):.4f} nats")
PY
