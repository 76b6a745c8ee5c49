"""A seeded random Kimi-K2.5 checkpoint (`KimiK25ForConditionalGeneration`) and its EAGLE-3 draft, small enough to
write in seconds and to serve with TP=2 on one GPU.

    python -m tests.gpu.kimi_shaped_model OUT_DIR [--layers 9] [--seed 0] [--device cuda]

writes OUT_DIR/target and OUT_DIR/draft, each a config.json, one model.safetensors and a word-level tokenizer (the
same for both), and prints one JSON line: the folders, their sizes, and the model's structure (layers, dense
layers, capture layers) that benchmarks/workloads/verify_pattern.verify_counts turns into the all-reduce counts.

Why random and not `--load-format dummy`: dummy seeds every parameter alike, so both TP ranks would hold
identical shards and an all-reduce that returned twice the local value, or one rank's value, would pass. Here
every tensor is drawn from one seeded generator in name order (normal, std 0.02; norms ones; the expert score
bias zeros), so the two ranks' shards differ and the sums matter.

As Kimi-K2.5 (the class, and its DeepSeek-V3 text body, where the all-reduces and the fused norm see it):
- the wrapper class with a `text_config` (DeepseekV3ForCausalLM, prefix-free names under `language_model.`, as
  Kimi's checkpoint has them) and a `vision_config`, so SGLang serves it as the multimodal model it is: the
  embedding all-reduce runs in `general_mm_embed_routine`, the captures are set through the wrapper, and SGLang
  itself turns piecewise CUDA graphs off for it;
- hidden 7168; MLA with 64 heads, q LoRA rank 1536, KV LoRA rank 512, nope/rope/v head dims 128/64/128; sigmoid
  scoring with `noaux_tc` top-8 of one expert group; one shared expert; the first layer dense; bf16;
- the EAGLE-3 captures as Kimi's draft configures them, scaled to the layer count: the draft names the layers
  whose output it reads, [1, N//2 - 1, N - 4] (the form trained EAGLE-3 drafts write; [1, 29, 57] at 61
  layers), which SGLang moves up by one to capture before [2, N//2, N - 3], its own default: either form of
  the published draft's config gives Kimi's [2, 30, 58].
Smaller:
- 9 layers: the fewest with at least 4 MoE sums deferred into the next layer's fused norm on 0.5.13.post1
  (layers 1, 3, 5 feed the captures before 2, 4, 6 and keep their all-reduce; 2, 4, 6, 7 defer; 7 on 0.5.23);
- 12 routed experts, top-8 (not a power of two: FlashInfer's fused top-k, taken for power-of-two counts, is a
  stand-in here), expert and dense intermediate sizes 256 and 2048; a 32,768-word vocabulary shared by target
  and draft; no RoPE scaling (yarn changes no collective);
- routed experts in bf16, not Kimi's INT4 W4A16: sglang-kernel 0.4.3 has no Marlin op, and both releases build
  their Marlin MoE GEMM (`moe_wna16_marlin`, some 250 kernel instantiations in one translation unit) with nvcc
  on first use: 5 min 21 s for sm_90a on a 2-core machine, minutes of every release's first server start;
- the vision tower: one MoonViT layer of width 64 (2 heads of 32, RoPE 2D needs a multiple of 4), an 8 x 8
  position grid; it is built at start-up and never run (no request carries an image), and no vision weight is
  written: Kimi's `load_weights` loads those the checkpoint has and requires none;
- the processor: `--trust-remote-code` loads one from the checkpoint, as for Kimi (`processor_config.json`
  names `kimi_k25_processor.KimiK25Processor`, written here): the tokenizer and the media settings SGLang's
  Kimi-K2.5 image processor reads at start-up.
The draft: `LlamaForCausalLMEagle3` as published for Kimi-K2.5, one layer of hidden 7168 (56 heads of 128, 8 KV
heads), reading the three captures, with its own head over the shared vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os

HIDDEN = 7168
VOCAB = 32768
LAYERS = 9
FIRST_DENSE = 1
HEADS = 64
Q_LORA, KV_LORA = 1536, 512
NOPE, ROPE, V_HEAD = 128, 64, 128
DENSE_INTERMEDIATE, EXPERT_INTERMEDIATE = 2048, 256
EXPERTS, EXPERTS_PER_TOKEN = 12, 8
DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, DRAFT_INTERMEDIATE = 56, 8, 128, 4096
VISION_WIDTH, VISION_HEADS, VISION_GRID = 64, 2, 8
EPS = 1e-6
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|media_pad|>"]
PROCESSOR_MODULE = "kimi_k25_processor"
PREFIX = "language_model."


def eagle_layer_ids(layers: int) -> list[int]:
    """The draft's `eagle_aux_hidden_state_layer_ids`: the layers whose output it reads."""
    return [1, layers // 2 - 1, layers - 4]


def text_config(layers: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_HEAD,
        "intermediate_size": DENSE_INTERMEDIATE, "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "n_shared_experts": 1,
        "first_k_dense_replace": FIRST_DENSE, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": EPS,
        "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3,
    }


def vision_config() -> dict:
    """What SGLang's MoonViT3dPretrainedModel and K2VLMultiModalProjector read (configs/kimi_k25.py and
    models/kimi_k25.py of both releases), at the smallest sizes they build with."""
    return {
        "patch_size": 14, "init_pos_emb_height": VISION_GRID, "init_pos_emb_width": VISION_GRID,
        "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "num_attention_heads": VISION_HEADS,
        "num_hidden_layers": 1, "hidden_size": VISION_WIDTH, "intermediate_size": 2 * VISION_WIDTH,
        "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
        "vt_hidden_size": VISION_WIDTH, "text_hidden_size": HIDDEN,
    }


def target_config(layers: int) -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "torch_dtype": "bfloat16",
        "text_config": text_config(layers), "vision_config": vision_config(),
        "media_placeholder_token_id": SPECIAL.index("<|media_pad|>"), "pad_token_id": 3,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    }


