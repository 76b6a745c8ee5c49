"""The communication pattern of one EAGLE-3 target-verify forward, as a pure function.

No torch import: this module is imported by CPU tests and by the GPU benchmark alike.

SGLang 0.5.13.post1 runs a DeepSeek-V3-style decoder (Kimi-K2.5) with tensor parallelism like this
(``models/deepseek_v2.py`` + ``layers/communicator.py``):

* the vocab-parallel embedding ends in one plain all-reduce;
* every layer's attention output (``o_proj``, ``reduce_results=False``) is all-reduced and fused with the
  following ``post_attention_layernorm`` (residual add + RMSNorm);
* every layer's MLP/MoE output is all-reduced; for layers 0..L-2 that all-reduce is deferred into the next
  layer's ``input_layernorm`` (fused); the last layer's is plain and followed by the final norm.

That is ``1 + L + L`` all-reduces (123 for L = 61), ``2L - 1`` of them fusable (121).

EAGLE-3 captures ``hidden_states + residual`` *before* each capture layer i. A deferred MoE all-reduce of
layer i-1 would leave an un-reduced partial there, so (as the overlay does) the MLP all-reduce of layer i-1
is NOT deferred for a capture layer i: it becomes a plain all-reduce, then the capture add, then a separate
add + RMSNorm. Kimi-K2.5 (capture layers 2, 30, 58) therefore has 118 fused and 5 plain all-reduces.

With ``fuse=False`` (what SGLang runs today on SM120: the fusion gate is off) every fused op is split into a
plain all-reduce followed by one fused add + RMSNorm kernel; the number of all-reduces does not change.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# Op kinds. The first two are communication; the rest run on every rank identically.
ALLREDUCE = "allreduce"  # plain all-reduce of the current partial
ALLREDUCE_ADD_RMSNORM = "allreduce_add_rmsnorm"  # all-reduce fused with residual add + RMSNorm
ADD_RMSNORM = "add_rmsnorm"  # separate residual add + RMSNorm (after a plain all-reduce)
RMSNORM = "rmsnorm"  # plain RMSNorm without residual (layer 0's input norm)
ATTENTION = "attention"  # attention compute producing a partial (per-rank shard)
MLP = "mlp"  # dense MLP or MoE compute producing a partial
AUX_CAPTURE = "aux_capture"  # EAGLE-3 hidden-state capture: hidden + residual before a capture layer

COMM_KINDS = frozenset({ALLREDUCE, ALLREDUCE_ADD_RMSNORM})
OP_KINDS = frozenset({ALLREDUCE, ALLREDUCE_ADD_RMSNORM, ADD_RMSNORM, RMSNORM, ATTENTION, MLP, AUX_CAPTURE})

EMBEDDING_LAYER = -1


@dataclass(frozen=True)
class ModelConfig:
    """The few model dimensions the verify benchmark needs."""

    name: str
    hidden_size: int
    num_layers: int
    first_k_dense: int  # layers [0, first_k_dense) use the dense MLP, the others MoE
    eagle3_capture_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    vocab_size: int = 0
    attention: Mapping[str, Any] = field(default_factory=dict)
    mlp: Mapping[str, Any] = field(default_factory=dict)
    moe: Mapping[str, Any] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.num_layers <= 0:
            raise ValueError(f"{self.name}: hidden_size and num_layers must be positive")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"{self.name}: first_k_dense must be in [0, num_layers]")
        if self.first_k_dense < self.num_layers and not self.moe:
            raise ValueError(f"{self.name}: MoE layers present but no 'moe' section")
        for layer in self.eagle3_capture_layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"{self.name}: capture layer {layer} out of range")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.hidden_size  # bf16

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "first_k_dense": self.first_k_dense,
            "eagle3_capture_layers": list(self.eagle3_capture_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "attention": dict(self.attention),
            "mlp": dict(self.mlp),
            "moe": dict(self.moe) if self.moe else None,
        }


def config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    return ModelConfig(
        name=str(d["name"]),
        hidden_size=int(d["hidden_size"]),
        num_layers=int(d["num_layers"]),
        first_k_dense=int(d.get("first_k_dense", d["num_layers"])),
        eagle3_capture_layers=tuple(int(x) for x in d.get("eagle3_capture_layers") or ()),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        vocab_size=int(d.get("vocab_size", 0)),
        attention=dict(d.get("attention") or {}),
        mlp=dict(d.get("mlp") or {}),
        moe=dict(d["moe"]) if d.get("moe") else None,
        description=str(d.get("description", "")),
    )


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(name_or_path: str) -> ModelConfig:
    """Load ``benchmarks/workloads/configs/<name>.json`` or a JSON file path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no model config {name_or_path!r}; available: {', '.join(available_configs())}")
    with open(path) as f:
        return config_from_dict(json.load(f))


