"""Which speculative-decoding settings SUPA serves, checked at start-up.

vLLM validates the speculative configuration itself while it builds the
config (an unknown method, a non-positive ``num_speculative_tokens``, a
draft whose vocabulary differs from the target's, ``mtp`` on a checkpoint
without MTP layers); :func:`vllm_error_sentence` gives each of those its
one sentence for the CLI. What is checked here is what vLLM would accept
but SUPA cannot serve, so it stops before any weight is loaded instead of failing in a
worker: proposers whose kernels or runtime SUPA does not have, FLy
verification, and more draft tokens than the rejection sampler takes.
The draft always runs in the target's ``--dtype`` (vLLM builds the draft's
model config with it), so the target's dtype check covers the draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_br import compat
from vllm_br.errors import SUPAConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: vLLM's method names (after vLLM maps the model-specific MTP names, such as
#: ``deepseek_mtp``, to ``mtp``) that run through SUPAModelRunner.
SERVED_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
#: Rejection sampling methods SUPA's kernels implement.
SERVED_REJECTION_METHODS = ("standard", "synthetic")


def check_speculative_config(vllm_config: VllmConfig) -> None:
    spec = vllm_config.speculative_config
    if spec is None:
        return
    if spec.method not in SERVED_METHODS:
        raise SUPAConfigError(_unserved_method(spec.method))
    if spec.rejection_sample_method not in SERVED_REJECTION_METHODS:
        raise SUPAConfigError(
            "--speculative-config rejection_sample_method "
            f"{spec.rejection_sample_method!r} is not served on SUPA; use 'standard'."
        )
    longest = compat.rejection_sampler_max_spec_len()
    if spec.num_speculative_tokens > longest:
        raise SUPAConfigError(
            "--speculative-config num_speculative_tokens "
            f"{spec.num_speculative_tokens} is more than vLLM's rejection sampler "
            f"takes; use 1 to {longest} (2 to 5 is typical)."
        )


def _unserved_method(method: str) -> str:
    return (
        f"Speculative method {method!r} (--speculative-config method) is not "
        f"served on SUPA; use one of {', '.join(SERVED_METHODS)}."
    )


def vllm_error_sentence(err: BaseException) -> str | None:
    """One sentence for vLLM's own refusal of a speculative configuration."""
    found = compat.speculative_config_error(err)
    if found is None:
        return None
    kind, facts = found
    methods = ", ".join(SERVED_METHODS)
    if kind == "unserved":
        return _unserved_method(facts[0])
    if kind == "method":
        return (
            f"Speculative method {facts[0]!r} (--speculative-config method) is not "
            f"one vLLM knows; on SUPA use one of {methods}."
        )
    if kind == "num_speculative_tokens":
        longest = compat.rejection_sampler_max_spec_len()
        return (
            f"--speculative-config num_speculative_tokens {facts[0]} is out of "
            f"range; use 1 to {longest} (2 to 5 is typical)."
        )
    if kind == "vocab":
        target, draft = facts
        return (
            f"The draft model's vocabulary ({draft} tokens) differs from the "
            f"target's ({target}) (--speculative-config model); use a draft "
            "trained with the target's tokenizer."
        )
    return (
        f"--speculative-config method {facts[0]!r} found no draft for this "
        "checkpoint (mtp needs MTP layers, num_nextn_predict_layers in its "
        "config); give a draft model or use method ngram."
    )
