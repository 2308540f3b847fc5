"""Which speculative-decoding settings SUPA serves, checked at start-up.

vLLM validates the speculative configuration itself (an unknown method, a
non-positive ``num_speculative_tokens``, a draft whose vocabulary differs
from the target's: each stops in vLLM's own message when the config is
built). What is checked here is what vLLM would accept but SUPA cannot
serve, so it stops before any weight is loaded instead of failing in a
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
        raise SUPAConfigError(
            f"Speculative method {spec.method!r} (--speculative-config method) is "
            f"not served on SUPA; use one of {', '.join(SERVED_METHODS)}."
        )
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