@dataclass(frozen=True)
class Op:
    """One step of the verify forward.

    ``layer`` is the decoder layer whose compute produced the all-reduced partial (-1: embedding).
    ``norm`` / ``norm_layer`` name the RMSNorm that a fused or separate add+RMSNorm applies.
    """

    kind: str
    layer: int
    site: str = ""  # embedding | attn | mlp | moe (for MLP compute) | ""
    norm: str | None = None  # input_layernorm | post_attention_layernorm | final_norm
    norm_layer: int | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


def build_verify_pattern(cfg: ModelConfig, *, fuse: bool = True, eagle3_capture: bool = True) -> list[Op]:
    """Ordered ops of one verify forward.

    fuse: True for a backend with a fused all-reduce + add + RMSNorm (ours); False for NCCL as SGLang runs it
      on SM120 today (plain all-reduce, then one fused add+RMSNorm kernel).
    eagle3_capture: honour ``cfg.eagle3_capture_layers`` (aux hidden-state capture; no deferral into them).
    """
    L = cfg.num_layers
    capture = frozenset(cfg.eagle3_capture_layers) if eagle3_capture else frozenset()
    ops: list[Op] = [Op(ALLREDUCE, EMBEDDING_LAYER, "embedding")]
    for i in range(L):
        if i == 0:
            if 0 in capture:
                ops.append(Op(AUX_CAPTURE, 0))
            ops.append(Op(RMSNORM, 0, norm="input_layernorm", norm_layer=0))
        # (for i > 0 the input norm was emitted with the previous layer's MLP all-reduce)
        ops.append(Op(ATTENTION, i, "attn"))
        if fuse:
            ops.append(Op(ALLREDUCE_ADD_RMSNORM, i, "attn", "post_attention_layernorm", i))
        else:
            ops.append(Op(ALLREDUCE, i, "attn"))
            ops.append(Op(ADD_RMSNORM, i, "", "post_attention_layernorm", i))
        ops.append(Op(MLP, i, "moe" if cfg.is_moe_layer(i) else "dense"))
        if i == L - 1:
            ops.append(Op(ALLREDUCE, i, "mlp"))
            ops.append(Op(ADD_RMSNORM, i, "", "final_norm", L))
            continue
        nxt = i + 1
        if fuse and nxt not in capture:
            ops.append(Op(ALLREDUCE_ADD_RMSNORM, i, "mlp", "input_layernorm", nxt))
        else:
            ops.append(Op(ALLREDUCE, i, "mlp"))
            if nxt in capture:
                ops.append(Op(AUX_CAPTURE, nxt))
            ops.append(Op(ADD_RMSNORM, nxt, "", "input_layernorm", nxt))
    return ops


def summarize_pattern(ops: Iterable[Op]) -> dict:
    """Counts per forward, and where the plain all-reduces sit (index among the all-reduces)."""
    ops = list(ops)
    comm = [op for op in ops if op.is_comm]
    plain_idx = [k for k, op in enumerate(comm) if op.kind == ALLREDUCE]
    return {
        "n_ops": len(ops),
        "n_allreduce": len(comm),
        "n_fused": sum(op.kind == ALLREDUCE_ADD_RMSNORM for op in comm),
        "n_plain": len(plain_idx),
        "plain_allreduce_indices": plain_idx,
        "plain_allreduce_sites": [f"{comm[k].site}@{comm[k].layer}" for k in plain_idx],
        "n_separate_add_rmsnorm": sum(op.kind == ADD_RMSNORM for op in ops),
        "n_aux_capture": sum(op.kind == AUX_CAPTURE for op in ops),
    }


RELEASES = ("0.5.13.post1", "0.5.23")


