"""A tiny random Llama checkpoint for the end-to-end check, built in a second
and needing no download: a standard ``LlamaForCausalLM`` folder (config,
safetensors weights, generation config) with a byte-level BPE tokenizer
trained here on :data:`CORPUS`.

The weights are seeded and scaled so that greedy decoding is informative
and stable in float32: unit-scale projections (std ``1/sqrt(fan_in)``),
slightly larger queries and keys so attention depends on position, norm
weights of ``1 + 0.1 * noise``, and logits with a std of about 8, so the
top two logits of a step lie far apart next to float32 rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

CORPUS = """\
The harbour wakes before the town. Boats come in with the tide, gulls
circle the masts, and the first stalls of the market open under the clock.
A baker carries bread across the square; a child counts the boats, one,
two, three, four, and starts again when a new sail appears.

Rivers shape the land slowly. Water finds the lowest path, carries sand to
the sea, and leaves the valley a little wider every year. Bridges cross it
at the narrow places, and towns grow where the bridges are.

A recipe is a small program. Cut an onion, warm the pan, add oil and salt,
stir for ten minutes, then add water and lentils and wait. Taste before you
serve it, and write down what you changed for the next time.

Numbers repeat in patterns: even and odd, squares and primes, the rows of a
table that children learn by heart. Every number has a successor, and there
is no largest one, which surprises most people the first time they hear it.

In the evening the wind turns towards the sea. The lights along the wall
come on one by one, people walk by the water and talk about the day, and
the lighthouse keeper writes the weather into his book before the night.
"""

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
VOCAB_SIZE = 512
_LOGIT_STD = 8.0


def build_tokenizer(vocab_size: int = VOCAB_SIZE, model_max_length: int = 512):
    """Byte-level BPE of exactly ``vocab_size`` tokens (trained merges, then
    plain ``<extra_i>`` tokens), adding BOS to every encoded text."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, tok.token_to_id(BOS))],
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=model_max_length,
    )


def _init_weights(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                continue
            if name == "model.embed_tokens.weight":
                std = 1.0
            elif name == "lm_head.weight":
                std = _LOGIT_STD / math.sqrt(hidden)
            else:
                gain = 1.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                std = gain / math.sqrt(p.shape[-1])
            p.copy_(std * torch.randn(p.shape, generator=gen))


def build_tiny_llama(path: str | Path, seed: int = 0, max_positions: int = 512) -> Path:
    """Write the tiny Llama (float32) and its tokenizer to ``path``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(VOCAB_SIZE, max_positions)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        hidden_act="silu",
    )
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    _init_weights(model, seed)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts_of_lengths(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly these token counts: BOS, then the corpus's tokens
    from a different place for each."""
    body = [
        i
        for paragraph in CORPUS.split("\n\n")
        for i in tokenizer(paragraph, add_special_tokens=False).input_ids
    ]
    prompts = []
    for k, n in enumerate(lengths):
        start = (37 * k) % len(body)
        ids = (body * (n // len(body) + 2))[start : start + n - 1]
        prompts.append([tokenizer.bos_token_id, *ids])
    return prompts
