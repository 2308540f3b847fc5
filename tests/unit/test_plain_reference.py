"""The plain-PyTorch references of tests/fixtures/plain_reference (ChatGLM,
InternLM2: no native transformers class) are right: with the checkpoint's
weights re-laid out by hand, transformers' own classes of the same structure
give the same logits -- ChatGLM is GLM-4-9B's ``GlmForCausalLM`` (partial
interleaved rotary, q/k/v biases, fused gate_up) with ``query_key_value``
split into q | k | v; InternLM2 is ``LlamaForCausalLM`` with ``wqkv`` split
per KV head. Also: decoding one token on the K/V of earlier passes gives the
logits of one pass over the whole sequence."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.plain_reference import FORWARDS
from tests.fixtures.tiny_families import build_tiny_family

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FORWARDS:
        d = build_tiny_family(family, tmp_path_factory.mktemp(family))
        out[family] = (
            json.loads((d / "config.json").read_text()),
            load_file(d / "model.safetensors"),
        )
    return out


def _glm_from_chatglm(cfg, w):
    from transformers import GlmConfig, GlmForCausalLM

    heads, groups, head_dim = (
        cfg["num_attention_heads"], cfg["multi_query_group_num"], cfg["kv_channels"],
    )  # fmt: skip
    model = GlmForCausalLM(
        GlmConfig(
            vocab_size=cfg["padded_vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["ffn_hidden_size"],
            num_hidden_layers=cfg["num_layers"],
            num_attention_heads=heads,
            num_key_value_heads=groups,
            head_dim=head_dim,
            rms_norm_eps=cfg["layernorm_epsilon"],
            attention_bias=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            max_position_embeddings=cfg["seq_length"],
            tie_word_embeddings=False,
            pad_token_id=cfg["pad_token_id"],
            eos_token_id=cfg["eos_token_id"],
        )
    )
    sd = {
        "model.embed_tokens.weight": w["transformer.embedding.word_embeddings.weight"],
        "model.norm.weight": w["transformer.encoder.final_layernorm.weight"],
        "lm_head.weight": w["transformer.output_layer.weight"],
    }
    sizes = [heads * head_dim, groups * head_dim, groups * head_dim]
    for i in range(cfg["num_layers"]):
        src, dst = f"transformer.encoder.layers.{i}.", f"model.layers.{i}."
        qkv_w = w[src + "self_attention.query_key_value.weight"].split(sizes)
        qkv_b = w[src + "self_attention.query_key_value.bias"].split(sizes)
        for name, weight, bias in zip("qkv", qkv_w, qkv_b, strict=True):
            sd[dst + f"self_attn.{name}_proj.weight"] = weight
            sd[dst + f"self_attn.{name}_proj.bias"] = bias
        sd[dst + "self_attn.o_proj.weight"] = w[src + "self_attention.dense.weight"]
        sd[dst + "mlp.gate_up_proj.weight"] = w[src + "mlp.dense_h_to_4h.weight"]
        sd[dst + "mlp.down_proj.weight"] = w[src + "mlp.dense_4h_to_h.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[dst + f"{norm}.weight"] = w[src + f"{norm}.weight"]
    model.load_state_dict(sd, strict=True)
    return model


def _llama_from_internlm2(cfg, w):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads = (
        cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
    )  # fmt: skip
    head_dim, g = hidden // heads, heads // kv_heads
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg["rope_theta"],
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=False,
            pad_token_id=cfg["pad_token_id"],
        )
    )
    sd = {
        "model.embed_tokens.weight": w["model.tok_embeddings.weight"],
        "model.norm.weight": w["model.norm.weight"],
        "lm_head.weight": w["output.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = w[p + "attention.wqkv.weight"].view(kv_heads, g + 2, head_dim, hidden)
        sd[p + "self_attn.q_proj.weight"] = qkv[:, :g].reshape(-1, hidden)
        sd[p + "self_attn.k_proj.weight"] = qkv[:, g].reshape(-1, hidden)
        sd[p + "self_attn.v_proj.weight"] = qkv[:, g + 1].reshape(-1, hidden)
        sd[p + "self_attn.o_proj.weight"] = w[p + "attention.wo.weight"]
        sd[p + "mlp.gate_proj.weight"] = w[p + "feed_forward.w1.weight"]
        sd[p + "mlp.up_proj.weight"] = w[p + "feed_forward.w3.weight"]
        sd[p + "mlp.down_proj.weight"] = w[p + "feed_forward.w2.weight"]
        sd[p + "input_layernorm.weight"] = w[p + "attention_norm.weight"]
        sd[p + "post_attention_layernorm.weight"] = w[p + "ffn_norm.weight"]
    model.load_state_dict(sd, strict=True)
    return model


HF_EQUIVALENT = {"chatglm": _glm_from_chatglm, "internlm2": _llama_from_internlm2}


@pytest.mark.parametrize("family", list(FORWARDS))
def test_reference_equals_transformers_equivalent(family, checkpoints):
    cfg, w = checkpoints[family]
    ids = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = HF_EQUIVALENT[family](cfg, w).eval()(ids[None]).logits[0]
        got = FORWARDS[family](w, cfg, ids, [])
    assert expected.abs().max() > 10  # logits std ~8: not a degenerate model
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FORWARDS))
def test_decoding_on_past_equals_one_pass(family, checkpoints):
    cfg, w = checkpoints[family]
    ids = torch.randint(3, 512, (130,), generator=torch.Generator().manual_seed(1))
    forward = FORWARDS[family]
    with torch.inference_mode():
        whole = forward(w, cfg, ids, [])
        past: list = []
        steps = [forward(w, cfg, ids[:128], past)[-1]]
        steps += [forward(w, cfg, ids[i : i + 1], past)[-1] for i in (128, 129)]
    torch.testing.assert_close(torch.stack(steps), whole[127:], atol=1e-4, rtol=1e-4)
