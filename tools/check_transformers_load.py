#!/usr/bin/env python3
"""Checks that transformers loads a checkpoint Spindle saves, and that both compute the same
log-probs from it. Runs on the GPU machine (transformers 5.17 with glm5_next; no GPU needed).

    python3 tools/check_transformers_load.py SPINDLE CONFIG.json WORKDIR
"""
import os
import subprocess
import sys

import torch
from transformers import Glm5NextForConditionalGeneration


def main():
    spindle, config, work = sys.argv[1:4]
    model_dir = os.path.join(work, "spindle_init")
    subprocess.run([spindle, "init", "--config", config, "--out", model_dir, "--seed", "11"], check=True)
    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    text_missing = [k for k in info["missing_keys"] if "visual" not in k]
    print("missing (text):", text_missing)
    print("missing (vision, expected: Spindle saves no vision tower):", len(info["missing_keys"]) - len(text_missing))
    print("unexpected:", info["unexpected_keys"])
    print("mismatched:", info["mismatched_keys"])
    vocab = model.config.text_config.vocab_size
    tokens = torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(5))
    token_file = os.path.join(work, "tokens.txt")
    with open(token_file, "w") as f:
        f.write(" ".join(map(str, tokens.tolist())))
    with torch.no_grad():
        logits = model(input_ids=tokens[None]).logits[0].double()
    ref = torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None]).squeeze(1)
    out = os.path.join(work, "spindle_lp.txt")
    subprocess.run([spindle, "logprobs", "--model", model_dir, "--tokens", token_file, "--dtype", "f64", "--out", out],
                   check=True)
    got = torch.tensor([float(x) for x in open(out).read().split()], dtype=torch.float64)
    diff = (got - ref).abs()
    print(f"spindle vs transformers on a Spindle-saved checkpoint: mean |diff| {diff.mean():.3e}, max {diff.max():.3e}")
    ok = not text_missing and not info["unexpected_keys"] and not info["mismatched_keys"] and diff.max() < 1e-4
    print("LOAD CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
