#!/usr/bin/env bash
# Training checks through the CLI, on real DNA (a chr22 snippet from Debian's hisat2 example):
#   overfit:  the loss on one 256-token window falls by at least 85% within 20 steps;
#   resume:   10 steps straight == 5 steps + checkpoint + --resume + 5 steps, bit for bit;
#   model only: [checkpoint] optimizer = false, the same model without the AdamW state;
#   refusal:  an existing checkpoint directory is never overwritten without --resume;
#   frozen first: [indexer] freeze_steps = 4 trains the model of freeze = true for 4 steps, then
#             the indexers too (their KL logged from step 5), and resumes across the switch.
source "$(dirname "$0")/cli_checks_common.sh"

# --- overfit
write_overfit_toml "$work/overfit.toml"
"$spindle" train --config "$work/overfit.toml" > "$work/overfit.log" 2>&1 || { cat "$work/overfit.log"; fail "overfit run"; }
check_overfit overfit

# --- resume
run_toml() {  # run_toml NAME
  cat <<TOML
[model]
config = "$here/configs/tiny.json"
seed = 2
[data]
train = "$here/data/chr22_8k.fa"
[train]
seq_len = 300
batch = 2
accumulate = 2
steps = 10
seed = 7
[optim]
lr = 2e-3
warmup = 3
[indexer]
kl_coef = 0.5
[moe]
aux_loss_coef = 0.01
[checkpoint]
dir = "$work/$1"
every = 3
TOML
}
run_toml straight > "$work/straight.toml"
run_toml resumed > "$work/resumed.toml"
"$spindle" train --config "$work/straight.toml" > "$work/straight.log" 2>&1 || { cat "$work/straight.log"; fail "straight run"; }
"$spindle" train --config "$work/resumed.toml" --stop-after 5 > "$work/first.log" 2>&1 || { cat "$work/first.log"; fail "first half"; }
[ -d "$work/resumed/step-000005" ] || fail "no checkpoint at step 5"
"$spindle" train --config "$work/resumed.toml" --resume > "$work/second.log" 2>&1 || { cat "$work/second.log"; fail "resumed half"; }
for f in model.safetensors optimizer.safetensors; do
  if cmp -s "$work/straight/step-000010/$f" "$work/resumed/step-000010/$f"; then
    echo "resume: $f identical after 10 steps"
  else
    fail "resume: $f differs between the straight and the resumed run"
  fi
done
python3 - "$work/straight/metrics.jsonl" "$work/resumed/metrics.jsonl" <<'PY' || failures=$((failures + 1))
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
print(f"resume: losses straight {a[-1]!r}, resumed {b[-1]!r}, {len(a)} and {len(b)} steps")
sys.exit(0 if a == b and len(a) == 10 else 1)
PY

# --- model only: [checkpoint] optimizer = false trains the same model, writes no AdamW state, and
# a resume says why it cannot
{ run_toml modelonly; echo "optimizer = false"; } > "$work/modelonly.toml"
"$spindle" train --config "$work/modelonly.toml" > "$work/modelonly.log" 2>&1 || { cat "$work/modelonly.log"; fail "model-only run"; }
if ! cmp -s "$work/straight/step-000010/model.safetensors" "$work/modelonly/step-000010/model.safetensors"; then
  fail "model only: model.safetensors differs from the straight run's"
elif [ -e "$work/modelonly/step-000010/optimizer.safetensors" ]; then
  fail "model only: the checkpoint holds optimizer.safetensors"
elif "$spindle" train --config "$work/modelonly.toml" --resume > "$work/modelonly_resume.log" 2>&1; then
  fail "model only: --resume was accepted"
elif ! grep -q "cannot be resumed" "$work/modelonly_resume.log"; then
  fail "model only: resume message: $(cat "$work/modelonly_resume.log")"
else
  echo "model only: the straight run's model, no optimizer state; resume refused"
fi

# --- never overwrite
before=$(cat "$work/straight/latest")
if "$spindle" train --config "$work/straight.toml" > "$work/again.log" 2>&1; then
  fail "a second run into the same checkpoint directory was accepted"
elif ! grep -q "pass --resume" "$work/again.log"; then
  fail "refusal message: $(cat "$work/again.log")"
elif [ "$(cat "$work/straight/latest")" != "$before" ]; then
  fail "the refused run changed the checkpoint pointer"
else
  echo "refusal: $(grep -o 'already holds.*' "$work/again.log" | head -c 150)"
fi