def draft_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "hidden_size": HIDDEN, "target_hidden_size": HIDDEN,
        "num_hidden_layers": 1, "num_attention_heads": DRAFT_HEADS, "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM, "intermediate_size": DRAFT_INTERMEDIATE, "hidden_act": "silu",
        "rms_norm_eps": EPS, "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": eagle_layer_ids(layers), "use_aux_hidden_state": True},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3,
    }


def target_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, named as in Kimi-K2.5's checkpoint (SGLang strips `language_model.`)."""
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
        if i < FIRST_DENSE:
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
    return {PREFIX + name: shape for name, shape in shapes.items()}


def draft_shapes() -> dict[str, tuple[int, ...]]:
    """As the published EAGLE-3 drafts name them (`midlayer.*`, top-level `fc`, `norm`, `lm_head`)."""
    q, kv = DRAFT_HEADS * DRAFT_HEAD_DIM, DRAFT_KV_HEADS * DRAFT_HEAD_DIM
    return {
        "fc.weight": (HIDDEN, HIDDEN * 3),
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
    """A word-level tokenizer over `w0 ... w32762` (whitespace split), built with the `tokenizers` library, so
    nothing is downloaded; token ids equal vocabulary positions."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 4096, "add_bos_token": False,
              "clean_up_tokenization_spaces": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, f, indent=1)


PROCESSOR_SOURCE = '''"""The checkpoint's processor (written by the sglang-sm120 server test): the tokenizer and the
media settings SGLang's Kimi-K2.5 image processor reads when it starts. No request here carries an image."""

import json
import os
from types import SimpleNamespace

from transformers import AutoTokenizer


class KimiK25Processor:
    def __init__(self, tokenizer, media_proc_cfg):
        self.tokenizer = tokenizer
        self.image_processor = None
        self.media_processor = SimpleNamespace(media_proc_cfg=media_proc_cfg)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):
        """AutoProcessor registers a remote class after loading it; nothing is saved from here."""

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        with open(os.path.join(path, "processor_config.json")) as f:
            media = json.load(f)["media_proc_cfg"]
        return cls(AutoTokenizer.from_pretrained(path), media)
'''

MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def write_processor(folder: str) -> None:
    with open(os.path.join(folder, f"{PROCESSOR_MODULE}.py"), "w") as f:
        f.write(PROCESSOR_SOURCE)
    with open(os.path.join(folder, "processor_config.json"), "w") as f:
        json.dump({"auto_map": {"AutoProcessor": f"{PROCESSOR_MODULE}.KimiK25Processor"},
                   "media_proc_cfg": MEDIA_PROC_CFG}, f, indent=1)


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


def write(out: str, layers: int = LAYERS, seed: int = 0, device: str = "cpu") -> dict:
    """Both checkpoints; returns their folders, sizes in bytes and the structure the all-reduce counts follow.
    Seeds differ between target and draft."""
    target, draft = os.path.join(out, "target"), os.path.join(out, "draft")
    made = {"target": target, "target_bytes": write_model(target, target_config(layers), target_shapes(layers),
                                                          seed, device),
            "draft": draft, "draft_bytes": write_model(draft, draft_config(layers), draft_shapes(), seed + 1, device),
            "layers": layers, "first_k_dense": FIRST_DENSE, "eagle_layer_ids": eagle_layer_ids(layers)}
    write_processor(target)
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is faster)")
    a = p.parse_args(argv)
    print(json.dumps(write(a.out, a.layers, a.seed, a.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
