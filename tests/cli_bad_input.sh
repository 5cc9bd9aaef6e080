#!/usr/bin/env bash
# Bad input to the spindle CLI: each case must fail with a non-zero exit and a message that
# names what is wrong.
source "$(dirname "$0")/cli_checks_common.sh"

expect_failure() {  # expect_failure NAME PATTERN command...
  local name=$1 pattern=$2
  shift 2
  local output status
  output=$("$@" 2>&1)
  status=$?
  if [ $status -eq 0 ]; then
    echo "FAIL $name: exit 0"; failures=$((failures + 1))
  elif ! grep -qiE "$pattern" <<<"$output"; then
    echo "FAIL $name: message does not match /$pattern/: $output"; failures=$((failures + 1))
  else
    echo "ok   $name: $(head -c 200 <<<"$output" | tr '\n' ' ')"
  fi
}

"$spindle" init --config "$here/configs/tiny.json" --out "$work/model" --seed 3 || { echo "FAIL: init"; exit 1; }
echo "1 2 3 4 5 6 7 8" > "$work/tokens.txt"
"$spindle" logprobs --model "$work/model" --tokens "$work/tokens.txt" --out "$work/ok.txt" || { echo "FAIL: logprobs"; exit 1; }

echo "1 2 99 4" > "$work/big.txt"
expect_failure token-out-of-range "token id 99.*vocabulary" "$spindle" logprobs --model "$work/model" --tokens "$work/big.txt"
echo "1 2 x 4" > "$work/word.txt"
expect_failure token-not-integer "line 1: 'x'" "$spindle" logprobs --model "$work/model" --tokens "$work/word.txt"
expect_failure token-file-missing "cannot read token file" "$spindle" logprobs --model "$work/model" --tokens "$work/none.txt"
expect_failure bad-dtype-option "dtype" "$spindle" logprobs --model "$work/model" --tokens "$work/tokens.txt" --dtype f8
expect_failure unknown-option "unknown option '--tokenz'" "$spindle" logprobs --model "$work/model" --tokenz x

cp -r "$work/model" "$work/truncated"
size=$(stat -c %s "$work/truncated/model.safetensors")
truncate -s $((size / 2)) "$work/truncated/model.safetensors"
expect_failure truncated-safetensors "truncat|shorter" "$spindle" logprobs --model "$work/truncated" --tokens "$work/tokens.txt"

cp -r "$work/model" "$work/badjson"
echo '{"vocab_size": 16,' > "$work/badjson/config.json"
expect_failure malformed-config "config.json" "$spindle" logprobs --model "$work/badjson" --tokens "$work/tokens.txt"

cp -r "$work/model" "$work/unknown"
sed -i 's/"vocab_size"/"vocab_sizes"/' "$work/unknown/config.json"
expect_failure unknown-config-field "vocab_sizes" "$spindle" info --model "$work/unknown"

cp -r "$work/model" "$work/shape"
sed -i 's/"hidden_size": 32/"hidden_size": 40/' "$work/shape/config.json"
expect_failure wrong-shape "expected shape|expected \[" "$spindle" logprobs --model "$work/shape" --tokens "$work/tokens.txt"

cp -r "$work/model" "$work/more_layers"
sed -i 's/"num_hidden_layers": 4/"num_hidden_layers": 5/' "$work/more_layers/config.json"
sed -i '/"layer_types"/,/\]/d; /"mlp_layer_types"/,/\]/d; /"indexer_types"/,/\]/d' "$work/more_layers/config.json"
expect_failure missing-tensor "missing tensor 'model.language_model.layers.4" "$spindle" logprobs --model "$work/more_layers" --tokens "$work/tokens.txt"