# --- frozen first: the first 4 steps are freeze = true's bit for bit, then the indexers train
run_toml frozen | sed -e 's/kl_coef = 0.5/kl_coef = 0.5\nfreeze_steps = 4/' -e 's/every = 3/every = 3\nkeep = 5/' \
  > "$work/frozen_first.toml"
run_toml frozen_all | sed -e 's/kl_coef = 0.5/kl_coef = 0.5\nfreeze = true/' -e 's/every = 3/every = 3\nkeep = 5/' \
  > "$work/frozen_all.toml"
run_toml frozen_resumed | sed 's/kl_coef = 0.5/kl_coef = 0.5\nfreeze_steps = 4/' > "$work/frozen_resumed.toml"
"$spindle" train --config "$work/frozen_first.toml" > "$work/frozen_first.log" 2>&1 || { cat "$work/frozen_first.log"; fail "frozen-first run"; }
"$spindle" train --config "$work/frozen_all.toml" > "$work/frozen_all.log" 2>&1 || { cat "$work/frozen_all.log"; fail "frozen run"; }
"$spindle" train --config "$work/frozen_resumed.toml" --stop-after 3 > "$work/frozen_a.log" 2>&1 &&
  "$spindle" train --config "$work/frozen_resumed.toml" --resume > "$work/frozen_b.log" 2>&1 ||
  { cat "$work/frozen_a.log" "$work/frozen_b.log"; fail "frozen-first resumed run"; }
python3 - "$work" <<'PY' || failures=$((failures + 1))
import json, struct, sys
work = sys.argv[1]
def tensors(path):  # name -> raw bytes of a safetensors file
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
first3 = tensors(f"{work}/frozen/step-000003/model.safetensors")
all3 = tensors(f"{work}/frozen_all/step-000003/model.safetensors")
first10 = tensors(f"{work}/frozen/step-000010/model.safetensors")
all10 = tensors(f"{work}/frozen_all/step-000010/model.safetensors")
resumed10 = tensors(f"{work}/frozen_resumed/step-000010/model.safetensors")
indexer = [k for k in first10 if ".indexer." in k]
kl = [json.loads(l).get("indexer_kl") for l in open(f"{work}/frozen/metrics.jsonl")]
checks = {
    "step 3 equals freeze = true's": first3 == all3,
    "indexer tensors trained by step 10": bool(indexer) and any(first10[k] != all10[k] for k in indexer),
    "KL logged from step 5 on": kl[:4] == [None] * 4 and all(x is not None and x > 0 for x in kl[4:]),
    "resumed across the switch, bit for bit": resumed10 == first10,
}
for what, ok in checks.items():
    print(f"frozen first: {what}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if all(checks.values()) else 1)
PY
grep -q "step 5: the indexers train from here on" "$work/frozen_first.log" || fail "frozen first: no log line at the switch"

# --- SIGKILL at random moments of a run that checkpoints every step: the newest complete
# checkpoint must always load and the run must resume from it.
run_toml killed | sed -e 's/steps = 10/steps = 400/' -e 's/every = 3/every = 1/' > "$work/killed.toml"
# First let one checkpoint complete (however loaded the machine is), then kill at random moments.
"$spindle" train --config "$work/killed.toml" > "$work/killed.log" 2>&1 &
pid=$!
for _ in $(seq 600); do [ -e "$work/killed/latest" ] && break; sleep 0.1; done
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
for attempt in 1 2 3 4 5; do
  "$spindle" train --config "$work/killed.toml" --resume > "$work/killed.log" 2>&1 &
  pid=$!
  sleep "0.$((RANDOM % 8 + 2))"
  kill -9 $pid 2>/dev/null
  wait $pid 2>/dev/null
done
if [ -e "$work/killed/latest" ]; then
  if "$spindle" train --config "$work/killed.toml" --resume --stop-after 1 > "$work/after_kill.log" 2>&1; then
    echo "sigkill: 5 kills, then $(grep -o 'resumed from .*' "$work/after_kill.log")"
  else
    fail "sigkill: resume after kills: $(tail -3 "$work/after_kill.log")"
  fi
  leftovers=$(find "$work/killed" -maxdepth 1 -name '*.tmp-*' | wc -l)
  [ "$leftovers" -eq 0 ] || fail "sigkill: $leftovers temporary checkpoint directories left after the resume"
else
  fail "sigkill: no checkpoint was completed before the kills"
fi

if [ $failures -ne 0 ]; then echo "$failures training check(s) failed"; exit 1; fi
echo "training checks passed"
