#!/usr/bin/env python3
"""The peer: transformers' glm5_next trained on the same config and sequence lengths as Spindle.

Runs on the GPU machine (transformers 5.17, torch 2.11). For each length: build the model in
bf16 on the GPU from a Spindle config.json (random init), take tokens (a whitespace token file,
e.g. real DNA; random ids only with --random-tokens), and time forward + backward + AdamW steps
after warm-up with CUDA events. Reports tokens/s, step time and peak GPU memory as JSON lines;
a length that does not fit is reported as OOM, not skipped.

    python3 bench/transformers_peer.py --config configs/glm53-flash-1b.json \\
        --seq-lens 4096 16384 65536 --tokens dna.txt --steps 3 --out peer.jsonl
"""
import argparse
import json
import sys
import time

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
              projection_intermediate_size=16)


def build(config_path, attn):
    text = json.load(open(config_path))
    text.pop("model_type", None)
    config = Glm5NextConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=text["hidden_size"]))
    model = Glm5NextForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    return model.cuda().train()


def tokens_for(args, length, vocab):
    if args.random_tokens:
        return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    ids = [int(x) for x in open(args.tokens).read().split()]
    if len(ids) < length:
        raise SystemExit(f"--tokens {args.tokens} has {len(ids)} ids, {length} needed")
    return torch.tensor(ids[:length]).view(1, length)


def measure(model, optimizer, input_ids, steps, warmup):
    def step():
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2], float(loss)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--seq-lens", type=int, nargs="+", required=True)
    p.add_argument("--tokens")
    p.add_argument("--random-tokens", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--out")
    args = p.parse_args()
    if not args.tokens and not args.random_tokens:
        raise SystemExit("give --tokens FILE (real data) or --random-tokens")
    out = open(args.out, "a") if args.out else None
    for length in args.seq_lens:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = dict(system="transformers", seq_len=length, config=args.config,
                   tokens="random" if args.random_tokens else args.tokens, attn=args.attn,
                   gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        started = time.time()
        try:
            model = build(args.config, args.attn)
            row["parameters"] = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            input_ids = tokens_for(args, length, model.config.text_config.vocab_size).cuda()
            seconds, loss = measure(model, optimizer, input_ids, args.steps, args.warmup)
            row.update(status="ok", step_seconds=seconds, tokens_per_second=length / seconds, loss=loss)
        except torch.OutOfMemoryError as e:
            row.update(status="OOM", error=str(e).splitlines()[0][:200])
        except Exception as e:  # noqa: BLE001 - the table reports what stopped the peer
            row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["wall_seconds"] = time.time() - started
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
        model = optimizer = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