train_toml() {  # train_toml DATA SEQ_LEN CONFIG
  printf '[model]\nconfig = "%s"\n[data]\ntrain = "%s"\n[train]\nseq_len = %s\nsteps = 2\n[checkpoint]\ndir = "%s"\n' \
    "$3" "$1" "$2" "$work/run"
}
train_toml "$work/none.fa" 64 "$here/configs/tiny.json" > "$work/missing.toml"
expect_failure train-missing-fasta "not found.*none.fa" "$spindle" train --config "$work/missing.toml"
train_toml "$here/data/chr22_256.fa" 4096 "$here/configs/tiny.json" > "$work/long.toml"
expect_failure train-window-too-long "seq_len = 4096.*longer" "$spindle" train --config "$work/long.toml"
sed 's/"vocab_size": 16/"vocab_size": 8/' "$here/configs/tiny.json" > "$work/small_vocab.json"
train_toml "$here/data/chr22_256.fa" 64 "$work/small_vocab.json" > "$work/vocab.toml"
expect_failure train-vocab-too-small "vocab_size \\(8\\).*nucleotide" "$spindle" train --config "$work/vocab.toml"
train_toml "$here/data/chr22_256.fa" 64 "$here/configs/tiny.json" | sed 's/steps = 2/stepz = 2/' > "$work/typo.toml"
expect_failure train-unknown-key "unknown key 'stepz'" "$spindle" train --config "$work/typo.toml"
train_toml "$here/data/chr22_256.fa" 64 "$here/configs/tiny.json" > "$work/ok.toml"
expect_failure train-host-optimizer-on-cpu "host-optimizer applies to .*device cuda" "$spindle" train --config "$work/ok.toml" --host-optimizer
expect_failure train-chunk-on-cpu "chunk applies to .*device cuda" "$spindle" train --config "$work/ok.toml" --chunk 16
expect_failure train-policy-on-cpu "policy applies to .*device cuda" "$spindle" train --config "$work/ok.toml" --policy offload
expect_failure train-gpu-mem-on-cpu "gpu-mem applies to .*device cuda" "$spindle" train --config "$work/ok.toml" --gpu-mem 100
[ ! -e "$work/run/latest" ] || { echo "FAIL: a failed run left a checkpoint"; failures=$((failures + 1)); }

expect_failure missing-model-dir "config.json|no such|cannot" "$spindle" info --model "$work/nowhere"