def sglang_capture_layers(num_layers: int, eagle_layer_ids=None) -> tuple[int, ...]:
    """The layers before which SGLang's DeepSeek-V2/V3 model captures EAGLE-3's aux hidden states, from the
    draft's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (None: the draft names none). As
    ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`` reads them in both releases: no ids give
    ``[2, N//2, N-3]``; ids that start at 1 name the layer whose output is read and move up by one."""
    if eagle_layer_ids is None:
        return (2, num_layers // 2, num_layers - 3)
    ids = [int(i) for i in eagle_layer_ids]
    return tuple(i + 1 for i in ids) if ids and ids[0] == 1 else tuple(ids)


def verify_counts(num_layers: int, first_k_dense: int, capture_layers, release: str, draft_layers: int = 1) -> dict:
    """All-reduces of one EAGLE-3 target-verify forward at TP > 1 with the sm120 backend on, and the draft's.

    The target (DeepSeek-V3 body): the embedding's plain all-reduce, then per layer the attention output fused
    into ``post_attention_layernorm`` and the MLP/MoE output deferred into the next layer's ``input_layernorm``
    (fused), except the last layer's, which feeds the final norm after a plain all-reduce. Where the releases
    differ: on 0.5.13.post1 a layer whose output a capture reads keeps its MLP all-reduce plain (the overlay's
    guard: the capture would read an unreduced partial); 0.5.23's DeepSeek captures ``capture_gathered``, the
    residual after the fused kernel completed the owed sum, so those boundaries fuse too.
    ``moe_deferred``: MoE sums completed inside the next layer's fused norm. ``draft_plain``: the Llama EAGLE-3
    draft's all-reduces per draft forward (embedding, then each layer's attention and MLP; never fused: its
    layers build no fusion boundary)."""
    if release not in RELEASES:
        raise ValueError(f"release {release!r}: the rule is known for {', '.join(RELEASES)}")
    if not 0 <= first_k_dense <= num_layers or num_layers < 1:
        raise ValueError("need 1 <= num_layers and 0 <= first_k_dense <= num_layers")
    guarded = {int(c) - 1 for c in capture_layers} if release == "0.5.13.post1" else set()
    deferred = [i for i in range(num_layers - 1) if i not in guarded]
    fused = num_layers + len(deferred)
    total = 1 + 2 * num_layers
    return {"allreduce": total, "fused": fused, "plain": total - fused,
            "moe_deferred": sum(i >= first_k_dense for i in deferred), "draft_plain": 1 + 2 * draft_layers}


# ---------------------------------------------------------------------------------------------------------
# Per-rank GEMM shapes for --compute gemm (pure arithmetic, so it is testable without a GPU)


def expected_active_experts(tokens: int, num_experts: int, top_k: int) -> int:
    """Expected number of distinct experts hit by ``tokens`` tokens routing to ``top_k`` of ``num_experts``
    uniformly: E * (1 - (1 - k/E)^T), rounded, at least ``min(top_k, E)``."""
    if tokens <= 0:
        return 0
    e = num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
    return max(min(top_k, num_experts), min(num_experts, int(round(e))))


def gemm_shapes(cfg: ModelConfig, tokens: int, tp: int) -> dict:
    """Per-rank matrix shapes of one layer at tensor parallelism ``tp`` (M x K @ K x N, as (M, K, N)).

    MLA (absorbed, as in decode/verify): fused q_a + kv_a projection (replicated), q_b (heads sharded),
    W_kc / W_vc batched over the rank's heads, o_proj (row-parallel -> partial). The attention core over the
    KV cache is not modelled. Dense MLP: gate_up column-parallel, down row-parallel. MoE: router (replicated),
    routed experts with the intermediate dimension sharded over TP (expected number of active experts for
    ``tokens`` tokens, tokens spread evenly), plus the shared expert(s).
    """
    H = cfg.hidden_size
    T = tokens
    att = cfg.attention
    out: dict[str, Any] = {}
    if att.get("type", "mla") == "mla":
        heads = _shard(int(att["num_heads"]), tp, "num_heads")
        qk = int(att["qk_nope_head_dim"]) + int(att["qk_rope_head_dim"])
        kv = int(att["kv_lora_rank"])
        out["attn"] = {
            "type": "mla",
            "qkv_a": (T, H, int(att["q_lora_rank"]) + kv + int(att["qk_rope_head_dim"])),
            "q_b": (T, int(att["q_lora_rank"]), heads * qk),
            "w_kc": (heads, T, int(att["qk_nope_head_dim"]), kv),  # batched: heads x (T x nope @ nope x kv)
            "w_vc": (heads, T, kv, int(att["v_head_dim"])),
            "o_proj": (T, heads * int(att["v_head_dim"]), H),
        }
    else:
        heads = _shard(int(att["num_heads"]), tp, "num_heads")
        kv_heads = max(1, int(att["num_kv_heads"]) // tp)
        hd = int(att["head_dim"])
        out["attn"] = {
            "type": "gqa",
            "qkv": (T, H, (heads + 2 * kv_heads) * hd),
            "o_proj": (T, heads * hd, H),
        }
    inter = _shard(int(cfg.mlp.get("intermediate_size", 4 * H)), tp, "intermediate_size")
    out["dense"] = {"gate_up": (T, H, 2 * inter), "down": (T, inter, H)}
    if cfg.moe:
        m = cfg.moe
        n_exp, top_k = int(m["num_experts"]), int(m["top_k"])
        mi = _shard(int(m["intermediate_size"]), tp, "moe intermediate_size")
        active = expected_active_experts(T, n_exp, top_k)
        rows = math.ceil(T * top_k / active)
        shared = mi * int(m.get("num_shared_experts", 0))
        out["moe"] = {
            "router": (T, H, n_exp),
            "active_experts": active,
            "rows_per_expert": rows,
            "expert_gate_up": (active, rows, H, 2 * mi),  # batched
            "expert_down": (active, rows, mi, H),
            "shared_gate_up": (T, H, 2 * shared) if shared else None,
            "shared_down": (T, shared, H) if shared else None,
        }
    return out


def _shard(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by tp={tp}")
    return n // tp
