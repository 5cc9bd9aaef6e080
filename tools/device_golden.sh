#!/usr/bin/env bash
# One device call: regenerate the golden cases with transformers and check that transformers
# loads what Spindle saves. Expects build/spindle (carried) and $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 tools/make_golden.py --out "$OUT/golden" 2>&1 | grep -v -i warn | tee "$OUT/golden.log"
python3 tools/check_transformers_load.py build/spindle tests/configs/tiny.json "$(mktemp -d)" 2>&1 | tee "$OUT/load.log"
tar czf "$OUT/golden.tgz" -C "$OUT" golden && rm -rf "$OUT/golden"
