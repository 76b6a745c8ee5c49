"""The server test's checkpoint writer on CPU (tests/gpu/kimi_shaped_model.py): the config parses with the installed
SGLang's Kimi-K2.5 config class, the remote-code processor loads through transformers' AutoProcessor as SGLang
calls it, and the structure gives the all-reduce counts the server test asserts."""

from __future__ import annotations

import json

import pytest

from benchmarks.workloads import verify_pattern as vp
from tests.gpu import kimi_shaped_model as km

pytest.importorskip("sglang")


def test_the_config_is_kimi_k25_to_sglang(tmp_path):
    from sglang.srt.configs.kimi_k25 import KimiK25Config

    cfg = KimiK25Config(**json.loads(json.dumps(km.target_config(km.LAYERS))))
    text = cfg.text_config
    assert type(text).__name__ == "DeepseekV3Config" and cfg.hidden_size == 7168 and cfg.vocab_size == km.VOCAB
    assert (text.num_hidden_layers, text.first_k_dense_replace, text.n_routed_experts, text.num_experts_per_tok) == \
        (9, 1, 12, 8)
    assert (text.q_lora_rank, text.kv_lora_rank, text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert text.architectures == ["DeepseekV3ForCausalLM"]  # the shared-expert fusion check indexes it
    assert km.EXPERTS & (km.EXPERTS - 1)  # not a power of two: FlashInfer's fused top-k is not taken
    vision = cfg.vision_config
    assert vision.vt_hidden_size == vision.hidden_size and vision.hidden_size // vision.num_attention_heads % 4 == 0
    assert vision.num_attention_heads % 2 == 0  # TP=2 shards the vision attention heads


def test_the_processor_loads_as_sglang_loads_it(tmp_path):
    from transformers import AutoProcessor

    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(km.target_config(km.LAYERS)))
    km.write_tokenizer(str(folder))
    km.write_processor(str(folder))
    import sglang.srt.utils.hf_transformers_utils  # noqa: F401  (registers SGLang's kimi_k25 config class)

    proc = AutoProcessor.from_pretrained(str(folder), trust_remote_code=True, use_fast=True)
    assert proc.media_processor.media_proc_cfg == km.MEDIA_PROC_CFG
    assert proc.tokenizer.encode("w0 w1 w32762", add_special_tokens=False) == [5, 6, km.VOCAB - 1]
    assert proc.tokenizer.convert_tokens_to_ids("<|media_pad|>") == km.target_config(9)["media_placeholder_token_id"]


def test_the_draft_captures_what_sglang_defaults_to():
    assert vp.sglang_capture_layers(km.LAYERS, km.eagle_layer_ids(km.LAYERS)) == vp.sglang_capture_layers(km.LAYERS)
    assert vp.sglang_capture_layers(61, km.eagle_layer_ids(61)) == (2, 30, 58)
    assert km.draft_config(km.LAYERS)["vocab_size"] == km.target_config(km.LAYERS)["text_config"]["vocab_size"]


@pytest.mark.parametrize("release, fused, plain, deferred", [("0.5.13.post1", 14, 5, 4), ("0.5.23", 17, 2, 7)])
def test_counts_of_the_test_model(release, fused, plain, deferred):
    captures = vp.sglang_capture_layers(km.LAYERS, km.eagle_layer_ids(km.LAYERS))
    assert vp.verify_counts(km.LAYERS, km.FIRST_DENSE, captures, release) == \
        {"allreduce": 19, "fused": fused, "plain": plain, "moe_deferred": deferred, "draft_plain": 3}


def test_names_and_shapes():
    shapes = km.target_shapes(km.LAYERS)
    assert all(name.startswith("language_model.model.") or name == "language_model.lm_head.weight" for name in shapes)
    assert sum("mlp.experts." in n for n in shapes) == 3 * km.EXPERTS * (km.LAYERS - km.FIRST_DENSE)
    assert shapes["language_model.model.layers.0.self_attn.o_proj.weight"] == (7168, 64 * 128)
    assert km.draft_shapes()["fc.weight"] == (7168, 3 * 7168)
