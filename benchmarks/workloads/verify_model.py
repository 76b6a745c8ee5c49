"""The verify forward of bench_verify.py: a model with the per-rank weight shapes of TP=N, whose forward follows
the op list of verify_pattern.py, and the backends that forward calls for its all-reduces and norms (NCCL, ours,
none for the compute-only reference, and SGLang's own path behind its fusion gate)."""

from __future__ import annotations

import math

from benchmarks.harness import nccl_mode
from benchmarks.workloads import verify_pattern as vp

# ---------------------------------------------------------------------------------------------------------
# The model: weights with per-rank shapes, and one forward driven by the op list


class Model:
    def __init__(self, cfg: vp.ModelConfig, d, gemm: bool, max_tokens: int, seed: int, max_expert_gib: float):
        import torch

        self.cfg, self.d, self.gemm = cfg, d, gemm
        H = cfg.hidden_size
        dev = d.device
        self.eps = cfg.rms_norm_eps
        self.rep = torch.Generator(device=dev)
        self.rep.manual_seed(seed)  # replicated tensors: identical on every rank
        self.own = torch.Generator(device=dev)
        self.own.manual_seed(seed + 1 + d.rank)  # this rank's shard
        self.norm_w = (1 + 0.1 * torch.randn(H, generator=self.rep, device=dev)).to(torch.bfloat16)
        self.emb: dict[int, torch.Tensor] = {}
        self.moe_idx: dict[int, torch.Tensor] = {}
        self.notes: dict = {}
        if not gemm:
            return
        tp = d.world_size
        sh = vp.gemm_shapes(cfg, max_tokens, tp)
        self.shapes_max = sh
        att = sh["attn"]
        if att["type"] == "mla":
            a = cfg.attention
            self.heads = int(a["num_heads"]) // tp
            self.nope, self.rope = int(a["qk_nope_head_dim"]), int(a["qk_rope_head_dim"])
            self.q_lora, self.kv = int(a["q_lora_rank"]), int(a["kv_lora_rank"])
            self.vdim = int(a["v_head_dim"])
            self.W_qkv_a = self._w((H, att["qkv_a"][2]), H, self.rep)
            self.W_q_b = self._w((self.q_lora, att["q_b"][2]), self.q_lora, self.own)
            self.W_kc = self._w((self.heads, self.nope, self.kv), self.nope, self.own)
            self.W_vc = self._w((self.heads, self.kv, self.vdim), self.kv, self.own)
            self.W_o = self._w((self.heads * self.vdim, H), self.heads * self.vdim, self.own)
        else:
            a = cfg.attention
            self.heads = int(a["num_heads"]) // tp
            self.hd = int(a["head_dim"])
            self.W_qkv = self._w((H, att["qkv"][2]), H, self.own)
            self.W_o = self._w((self.heads * self.hd, H), self.heads * self.hd, self.own)
        dense = sh["dense"]
        if cfg.first_k_dense > 0:
            self.inter = dense["down"][1]
            self.W_gu = self._w((H, 2 * self.inter), H, self.own)
            self.W_d = self._w((self.inter, H), self.inter, self.own)
        if cfg.moe and cfg.first_k_dense < cfg.num_layers:
            m = sh["moe"]
            self.mi = m["expert_down"][2]
            self.E, self.top_k = int(cfg.moe["num_experts"]), int(cfg.moe["top_k"])
            e_max = m["active_experts"]
            per_expert = H * 3 * self.mi * 2
            cap = max(1, int(max_expert_gib * (1 << 30) // per_expert))
            if e_max > cap:
                self.notes["experts_capped"] = f"{e_max} active experts needed at T={max_tokens}, {cap} allocated"
                e_max = cap
            self.e_alloc = e_max
            self.W_router = self._w((H, self.E), H, self.rep)
            self.W_egu = self._w((e_max, H, 2 * self.mi), H, self.own)
            self.W_ed = self._w((e_max, self.mi, H), self.mi, self.own)
            shared = m["shared_down"][1] if m["shared_down"] else 0
            self.shared = shared
            if shared:
                self.W_sgu = self._w((H, 2 * shared), H, self.own)
                self.W_sd = self._w((shared, H), shared, self.own)
        if self.d.device.type == "cuda":
            torch.cuda.synchronize()

    def _w(self, shape, fan_in, gen):
        import torch

        t = torch.randn(shape, generator=gen, device=self.d.device, dtype=torch.bfloat16)
        return t.mul_(fan_in**-0.5)

    def prepare_tokens(self, T: int) -> None:
        import torch

        if T not in self.emb:
            g = torch.Generator(device=self.d.device)
            g.manual_seed(1000 + 31 * T + self.d.rank)  # each rank's partial of the vocab-parallel embedding
            self.emb[T] = (torch.randn(T, self.cfg.hidden_size, generator=g, device=self.d.device)
                           / math.sqrt(self.d.world_size)).to(torch.bfloat16)
        if self.gemm and self.cfg.moe and T not in self.moe_idx:
            e_a, rows = self._moe_dims(T)
            self.moe_idx[T] = (torch.arange(e_a * rows, device=self.d.device) % T).contiguous()

    def _moe_dims(self, T: int) -> tuple[int, int]:
        e_a = min(self.e_alloc, vp.expected_active_experts(T, self.E, self.top_k))
        rows = math.ceil(T * self.top_k / e_a)
        return e_a, rows

    # -- compute (per-rank partials) --
    def attention(self, x):
        import torch

        T = x.shape[0]
        if self.cfg.attention.get("type", "mla") == "mla":
            qkv = x @ self.W_qkv_a
            q = qkv[:, : self.q_lora] @ self.W_q_b
            q_nope = q.view(T, self.heads, self.nope + self.rope)[:, :, : self.nope].transpose(0, 1)
            lat = torch.bmm(q_nope, self.W_kc)  # [heads, T, kv]: absorbed query (attention core not modelled)
            o = torch.bmm(lat, self.W_vc)  # [heads, T, v]
            return o.transpose(0, 1).reshape(T, self.heads * self.vdim) @ self.W_o
        qkv = x @ self.W_qkv
        return qkv[:, : self.heads * self.hd] @ self.W_o

    def mlp(self, x, moe: bool):
        import torch
        import torch.nn.functional as F

        if not moe:
            gu = x @ self.W_gu
            return (F.silu(gu[:, : self.inter]) * gu[:, self.inter :]) @ self.W_d
        T, H = x.shape
        _ = x @ self.W_router
        e_a, rows = self._moe_dims(T)
        xs = x.index_select(0, self.moe_idx[T]).view(e_a, rows, H)
        gu = torch.bmm(xs, self.W_egu[:e_a])
        y = torch.bmm(F.silu(gu[..., : self.mi]) * gu[..., self.mi :], self.W_ed[:e_a])
        routed = y.view(-1, H)[: T * self.top_k].view(self.top_k, T, H).sum(0)
        if self.shared:
            sgu = x @ self.W_sgu
            routed = routed + (F.silu(sgu[:, : self.shared]) * sgu[:, self.shared :]) @ self.W_sd
        return routed

    # -- one forward --
    def forward(self, ops, comm, norm, T: int, h_buf):
        h = h_buf
        h.copy_(self.emb[T])  # stands in for the embedding lookup
        w, eps = self.norm_w, self.eps
        residual = x = part = None
        aux = []
        for op in ops:
            k = op.kind
            if k == vp.ATTENTION:
                part = self.attention(x) if self.gemm else x
            elif k == vp.MLP:
                part = self.mlp(x, op.site == "moe") if self.gemm else x
            elif k == vp.ALLREDUCE:
                h = comm.all_reduce(h if op.site == "embedding" else part)
            elif k == vp.ALLREDUCE_ADD_RMSNORM:
                x, residual = comm.all_reduce_add_rmsnorm(part, residual, w, eps)
            elif k == vp.ADD_RMSNORM:
                residual, x = comm.add_rmsnorm(h, residual, w, eps)
            elif k == vp.RMSNORM:
                residual, x = h, norm.rmsnorm(h, w, eps)
            elif k == vp.AUX_CAPTURE:
                aux.append(h if residual is None else h + residual)
            else:
                raise ValueError(f"unknown op {op}")
        return x, aux


# ---------------------------------------------------------------------------------------------------------
# Backends: the communication primitives the forward calls


class NcclComm:
    name = "nccl"
    fuse = False

    def __init__(self, d, norm):
        self.d, self.norm = d, norm

    def all_reduce(self, t):
        import torch.distributed as dist

        dist.all_reduce(t, group=self.d.nccl)
        return t

    def add_rmsnorm(self, h, residual, w, eps):
        self.norm.add_rmsnorm_(h, residual, w, eps)  # in place: residual <- h + residual, h <- norm
        return residual, h

    def all_reduce_add_rmsnorm(self, part, residual, w, eps):  # not used: fuse=False pattern
        h = self.all_reduce(part)
        r, x = self.add_rmsnorm(h, residual, w, eps)
        return x, r


class NcclNoP2pComm(NcclComm):
    """The same NCCL calls in a --no-p2p run (NCCL_P2P_DISABLE=1 set before NCCL started)."""

    name = nccl_mode.NCCL_NO_P2P


class ComputeOnly(NcclComm):
    """All-reduces removed: the compute-only reference of --compute gemm."""

    name = "none"

    def all_reduce(self, t):
        return t


class Sm120Comm(NcclComm):
    name = "sm120"
    fuse = True

    def __init__(self, d, norm, impl, name: str = "sm120"):
        super().__init__(d, norm)
        self.impl = impl
        self.name = name

    def all_reduce(self, t):
        return self.impl.all_reduce(t, None)

    def all_reduce_add_rmsnorm(self, part, residual, w, eps):
        return self.impl.all_reduce_add_rmsnorm(part, residual, w, eps, None, None)


class SglangComm(NcclComm):
    """SGLang's own path: GroupCoordinator.all_reduce; at fusable boundaries the communicator's logic
    (layers/communicator.py): fusion gate yes -> RMSNorm.forward_with_allreduce_fusion, else all-reduce + norm."""

    fuse = True

    def __init__(self, d, norm, name, tp, norm_module, gate, module_norm_ok: bool):
        super().__init__(d, norm)
        self.name, self.tp, self.norm_module, self.gate = name, tp, norm_module, gate
        self.module_norm_ok = module_norm_ok
        self.gate_answers: dict[int, bool] = {}

    def gate_says(self, T: int) -> bool:
        if T not in self.gate_answers:
            try:
                self.gate_answers[T] = bool(self.gate(T))
            except Exception:  # noqa: BLE001 - e.g. no global server args in a bare process: gate closed
                self.gate_answers[T] = False
        return self.gate_answers[T]

    def all_reduce(self, t):
        return self.tp.all_reduce(t)

    def add_rmsnorm(self, h, residual, w, eps):
        if self.module_norm_ok:
            x, r = self.norm_module.forward(h, residual)
            return r, x
        return super().add_rmsnorm(h, residual, w, eps)

    def all_reduce_add_rmsnorm(self, part, residual, w, eps):
        # Asked before every fused call, as SGLang asks: the overlay's yes is a claim its fused call takes up.
        if self.gate_says(part.shape[0]) and self.gate(part.shape[0]):
            return self.norm_module.forward_with_allreduce_fusion(part, residual)
        h = self.all_reduce(part)
        r, x = self.add_rmsnorm(h, residual, w, eps)
        return x, r
