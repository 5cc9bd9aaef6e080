#!/usr/bin/env bash
# GPU training through the CLI (label gpu), on real DNA:
#   overfit:  with --device cuda, the loss on one 256-token window falls by at least 85% within
#             20 steps (as the CPU check in train_checks.sh);
#   resume:   a GPU checkpoint resumes (on the GPU) and the loss keeps falling;
#   bench:    `spindle bench` prints its JSON with every field, on real DNA tokens.
source "$(dirname "$0")/cli_checks_common.sh"

write_overfit_toml "$work/overfit.toml"
"$spindle" train --device cuda --strict-kernels --config "$work/overfit.toml" --stop-after 12 > "$work/a.log" 2>&1 ||
  { cat "$work/a.log"; fail "overfit run"; }
"$spindle" train --device cuda --strict-kernels --config "$work/overfit.toml" --resume > "$work/b.log" 2>&1 ||
  { cat "$work/b.log"; fail "overfit resume"; }
check_overfit "gpu overfit"

"$spindle" bench --model "$here/configs/tiny.json" --seq-len 300,1000 --steps 2 --warmup 1 \
  --tokens "$here/../bench/chr22_70k.tokens" --strict-kernels --out "$work/bench.jsonl" > "$work/bench.log" 2>&1 ||
  { cat "$work/bench.log"; fail "bench"; }
python3 - "$work/bench.jsonl" <<'PY' || failures=$((failures + 1))
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
need = ["tokens_per_second", "seconds_by_layer_kind", "peak_memory", "peak_host_bytes", "mfu", "step_seconds",
        "tokens", "setup_seconds"]
ok = len(rows) == 2 and all(all(k in r for k in need) for r in rows)
ok = ok and all(r["peak_host_bytes"] > 0 for r in rows)
ok = ok and all(set(r["setup_seconds"]) == {"tokens", "weights", "device", "optimizer"} for r in rows)
ok = ok and all(r["tokens_per_second"] > 0 and r["tokens"].startswith("real DNA") for r in rows)
ok = ok and all({"kda", "dsa", "moe", "head"} <= set(r["seconds_by_layer_kind"]) for r in rows)
print("bench:", json.dumps(rows[-1]) if rows else "no output", "->", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY

exit $((failures > 0))
