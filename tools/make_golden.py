#!/usr/bin/env python3
"""Golden cases for Spindle from transformers' glm5_next (the reference implementation).

Runs on the GPU machine, whose python3 has transformers 5.17 with glm5_next; it needs no GPU.
For each case it builds a small random model in float64 with every parameter moved off its
neutral initial value, and writes into tests/golden/<case>/:
  config.json, model.safetensors   the model as transformers' save_pretrained writes it
  tokens.txt                       the token ids
  logprobs.txt                     log p(token_i | tokens before i), i >= 1, from the float64 model
  grads.safetensors                gradient of the mean next-token loss, on-disk names, float64
  meta.json                        versions, seed, loss, and transformers' own float32-vs-float64 gap

A case is accepted only if no discrete choice sits on a tie: at every indexer top-k boundary and
every MoE routing boundary the last chosen and the first rejected candidate differ by more than
rounding (transformers scores both in float32, and breaks exact ties in an unspecified order), and
transformers' float32 and float64 runs make the same choices. Otherwise the next seed is tried.

    python3 tools/make_golden.py --out tests/golden [--case NAME]
"""
import argparse
import json
import os
import shutil

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next import modeling_glm5_next as M

VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
              projection_intermediate_size=16)

BASE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24,
    qk_nope_head_dim=16, v_head_dim=16, index_head_dim=8, index_n_heads=16,
    linear_head_dim=8, linear_num_heads=2, n_routed_experts=6, num_experts_per_tok=2,
    pad_token_id=0, initializer_range=0.1,
)

