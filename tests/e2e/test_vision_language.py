"""Vision-language models served through the plugin equal HF transformers.

One tiny random checkpoint per family (``tests/fixtures/tiny_vl``: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4.1V, GLM-4.5V, InternVL), built
from the family's own transformers config, model and processor classes,
and images made here (seeded noise, 140 x 112, and a colour pattern,
84 x 84: two sizes, so two patch grids). The reference is transformers'
``generate`` on the same processor outputs.

- float32: identical greedy tokens for one image, the other image with the
  same text (the tokens differ: the image is seen), two images in one
  prompt, a text-only prompt, a prompt whose first 128-token block holds
  the image, and a video (Qwen2-VL, GLM-4.1V, GLM-4.5V). The engine
  prefills 32 tokens a step; the long prompt is sent again (a prefix-cache
  hit, counted) and with the other image (no false hit). An image larger
  than the processor's maximum is downscaled as transformers does, its
  tokens prefilled across two chunks from one encoder pass, and the same
  image in another prompt takes no encoder pass (the encoder cache).
  Inside the worker: no vLLM tower layer with an out-of-tree entry is
  left, no plain ``torch.nn.LayerNorm``; the tower's attention ran on
  ``attention_varlen``, its patch embedding on ``patch_embedding``, its
  2-D rotary on ``apply_rotary_emb``, its LayerNorms on ``layer_norm``
  and the decoder's M-RoPE (all but InternVL) on
  ``mrope_rotary_embedding`` (call counts); the MoE families' experts on
  the plugin's fused MoE.
- bfloat16: vLLM's ``check_logprobs_close`` rule against transformers run
  in bfloat16.

Qwen2-VL's float32 test runs in the default tier and so on the stand-in
SUPA device, where it also checks that the supa backend serves it. The
rest runs in the slow tier on cpu and, through ``supa_backend`` twins, in
the stand-in tier on supa: the other families' float32 test, bfloat16 and
the ``vllm serve`` test (base64 images through
the openai client; a downscaled large image; bad images, an image over
``VLLM_MAX_IMAGE_PIXELS`` and an http host outside
``--allowed-media-domains`` answered with a 400) in the slow tier.
"""

from __future__ import annotations

import base64
import io
import json
import re

import pytest

from tests.fixtures import standin
from tests.fixtures.engine import (
    check_logprobs_close,
    count_op_calls,
    counter,
    llm_engine,
    op_calls,
    token_ids,
    vllm_logprobs,
    worker_facts,
)
from tests.fixtures.server import vllm_server
from tests.fixtures.tiny_models import CORPUS
from tests.fixtures.tiny_vl import (
    VL_FAMILIES,
    build_tiny_vl,
    hf_vl_generate,
    vl_images,
    vl_video,
    vl_video_metadata,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 10
NUM_LOGPROBS = 5
VL_OPS = (
    "attention_varlen",
    "mrope_rotary_embedding",
    "patch_embedding",
    "apply_rotary_emb",
    "layer_norm",
)
# vLLM's tower layers with an out-of-tree entry: none may be left.
VLLM_TOWER_LAYERS = {
    "MMEncoderAttention",
    "Conv2dLayer",
    "Conv3dLayer",
    "ApplyRotaryEmb",
    "LayerNorm",
}
CHUNK = 32  # max_num_batched_tokens: the prefill chunk
# Long enough that the image sits in a full 128-token block.
LONG_TEXT = " ".join(CORPUS.split("\n\n")[:2]).replace("\n", " ")

SLOW_FAMILIES = [
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "glm4v_moe",
    "internvl",
]
# Families whose video is compared with transformers. vLLM 0.33 and
# transformers 5.20 disagree on Qwen2.5-VL's and Qwen3-VL's video inputs
# whoever runs the layers (docs/multimodal.md), so those have no video here.
VIDEO_FAMILIES = {"qwen2_vl", "glm4v", "glm4v_moe"}
FAMILIES = [
    "qwen2_vl",
    *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_FAMILIES),
]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    built = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_tiny_vl(name, tmp_path_factory.mktemp(name)))
        return built[name]

    return get


