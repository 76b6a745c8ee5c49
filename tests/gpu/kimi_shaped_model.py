"""A seeded random checkpoint with Kimi-K2.5's shapes where the all-reduces see them, and an EAGLE-3 draft for it.

    python -m tests.gpu.kimi_shaped_model OUT_DIR [--layers 5] [--seed 0]

writes OUT_DIR/target (DeepseekV3ForCausalLM) and OUT_DIR/draft (LlamaForCausalLMEagle3), each a config.json,
one model.safetensors and a word-level tokenizer (the same for both), and returns nothing else.

Why random and not `--load-format dummy`: dummy seeds every parameter alike, so both TP ranks would hold
identical shards and an all-reduce that returned twice the local value, or one rank's value, would pass. Here
every tensor is drawn from one seeded generator in name order (normal, std 0.02; norms ones; the expert score
bias zeros), so the two ranks' shards differ and the sums matter.

What is Kimi-K2.5 (its DeepSeek-V3 body) and what is smaller:
- as Kimi-K2.5: hidden 7168; MLA with 64 heads, q LoRA rank 1536, KV LoRA rank 512, nope/rope/v head dims
  128/64/128; sigmoid scoring with `noaux_tc` top-k, one expert group, a shared expert, the first layer dense;
  bf16. The all-reduces therefore move `[tokens, 7168]` bf16 exactly as on the user's box, and the fused
  all-reduce + residual + RMSNorm meets the same hidden size and eps.
- smaller: 5 layers; 6 routed experts (not a power of two: FlashInfer's `fused_topk_deepseek` is taken only for
  power-of-two counts, and FlashInfer is stood in) with 2 per token; dense/expert intermediate sizes
  2048/512; a 1024-word vocabulary; no RoPE scaling (yarn changes no collective).
- the draft: one Llama layer of hidden 7168 (56 heads of 128, 8 KV heads), taking the target's hidden states
  captured before layers 2, 3 and 4 (`eagle_aux_hidden_state_layer_ids` [1, 2, 3]; SGLang shifts ids starting at
  1 by one), its own 1024-word head.
"""

from __future__ import annotations

import argparse
import json
import os

HIDDEN = 7168
VOCAB = 1024
HEADS = 64
Q_LORA, KV_LORA = 1536, 512
NOPE, ROPE, V_HEAD = 128, 64, 128
DENSE_INTERMEDIATE, EXPERT_INTERMEDIATE = 2048, 512
EXPERTS, EXPERTS_PER_TOKEN = 6, 2
DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, DRAFT_INTERMEDIATE = 56, 8, 128, 4096
EAGLE_LAYER_IDS = [1, 2, 3]
EPS = 1e-6
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]


def target_config(layers: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_HEAD,
        "intermediate_size": DENSE_INTERMEDIATE, "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": EPS,
        "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3,
    }


def draft_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "hidden_size": HIDDEN, "target_hidden_size": HIDDEN,
        "num_hidden_layers": 1, "num_attention_heads": DRAFT_HEADS, "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM, "intermediate_size": DRAFT_INTERMEDIATE, "hidden_act": "silu",
        "rms_norm_eps": EPS, "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE_LAYER_IDS, "use_aux_hidden_state": True},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3,
    }


def target_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, as in the Hugging Face DeepSeek-V3 checkpoints SGLang loads."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN),
                                          "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_a_proj.weight": (Q_LORA, HIDDEN), p + "self_attn.q_a_layernorm.weight": (Q_LORA,),
            p + "self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
            p + "self_attn.kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, HIDDEN),
            p + "self_attn.kv_a_layernorm.weight": (KV_LORA,),
            p + "self_attn.kv_b_proj.weight": (HEADS * (NOPE + V_HEAD), KV_LORA),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * V_HEAD),
        })
        if i == 0:  # first_k_dense_replace = 1
            shapes.update({p + "mlp.gate_proj.weight": (DENSE_INTERMEDIATE, HIDDEN),
                           p + "mlp.up_proj.weight": (DENSE_INTERMEDIATE, HIDDEN),
                           p + "mlp.down_proj.weight": (HIDDEN, DENSE_INTERMEDIATE)})
            continue
        shapes.update({p + "mlp.gate.weight": (EXPERTS, HIDDEN), p + "mlp.gate.e_score_correction_bias": (EXPERTS,),
                       p + "mlp.shared_experts.gate_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
                       p + "mlp.shared_experts.up_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
                       p + "mlp.shared_experts.down_proj.weight": (HIDDEN, EXPERT_INTERMEDIATE)})
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
                           q + "up_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
                           q + "down_proj.weight": (HIDDEN, EXPERT_INTERMEDIATE)})
    return shapes


def draft_shapes() -> dict[str, tuple[int, ...]]:
    """As the published EAGLE-3 drafts name them (`midlayer.*`, top-level `fc`, `norm`, `lm_head`)."""
    q, kv = DRAFT_HEADS * DRAFT_HEAD_DIM, DRAFT_KV_HEADS * DRAFT_HEAD_DIM
    return {
        "fc.weight": (HIDDEN, HIDDEN * len(EAGLE_LAYER_IDS)),
        "midlayer.hidden_norm.weight": (HIDDEN,), "midlayer.input_layernorm.weight": (HIDDEN,),
        "midlayer.post_attention_layernorm.weight": (HIDDEN,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * HIDDEN), "midlayer.self_attn.k_proj.weight": (kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * HIDDEN), "midlayer.self_attn.o_proj.weight": (HIDDEN, q),
        "midlayer.mlp.gate_proj.weight": (DRAFT_INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": (DRAFT_INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, DRAFT_INTERMEDIATE),
        "norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN),
    }


def tensor_kind(name: str) -> str:
    if name.endswith("e_score_correction_bias"):
        return "zeros"
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return "ones"
    return "normal"


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, device: str = "cpu") -> dict:
    """One generator, names in sorted order: the same seed gives the same checkpoint bits on any machine with
    the same torch. The expert score bias is fp32, as in the released checkpoints; everything else bf16."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        kind, shape = tensor_kind(name), shapes[name]
        if kind == "zeros":
            out[name] = torch.zeros(shape, dtype=torch.float32)
        elif kind == "ones":
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            out[name] = t.to(torch.bfloat16).cpu()
    return out


def words() -> list[str]:
    return SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]


def write_tokenizer(folder: str) -> None:
    """A word-level tokenizer over `w0 ... w1019` (whitespace split), built with the `tokenizers` library, so
    nothing is downloaded; token ids equal vocabulary positions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 4096, "add_bos_token": False,
              "clean_up_tokenization_spaces": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, f, indent=1)


def write_model(folder: str, config: dict, shapes: dict, seed: int, device: str) -> int:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, f, indent=1)
    tensors = random_tensors(shapes, seed, device)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write(out: str, layers: int = 5, seed: int = 0, device: str = "cpu") -> dict:
    """Both checkpoints; returns their folders and sizes in bytes. Seeds differ between target and draft."""
    target, draft = os.path.join(out, "target"), os.path.join(out, "draft")
    return {"target": target, "target_bytes": write_model(target, target_config(layers), target_shapes(layers),
                                                          seed, device),
            "draft": draft, "draft_bytes": write_model(draft, draft_config(), draft_shapes(), seed + 1, device)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is faster)")
    a = p.parse_args(argv)
    print(json.dumps(write(a.out, a.layers, a.seed, a.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