CASES = {
    # Every layer kind, default 3:1 schedule, selection far shorter than the sequence, a tail
    # (203 is not a multiple of index_kpool), safe-bound gate.
    "hybrid": dict(BASE, num_hidden_layers=8, index_kpool=4, index_topk=16, seq_len=203),
    # Two consecutive DSA layers, the second sharing the first's selection; grouped routing;
    # clamps that bite; the softplus gate (no lower bound).
    "shared_grouped_clamped": dict(
        BASE, num_hidden_layers=6, index_kpool=8, index_topk=32, seq_len=301,
        layer_types=["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                     "linear_attention", "deepseek_sparse_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
        index_topk_pattern="FFSFFF", n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, swiglu_limit=0.3, linear_lower_bound=None),
    # Longer sequence, 16-token pools, tied embeddings, unnormalised routing weights.
    "long_tied": dict(
        BASE, num_hidden_layers=4, index_kpool=16, index_topk=64, seq_len=1000,
        tie_word_embeddings=True, norm_topk_prob=False, routed_scaling_factor=1.5,
        rms_norm_eps=1e-6, hc_sinkhorn_iters=7),
}


def perturb(model, generator):
    """Moves every parameter and the router bias off the value its init leaves it at."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "visual" in name or not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)
            if name.endswith(("layernorm.weight", "norm.weight", "o_norm.weight")):
                p.add_(0.2 * noise)                      # ones -> 1 + noise
            elif name.endswith(("k_norm.bias", ".base", "index_kpool_compress_ape")):
                p.add_(0.3 * noise)                      # zeros -> noise
            elif name.endswith(".scale"):
                p.add_(0.3 * noise)                      # mHC scales: ones -> 1 + noise
            elif name.endswith("index_kpool_compress_gate"):
                p.add_(0.5 * noise)                      # ones -> 1 + noise
            elif name.endswith("e_score_correction_bias"):
                p.add_(0.05 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                p.add_(0.5 * noise)
            elif name.endswith(".fn"):
                p.add_(0.1 * noise)                      # larger mixing than 0.02
            else:
                p.add_(0.02 * noise)                     # random matrices: nudge too


def on_disk_grads(model, config):
    """Gradients keyed by the names save_pretrained writes (the reverse of the load conversion)."""
    out = {}
    tc = config.text_config
    for name, p in model.named_parameters():
        if "visual" in name or p.grad is None:
            continue
        g = p.grad.detach().to(torch.float64).contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = tc.moe_intermediate_size
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = g[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = g[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e].contiguous()
        elif name.endswith("self_attn.conv1d.weight"):
            base = name[: -len("conv1d.weight")]
            for i, part in enumerate(torch.chunk(g, 3, dim=0)):
                out[f"{base}{'qkv'[i]}_conv1d.weight"] = part.contiguous()
        else:
            for hc in ("attn", "ffn"):
                for field in ("fn", "base", "scale"):
                    name = name.replace(f".{hc}_hc.{field}", f".hc_{hc}_{field}")
            name = name.replace("self_attn.forget_gate.", "self_attn.")
            out[name] = g
    return out


def discrete_choices(model, input_ids):
    """Runs the model and records every indexer selection and every routing decision as sets."""
    records = []

    def indexer_hook(_module, _inputs, output):
        records.append(("indexer", [sorted(set(row.tolist()) - {-1}) for row in output[0]]))

    def router_hook(_module, _inputs, output):
        records.append(("router", [sorted(row.tolist()) for row in output[2]]))

    hooks = [m.register_forward_hook(indexer_hook) for m in model.modules() if isinstance(m, M.Glm5NextTextIndexer)]
    hooks += [m.register_forward_hook(router_hook) for m in model.modules() if isinstance(m, M.Glm5NextTextTopkRouter)]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0]
    for h in hooks:
        h.remove()
    return records, logits


def indexer_gap(module, kwargs):
    """Smallest relative gap between the last chosen and first rejected pool score of any query."""
    h, q_resid, mask = kwargs["hidden_states"], kwargs["q_resid"], kwargs["attention_mask"]
    batch, seq = h.shape[:2]
    q = module.wq_b(q_resid).view(batch, seq, -1, module.head_dim)
    k = module.k_norm(module.wk(h))
    gate = F.linear(h, module.index_kpool_compress_gate)
    packed = torch.cat([k, gate, mask.to(k.dtype)[..., None]], dim=-1)
    pool_keys, pool_indices, _ = module.get_pooled_states(packed)
    scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale)
    weights = module.weights_proj(h.to(module.weights_proj.weight.dtype)).float() * (module.n_heads ** -0.5)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]          # [seq, pools]
    pool_end = pool_indices[0, :, -1]
    visible = (pool_end[None, :] <= torch.arange(seq)[:, None]) & (pool_end[None, :] >= 0)
    select = min(module.index_topk // module.index_kpool, index.shape[-1])
    ranked = index.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
    rows = visible.sum(-1) > select
    if select == 0 or not rows.any():
        return float("inf")
    a, b = ranked[rows, select - 1].double(), ranked[rows, select].double()
    return float(((a - b) / torch.maximum(a.abs().maximum(b.abs()), torch.tensor(1e-3))).min())


def router_gap(module, args):
    """Smallest gap at the group and expert boundaries of the routing."""
    h = args[0].reshape(-1, module.hidden_dim)
    scores = F.linear(h.float(), module.weight.float()).sigmoid()
    choice = (scores + module.e_score_correction_bias).double()
    groups = choice.view(-1, module.num_group, module.num_experts // module.num_group)
    group_scores = groups.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
    gaps = []
    if module.topk_group < module.num_group:
        gaps.append((group_scores[:, module.topk_group - 1] - group_scores[:, module.topk_group]).min())
    keep = groups.topk(2, dim=-1).values.sum(-1).topk(module.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    masked = choice.masked_fill(~mask.repeat_interleave(module.num_experts // module.num_group, 1), float("-inf"))
    ranked = masked.sort(dim=-1, descending=True).values
    if module.top_k < ranked.shape[-1] and torch.isfinite(ranked[:, module.top_k]).any():
        finite = torch.isfinite(ranked[:, module.top_k])
        gaps.append((ranked[finite, module.top_k - 1] - ranked[finite, module.top_k]).min())
    return float(min(gaps)) if gaps else float("inf")


def boundary_gaps(model, input_ids):
    """Runs the model once and returns the smallest indexer and router boundary gaps."""
    gaps = {"indexer": float("inf"), "router": float("inf")}

    def on_indexer(module, _args, kwargs, _output):
        gaps["indexer"] = min(gaps["indexer"], indexer_gap(module, kwargs))

    def on_router(module, args, _output):
        gaps["router"] = min(gaps["router"], router_gap(module, args))

    hooks = [m.register_forward_hook(on_indexer, with_kwargs=True)
             for m in model.modules() if isinstance(m, M.Glm5NextTextIndexer)]
    hooks += [m.register_forward_hook(on_router) for m in model.modules() if isinstance(m, M.Glm5NextTextTopkRouter)]
    with torch.no_grad():
        model(input_ids=input_ids)
    for h in hooks:
        h.remove()
    return gaps


def next_token_log_probs(logits, tokens):
    lp = torch.log_softmax(logits[:-1].to(torch.float64), dim=-1)
    return lp.gather(1, tokens[1:, None]).squeeze(1)


def build(name, spec, seed):
    spec = dict(spec)
    seq_len = spec.pop("seq_len")
    config = Glm5NextConfig(text_config=spec, vision_config=VISION,
                            tie_word_embeddings=spec.get("tie_word_embeddings", False))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float64)
    model.eval()
    perturb(model, torch.Generator().manual_seed(seed + 1))
    tokens = torch.randint(0, spec["vocab_size"], (seq_len,), generator=torch.Generator().manual_seed(seed + 2))
    return config, model, tokens


def make_case(name, spec, out_dir, first_seed):
    for seed in range(first_seed, first_seed + 20):
        config, model, tokens = build(name, spec, seed)
        choices64, logits64 = discrete_choices(model, tokens[None])
        model32 = Glm5NextForConditionalGeneration._from_config(
            config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
        model32.load_state_dict({k: v.to(torch.float32) for k, v in model.state_dict().items()})
        model32.eval()
        choices32, logits32 = discrete_choices(model32, tokens[None])
        gaps = boundary_gaps(model, tokens[None])
        if choices32 != choices64 or gaps["indexer"] < 1e-5 or gaps["router"] < 1e-6:
            print(f"{name}: seed {seed} has a (near-)tie in a discrete choice {gaps}; next seed")
            continue
        lp64 = next_token_log_probs(logits64, tokens)
        lp32 = next_token_log_probs(logits32, tokens)

        model.zero_grad()
        logits = model(input_ids=tokens[None]).logits[0]
        loss = -next_token_log_probs(logits, tokens).mean()
        loss.backward()
        grads = on_disk_grads(model, config)

        case_dir = os.path.join(out_dir, name)
        shutil.rmtree(case_dir, ignore_errors=True)
        model.save_pretrained(case_dir)
        save_file(grads, os.path.join(case_dir, "grads.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(case_dir, "tokens.txt"), "w") as f:
            f.write(" ".join(str(t) for t in tokens.tolist()) + "\n")
        with open(os.path.join(case_dir, "logprobs.txt"), "w") as f:
            f.writelines(f"{v:.17g}\n" for v in lp64.tolist())
        n_select = sum(len(rows) for kind, rows in choices64 if kind == "indexer")
        meta = dict(
            transformers=transformers.__version__, torch=torch.__version__, seed=seed, seq_len=len(tokens),
            loss=float(loss), indexer_layers_run=sum(kind == "indexer" for kind, _ in choices64),
            router_layers_run=sum(kind == "router" for kind, _ in choices64), selections_checked=n_select,
            transformers_f32_vs_f64_logprob_max_abs_diff=float((lp32.double() - lp64).abs().max()),
            transformers_f32_vs_f64_logprob_mean_abs_diff=float((lp32.double() - lp64).abs().mean()),
            smallest_indexer_boundary_gap_relative=gaps["indexer"], smallest_router_boundary_gap=gaps["router"],
        )
        with open(os.path.join(case_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        print(f"{name}: seed {seed}, loss {float(loss):.6f}, {len(grads)} gradient tensors, "
              f"f32-vs-f64 max {meta['transformers_f32_vs_f64_logprob_max_abs_diff']:.2e}")
        return
    raise SystemExit(f"{name}: no seed without ties in 20 tries")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/golden")
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    for name in args.case or sorted(CASES):
        make_case(name, CASES[name], args.out, args.seed)


if __name__ == "__main__":
    main()