def _uses_mrope(family: str) -> bool:
    """The Qwen-VL and GLM-4V decoders rotate by M-RoPE; InternVL's Qwen2
    decoder by plain rotary."""
    return "mrope_section" in VL_FAMILIES[family].text_config["rope_parameters"]


def _requests(family: str, with_video: bool):
    """(prompt, multimodal data) pairs; see the module doc."""
    noise, pattern = vl_images()
    IMG = VL_FAMILIES[family].placeholder("image")
    requests = [
        (f"The river {IMG} runs", {"image": [noise]}),
        (f"The river {IMG} runs", {"image": [pattern]}),
        (f"Two pictures: {IMG} and {IMG} show", {"image": [noise, pattern]}),
        ("Numbers have their own rhythm.", {}),
        (f"{IMG} {LONG_TEXT}", {"image": [noise]}),
    ]
    if with_video:
        video = VL_FAMILIES[family].placeholder("video")
        frames = vl_video()
        clip = (frames, vl_video_metadata(frames))
        requests.append((f"A film: {video} of", {"video": [clip]}))
    return requests


def _vllm_prompt(text: str, data: dict) -> dict:
    prompt = {"prompt": text}
    if data:
        # One item is passed bare, several as a list (vLLM takes both).
        prompt["multi_modal_data"] = {
            k: v[0] if len(v) == 1 else v for k, v in data.items()
        }
    return prompt