# spindle plan: bad requests fail naming the option; a good one prints a pick; nothing fitting exits 1 saying why.
configs="$here/../configs"
expect_failure plan-zero-length "seq-len.*at least 2" "$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len 0
expect_failure plan-word-length "seq-len.*'long'" "$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len long
expect_failure plan-no-config "$work/none.json" "$spindle" plan --model "$work/none.json" --seq-len 4096
expect_failure plan-zero-gpus "gpus must be at least 1" "$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len 4096 --gpus 0
expect_failure plan-negative-memory "gpu-mem takes a positive size" "$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len 4096 --gpu-mem -1
expect_failure plan-nothing-fits "pick: none fits.*|does not fit: device" "$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len 65536 --gpu-mem 8
if output=$("$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len 4k 2>&1) && grep -q "^pick: keep " <<<"$output"; then
  echo "ok   plan-pick: $(grep '^pick:' <<<"$output")"
else
  echo "FAIL plan-pick: $output"; failures=$((failures + 1))
fi

if output=$("$spindle" plan --model "$configs/glm53-flash-1b.json" --seq-len 32k --gpu-mem 32 2>&1) &&
  grep -qE "^(pick|runs today): offload \+ host AdamW " <<<"$output" &&
  grep -q "^first step: also pins the 11.2 GiB pool" <<<"$output"; then
  echo "ok   plan-offload-pins: $(grep '^first step:' <<<"$output")"
else
  echo "FAIL plan-offload-pins: $output"; failures=$((failures + 1))
fi

# spindle route: one token source, lengths in range; a good run prints the table and writes the JSON.
expect_failure route-no-tokens "exactly one of --tokens FILE and --random-tokens" "$spindle" route --model "$work/model"
expect_failure route-both-sources "exactly one of" "$spindle" route --model "$work/model" --tokens "$work/tokens.txt" --random-tokens --length 8
expect_failure route-random-no-length "random-tokens needs --length" "$spindle" route --model "$work/model" --random-tokens
expect_failure route-length-too-long "length must be in \\[2, 8\\]" "$spindle" route --model "$work/model" --tokens "$work/tokens.txt" --length 9
expect_failure route-negative-chunk "chunk must be" "$spindle" route --model "$work/model" --tokens "$work/tokens.txt" --chunk -1
expect_failure route-token-out-of-range "token id 99.*vocabulary" "$spindle" route --model "$work/model" --tokens "$work/big.txt"
expect_failure bench-bad-policy "policy must be keep, recompute or offload" "$spindle" bench --model "$here/configs/tiny.json" --seq-len 8 --policy stream
expect_failure bench-policy-and-chunk "exclude each other" "$spindle" bench --model "$here/configs/tiny.json" --seq-len 8 --policy offload --chunk 4
expect_failure bench-negative-gpu-mem "gpu-mem takes a size in GiB" "$spindle" bench --model "$here/configs/tiny.json" --seq-len 8 --gpu-mem -1
# bench checks its tokens before it initialises a model or looks for a GPU.
expect_failure bench-tokens-too-short "has 8 tokens, --seq-len 9 needs more" "$spindle" bench --model "$here/configs/tiny.json" --tokens "$work/tokens.txt" --seq-len 9
expect_failure bench-fasta-too-short "longer than every sequence" "$spindle" bench --model "$here/configs/tiny.json" --tokens "$here/data/chr22_256.fa" --seq-len 300
if output=$("$spindle" route --model "$work/model" --random-tokens --length 64 --chunk 16 --out "$work/route.json" 2>&1) &&
  grep -q "^per-expert buffer: " <<<"$output" && python3 -c "import json,sys; assert json.load(open(sys.argv[1]))['layers']" "$work/route.json"; then
  echo "ok   route: $(grep '^per-expert buffer:' <<<"$output")"
else
  echo "FAIL route: $output"; failures=$((failures + 1))
fi

# spindle select: the same token sources as route; a good run prints a row per DSA layer.
expect_failure select-no-tokens "exactly one of --tokens FILE and --random-tokens" "$spindle" select --model "$work/model"
expect_failure select-length-too-long "length must be in \\[2, 8\\]" "$spindle" select --model "$work/model" --tokens "$work/tokens.txt" --length 9
expect_failure select-bad-device "device must be cpu or cuda, got 'gpu'" "$spindle" select --model "$work/model" --random-tokens --length 20 --device gpu
expect_failure select-dtype-on-gpu "dtype applies to the CPU forward" "$spindle" select --model "$work/model" --random-tokens --length 20 --device cuda --dtype f64
expect_failure select-fasta-no-length "is a sequence file: give --length" "$spindle" select --model "$work/model" --tokens "$here/data/chr22_256.fa"
expect_failure select-negative-chunk "chunk must be" "$spindle" select --model "$work/model" --tokens "$work/tokens.txt" --chunk -1
if output=$("$spindle" select --model "$work/model" --random-tokens --length 200 --chunk 64 --out "$work/select.json" 2>&1) &&
  grep -q "^layer  queries" <<<"$output" && python3 -c "import json,sys; l = json.load(open(sys.argv[1]))['layers']; assert l and all(0 <= x['pair_shared'] <= 1 for x in l)" "$work/select.json"; then
  echo "ok   select: $(grep -A1 '^layer  queries' <<<"$output" | tail -1)"
else
  echo "FAIL select: $output"; failures=$((failures + 1))
fi
if output=$("$spindle" select --model "$work/model" --tokens "$here/data/chr22_256.fa" --length 200 --chunk 64 2>&1) &&
  grep -q "chr22_256.fa (an N-free window)" <<<"$output" && grep -q "^layer  queries" <<<"$output"; then
  echo "ok   select on a FASTA window: $(grep -A1 '^layer  queries' <<<"$output" | tail -1)"
else
  echo "FAIL select on a FASTA window: $output"; failures=$((failures + 1))
fi
# A dead indexer (its queries zeroed: every score 0, every query takes the lowest pools) is named;
# the healthy one above is not.
cp -r "$work/model" "$work/dead"
python3 - "$work/dead/model.safetensors" <<'PY'
import json, struct, sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
size = struct.unpack("<Q", data[:8])[0]
for name, info in json.loads(data[8:8 + size]).items():
    if name.endswith("indexer.wq_b.weight"):
        begin, end = info["data_offsets"]
        data[8 + size + begin:8 + size + end] = bytes(end - begin)
open(path, "wb").write(data)
PY
if output=$("$spindle" select --model "$work/dead" --random-tokens --length 200 --chunk 64 2>&1) &&
  grep -q "ties every score" <<<"$output" &&
  ! "$spindle" select --model "$work/model" --random-tokens --length 200 --chunk 64 2>&1 | grep -q "^warning"; then
  echo "ok   select names a dead indexer: $(grep -m1 '^warning' <<<"$output")"
else
  echo "FAIL select on a dead indexer: $output"; failures=$((failures + 1))
fi
# Training it says so too (every relu closed: the KL cannot revive it); training the healthy model
# does not.
printf '[model]\ndir = "%s"\n[data]\ntrain = "%s"\n[train]\nseq_len = 64\nsteps = 2\n[checkpoint]\ndir = "%s"\n' \
  "$work/dead" "$here/data/chr22_256.fa" "$work/dead_run" > "$work/dead.toml"
sed -e "s#$work/dead\"#$work/model\"#" -e "s#dead_run#healthy_run#" "$work/dead.toml" > "$work/healthy.toml"
if output=$("$spindle" train --config "$work/dead.toml" 2>&1) && grep -q "dead indexers" <<<"$output" &&
  grep -q '"indexer_closed":1' "$work/dead_run/metrics.jsonl" &&
  healthy=$("$spindle" train --config "$work/healthy.toml" 2>&1) && ! grep -q "dead indexers" <<<"$healthy"; then
  echo "ok   train names dead indexers: $(grep -m1 'dead indexers' <<<"$output" | head -c 160)"
else
  echo "FAIL train on a dead indexer: $output ${healthy:-}"; failures=$((failures + 1))
fi

if [ $failures -ne 0 ]; then echo "$failures bad-input case(s) failed"; exit 1; fi
echo "all bad-input cases fail cleanly"
