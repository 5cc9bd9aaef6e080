#!/usr/bin/env python3
"""How far transformers' own bf16 log-probs are from its fp32 ones on the golden cases: the
yardstick for Spindle's bf16 path. Runs on the GPU machine (transformers 5.17 with glm5_next).

    python3 tools/transformers_bf16_drift.py tests/golden/*
"""
import sys

import torch
from transformers import Glm5NextForConditionalGeneration


def log_probs(case_dir, dtype, device):
    model = Glm5NextForConditionalGeneration.from_pretrained(
        case_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager").to(device).eval()
    tokens = torch.tensor([int(x) for x in open(f"{case_dir}/tokens.txt").read().split()], device=device)
    with torch.no_grad():
        logits = model(input_ids=tokens[None]).logits[0].double()
    return torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None]).squeeze(1).cpu()


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for case_dir in sys.argv[1:]:
        reference = log_probs(case_dir, torch.float32, device)
        bf16 = log_probs(case_dir, torch.bfloat16, device)
        diff = (bf16 - reference).abs()
        print(f"{case_dir}: transformers bf16 vs fp32 on {device}: mean |diff| {diff.mean():.3e}, "
              f"max {diff.max():.3e} over {diff.numel()} positions")


if __name__ == "__main__":
    main()
