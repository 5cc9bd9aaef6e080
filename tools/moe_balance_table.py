#!/usr/bin/env python3
"""The table of docs/MOE_BALANCE.md from `spindle route --out` JSON files named
MODEL.TOKENS.cCHUNK.json (TOKENS: dna, heldout, acgt or random).

    python3 tools/moe_balance_table.py RUN_DIR/*.c4096.json

Besides what `spindle route` prints, it gives the expert-parallel view: the busiest GPU's rows
over its mean share in the worst chunk of the worst layer, the experts split over 2 or 4 GPUs in
contiguous blocks (src/plan/parallel.h assumes 4x for real text).
"""
import json
import os
import sys

TOKENS = {'dna': 'chr22, first 32k (bench)', 'heldout': 'chr22, held-out 32k', 'acgt': 'random A/C/G/T',
          'random': 'random ids [0, 16)'}


def busiest_gpu(chunks, experts, gpus):
    per = -(-experts // gpus)
    worst = 0.0
    for counts in chunks:
        shares = [sum(counts[g * per:(g + 1) * per]) for g in range(gpus)]
        worst = max(worst, max(shares) / (sum(counts) / gpus))
    return worst


def main(paths):
    print('| model | tokens | chunk | seq max/mean: mean / worst layer | seq CV (mean) | idle experts (mean) '
          '| worst chunk max/mean | buffer factor | busiest of 2 / 4 GPUs |')
    print('|---|---|---|---|---|---|---|---|---|')
    for path in paths:
        model, tokens = os.path.basename(path).split('.')[:2]
        r = json.load(open(path))
        layers, experts = r['layers'], r['routed_experts']
        n = len(layers)
        seq = [l['sequence']['max_over_mean'] for l in layers]
        cv = sum(l['sequence']['cv'] for l in layers) / n
        idle = sum(l['sequence']['idle_fraction'] for l in layers) / n
        chunk = max(l['worst_chunk']['max_over_mean'] for l in layers)
        gpus = [max(busiest_gpu(l['chunk_loads'], experts, g) for l in layers) for g in (2, 4)]
        print(f"| {model} | {TOKENS[tokens]} | {r['chunk_tokens']} | {sum(seq) / n:.2f} / {max(seq):.2f} "
              f"| {cv:.2f} | {idle:.2f} | {chunk:.2f} | {r['buffer_factor']:.2f} | {gpus[0]:.2f} / {gpus[1]:.2f} |")


if __name__ == '__main__':
    main(sys.argv[1:])
