#!/usr/bin/env bash
# Sourced by the CLI check scripts: $spindle (the binary, their first argument), $here (tests/),
# $work (a scratch folder removed on exit), a failure count and the overfit check that the CPU
# and the GPU training checks share.
set -u
spindle=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# One 256-token window of real DNA, 20 steps at a constant learning rate, checkpoints in $work/overfit.
write_overfit_toml() {  # write_overfit_toml FILE
  cat > "$1" <<TOML
[model]
config = "$here/configs/overfit-dna.json"
seed = 1
[data]
train = "$here/data/chr22_256.fa"
[train]
seq_len = 256
steps = 20
[optim]
lr = 3e-3
min_lr = 3e-3
warmup = 1
weight_decay = 0.0
[checkpoint]
dir = "$work/overfit"
TOML
}

# The loss of the 20 logged steps must fall by at least 85%.
check_overfit() {  # check_overfit LABEL
  python3 - "$work/overfit/metrics.jsonl" "$1" <<'PY' || failures=$((failures + 1))
import json, sys
losses = [json.loads(line)["loss"] for line in open(sys.argv[1])]
first, last = losses[0], losses[-1]
fall = 1 - last / first
print(f"{sys.argv[2]}: loss {first:.4f} -> {last:.4f} in {len(losses)} steps ({100 * fall:.1f}% fall, need >= 85%)")
sys.exit(0 if len(losses) == 20 and fall >= 0.85 else 1)
PY
}