def _params(logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


def _engine(model: str, dtype: str):
    return llm_engine(
        model,
        dtype=dtype,
        limit_mm_per_prompt={"image": 2, "video": 1},
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_identical_to_hf(vl_dir, family):
    _float32_parity(vl_dir(family), family)


@pytest.mark.supa_backend
@pytest.mark.parametrize("family", SLOW_FAMILIES)
def test_float32_identical_to_hf_on_supa(vl_dir, family):
    """The other families' float32 parity on the supa backend: in the
    stand-in tier, while their cpu run is in the slow tier."""
    _float32_parity(vl_dir(family), family)


def _float32_parity(model: str, family: str) -> None:
    requests = _requests(family, with_video=family in VIDEO_FAMILIES)
    expected = [
        ids for ids, _ in hf_vl_generate(model, requests, MAX_TOKENS, "float32")
    ]
    # The image changes the continuation of the same text.
    assert expected[0] != expected[1]
    noise, pattern = vl_images()
    # Larger than the processor's maximum (max_image_tokens): downscaled, as
    # transformers does. After a dozen words of text its tokens cross the
    # first prefill chunk's end.
    IMG = VL_FAMILIES[family].placeholder("image")
    large = noise.resize((560, 448))
    prefix = " ".join(LONG_TEXT.split()[:12])
    cached = [
        (f"{prefix} {IMG} of", {"image": [large]}),
        (f"A picture {IMG} of", {"image": [large]}),
    ]
    with _engine(model, "float32") as llm:
        facts = llm.collective_rpc(worker_facts)[0]
        dispatch = facts["custom_op_dispatch"]
        layers = facts["plugin_layer_counts"]
        # The tower's attention, patch embedding, 2-D rotary and LayerNorms
        # and the decoder's rotary are the plugin's layers on its ops.
        assert not VLLM_TOWER_LAYERS & set(dispatch), dispatch
        assert facts["torch_layer_norms"] == 0
        rope = "SUPAMRotaryEmbedding" if _uses_mrope(family) else "SUPARotaryEmbedding"
        tower = {"SUPAMMEncoderAttention", rope} | {
            name for name in dispatch if name.startswith("SUPAConv")
        }
        tower |= {"SUPAApplyRotaryEmb", "SUPALayerNorm"} & set(dispatch)
        assert {dispatch[name] for name in tower} == {"forward_oot"}, dispatch
        convs = sum(n for name, n in layers.items() if name.startswith("SUPAConv"))
        assert convs >= 1, layers
        norms = layers.get("SUPATorchLayerNorm", 0) + layers.get("SUPALayerNorm", 0)
        if family.endswith("_moe"):
            assert "SUPAUnquantizedFusedMoEMethod" in facts["plugin_layers"]
        if standin.active():
            # The supa path as on a card: weights, KV cache and so the pixel
            # inputs on the device, async scheduling on.
            supa = llm.collective_rpc(standin.supa_facts)[0]
            assert supa["backend"] == "supa" and supa["async_scheduling"]
            assert supa["weight_devices"] == ["supa"] and supa["kv_devices"] == ["supa"]

        llm.collective_rpc(count_op_calls, args=(VL_OPS,))
        got = token_ids(llm.generate([_vllm_prompt(*r) for r in requests], _params()))
        assert got == expected
        calls = llm.collective_rpc(op_calls)[0]

        hits = counter(llm, "vllm:prefix_cache_hits")
        again = token_ids(llm.generate([_vllm_prompt(*requests[4])], _params()))
        assert again == [expected[4]]
        assert counter(llm, "vllm:prefix_cache_hits") - hits >= 128
        other = (requests[4][0], {"image": [pattern]})
        other_got = token_ids(llm.generate([_vllm_prompt(*other)], _params()))

        # The encoder cache: the large image's tokens are prefilled over
        # several chunks from one encoder pass (each conv layer ran once);
        # in another prompt the same image takes no pass at all.
        encoder_runs = []
        cached_out = []
        for request in cached:
            llm.collective_rpc(count_op_calls, args=(VL_OPS,))
            cached_out += llm.generate([_vllm_prompt(*request)], _params())
            encoder_runs.append(llm.collective_rpc(op_calls)[0])
    assert other_got == [hf_vl_generate(model, [other], MAX_TOKENS, "float32")[0][0]]
    assert other_got != [expected[4]]
    # The tower's blocks attended on the plugin's op (vLLM batches the step's
    # images into one encoder pass), embedded patches, rotated and normed on
    # its ops; both decoder layers rotated through M-RoPE at every step.
    assert calls["attention_varlen"] >= 2, calls
    assert calls["patch_embedding"] >= convs, calls
    assert calls["layer_norm"] >= norms, calls
    if family != "internvl":  # InternViT: learned position embeddings
        assert calls["apply_rotary_emb"] >= 2, calls
    if _uses_mrope(family):
        assert calls["mrope_rotary_embedding"] >= 2 * MAX_TOKENS, calls

    cached_want = [
        ids for ids, _ in hf_vl_generate(model, cached, MAX_TOKENS, "float32")
    ]
    assert token_ids(cached_out) == cached_want
    text_before = len(_tokenizer(model)(prefix)["input_ids"])
    assert text_before < CHUNK - 2 < CHUNK + 4 < len(cached_out[0].prompt_token_ids)
    assert encoder_runs[0]["patch_embedding"] == convs, encoder_runs
    assert encoder_runs[1]["patch_embedding"] == 0, encoder_runs
    assert encoder_runs[1]["attention_varlen"] == 0, encoder_runs


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", *SLOW_FAMILIES])
def test_bfloat16_follows_check_logprobs_close(vl_dir, family):
    _bfloat16_parity(vl_dir(family), family)


@pytest.mark.supa_backend
@pytest.mark.parametrize("family", ["qwen2_vl", *SLOW_FAMILIES])
def test_bfloat16_follows_check_logprobs_close_on_supa(vl_dir, family):
    """The bfloat16 parity on the supa backend (stand-in tier)."""
    _bfloat16_parity(vl_dir(family), family)


def _bfloat16_parity(model: str, family: str) -> None:
    requests = _requests(family, with_video=False)
    reference = hf_vl_generate(model, requests, MAX_TOKENS, "bfloat16", NUM_LOGPROBS)
    with _engine(model, "bfloat16") as llm:
        tested = vllm_logprobs(
            llm.generate([_vllm_prompt(*r) for r in requests], _params(NUM_LOGPROBS))
        )
    parted = check_logprobs_close(reference, tested)
    assert sum(p is None for p in parted) >= len(requests) // 2, parted


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(text: str, *urls: str) -> list[dict]:
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": content}]


@pytest.mark.slow
def test_served_chat_with_base64_images(vl_dir, tmp_path):
    """``vllm serve`` and the openai client: a base64 image, streamed and
    not, equal to transformers on the prompt the server rendered; bad
    images get a 400 with one sentence and the server keeps serving."""
    _served_chat(vl_dir("qwen2_vl"), tmp_path)


@pytest.mark.supa_backend
def test_served_chat_with_base64_images_on_supa(vl_dir, tmp_path):
    """The same through ``vllm serve`` on the supa backend (stand-in tier)."""
    _served_chat(vl_dir("qwen2_vl"), tmp_path)


def _served_chat(model: str, tmp_path) -> None:
    import openai
    import requests
    from PIL import Image

    args = ["--served-model-name", "tiny-vl", "--max-model-len", "1024", "--dtype", "float32",
            "--enforce-eager", "--limit-mm-per-prompt", json.dumps({"image": 2}),
            "--allowed-media-domains", "127.0.0.1"]  # fmt: skip
    noise, pattern = vl_images()
    with vllm_server(model, args, tmp_path / "serve.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        greedy = {"model": "tiny-vl", "max_tokens": MAX_TOKENS, "temperature": 0}
        out = client.chat.completions.create(
            messages=_chat("The river", _data_url(noise)),
            extra_body={"return_token_ids": True},
            **greedy,
        )
        got = out.choices[0].token_ids
        # The rendered prompt, its image placeholder collapsed back to one
        # <|image_pad|>, through transformers' processor and generate.
        tokenizer = _tokenizer(model)
        rendered = tokenizer.decode(out.prompt_token_ids)
        rendered = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", rendered)
        rendered = rendered.removeprefix(tokenizer.bos_token)
        want = hf_vl_generate(model, [(rendered, {"image": [noise]})], MAX_TOKENS)
        assert got == want[0][0]

        stream = client.chat.completions.create(
            messages=_chat("The river", _data_url(noise)), stream=True, **greedy
        )
        streamed = "".join(
            c.choices[0].delta.content or "" for c in stream if c.choices
        )
        assert streamed == out.choices[0].message.content
        other = client.chat.completions.create(
            messages=_chat("The river", _data_url(pattern)), **greedy
        )
        assert other.choices[0].message.content != out.choices[0].message.content

        def post(messages):
            r = requests.post(
                f"{base}/v1/chat/completions",
                json={"messages": messages, **greedy},
                timeout=60,
            )
            return r.status_code, r.json().get("error", {}).get("message", "")

        not_image = (
            "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
        )
        status, message = post(_chat("The river", not_image))
        assert status == 400 and "Failed to load image" in message, message
        three = [_data_url(noise)] * 3
        status, message = post(_chat("The river", *three))
        assert status == 400, message
        assert "At most 2 image(s) may be provided in one prompt" in message
        # Larger than the processor's maximum: downscaled to at most its
        # max_image_tokens (64 here), as transformers' processor does.
        large = client.chat.completions.create(
            messages=_chat("The river", _data_url(noise.resize((1600, 1280)))),
            extra_body={"return_token_ids": True},
            **greedy,
        )
        pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert 20 < large.prompt_token_ids.count(pad) <= 64
        # Over vLLM's VLLM_MAX_IMAGE_PIXELS (default 178,956,970, PIL's
        # decompression-bomb limit): refused with the setting named (patch
        # ledger: pil-decompression-bomb-limit; PIL's own error was a 500).
        buf = io.BytesIO()
        Image.new("1", (15000, 15000)).save(buf, format="PNG")
        bomb = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        status, message = post(_chat("The river", bomb))
        assert status == 400, (status, message)
        assert "exceed the maximum of 178956970 pixels" in message, message
        assert "Set VLLM_MAX_IMAGE_PIXELS to increase this limit" in message
        # http URLs: a host outside --allowed-media-domains (how a server
        # without network access lists the hosts it can reach) is refused;
        # an allowed host that does not answer (nothing listens on port 9)
        # is a 500 with vLLM's sentence: vLLM keeps connection errors 5xx so
        # that clients retry (docs/multimodal.md).
        status, message = post(_chat("The river", "http://images.example/a.png"))
        assert status == 400, (status, message)
        assert "The URL must be from one of the allowed domains" in message
        status, message = post(_chat("The river", "http://127.0.0.1:9/a.png"))
        assert status == 500 and "Cannot connect to host 127.0.0.1:9" in message
        status, _ = post(_chat("The river", _data_url(pattern)))
        assert status == 200


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
