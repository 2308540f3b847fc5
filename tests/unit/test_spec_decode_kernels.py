"""The plugin's plain-torch versions of vLLM's speculative-decoding Triton
kernels (vllm_br/spec_decode/kernels.py), called through vLLM's own
launchers once registered. Each is compared with a per-request loop written
from the Triton kernel (the references below), on ragged batches with empty
requests, padded (-1) drafts, greedy and random rows; and the rejection
sampler as a whole keeps the target distribution (chi-square tests)."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_br import compat
from vllm_br.spec_decode import kernels

PLACEHOLDER = -1


@pytest.fixture(scope="module", autouse=True)
def overrides_installed():
    from vllm_br.worker.kernel_overrides import register_kernel_overrides

    register_kernel_overrides()


def test_every_spec_decode_kernel_is_replaced_and_bound_by_name():
    import importlib

    from vllm.triton_utils.dispatcher import KernelOverride

    replaced = 0
    for module_name, names in compat.SPEC_DECODE_KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            wrapper = getattr(module, name)
            assert isinstance(wrapper, KernelOverride), name
            assert wrapper.func is getattr(kernels, name)
            # Same parameter names as the Triton kernel: launches bind by name.
            assert wrapper._forward_by_name, name
            replaced += 1
    assert replaced == 8


# ---- references: the Triton kernels, one program per request ----------------
def _bounds(cu, r):
    start = 0 if r == 0 else int(cu[r - 1])
    return start, int(cu[r]) - start


def _ref_requests(out, cu, bonus, skip, decide):
    """The kernels' shared loop: per request not skipped, each draft
    position's (token, rejected) from ``decide(token_index, position)`` up
    to the first rejection; the bonus token after a full acceptance."""
    for r in range(out.shape[0]):
        if skip(r):
            continue
        start, n = _bounds(cu, r)
        rejected = False
        for p in range(n):
            if rejected:
                break
            out[r, p], rejected = decide(start + p, p)
        if not rejected:
            out[r, n] = int(bonus[r])


def ref_greedy(out, cu, draft, argmax, bonus, is_greedy, uniform, rates):
    def decide(i, p):
        d, t = int(draft[i]), int(argmax[i])
        if rates is not None:
            accepted = float(uniform[i]) < float(rates[p]) and d >= 0
            return (d if accepted else t), not accepted
        return t, d != t

    def skip(r):
        return is_greedy is not None and not bool(is_greedy[r])

    _ref_requests(out, cu, bonus, skip, decide)


def ref_random(out, cu, draft, dprobs, tprobs, bonus, recovered, uniform, is_greedy):
    def decide(i, p):
        d = int(draft[i])
        if d < 0:
            accepted = False
        else:
            dp = 1.0 if dprobs is None else float(dprobs[i, d])
            accepted = dp > 0 and float(tprobs[i, d]) / dp >= float(uniform[i])
        return (d, False) if accepted else (int(recovered[i]), True)

    _ref_requests(out, cu, bonus, lambda r: bool(is_greedy[r]), decide)


def ref_recovered(cu, draft, dprobs, tprobs, inv_q):
    result = []
    for r in range(cu.shape[0]):
        start, n = _bounds(cu, r)
        for p in range(n):
            i = start + p
            if dprobs is None:
                prob = tprobs[i].clone()
                if int(draft[i]) >= 0:
                    prob[int(draft[i])] = 0
            else:
                prob = (tprobs[i] - dprobs[i]).clamp(min=0)
            score = [float(x) * float(q) for x, q in zip(prob, inv_q[r], strict=True)]
            result.append(score.index(max(score)))  # first maximum
    return result


# ---- random ragged batches --------------------------------------------------
def _batch(seed, max_spec_len=4, batch=7, vocab=5):
    rng = random.Random(seed)
    counts = [
        rng.choice([0, 1, max_spec_len, rng.randint(0, max_spec_len)])
        for _ in range(batch)
    ]
    num_tokens = sum(counts)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, vocab, (num_tokens,), generator=gen, dtype=torch.int32)
    if num_tokens:
        draft[rng.randrange(num_tokens)] = -1  # a padded draft
    return counts, cu, draft, gen


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("synthetic", [False, True])
def test_greedy_rejection_matches_reference(seed, synthetic):
    from vllm.v1.sample.rejection_sampler import _rejection_greedy_sample

    counts, cu, draft, gen = _batch(seed)
    num_tokens, batch, spec = len(draft), len(counts), 4
    argmax = torch.randint(0, 5, (num_tokens,), generator=gen)
    # Every other draft made to agree with the target, so runs of accepts occur.
    agree = torch.rand(num_tokens, generator=gen) < 0.6
    draft = torch.where(agree & (draft >= 0), argmax.to(torch.int32), draft)
    bonus = torch.randint(0, 5, (batch, 1), generator=gen)
    is_greedy = None if seed % 2 else torch.rand(batch, generator=gen) < 0.7
    uniform = torch.rand(num_tokens, dtype=torch.float64, generator=gen)
    rates = torch.tensor([0.9, 0.6, 0.4, 0.2]) if synthetic else None
    got = torch.full((batch, spec + 1), PLACEHOLDER, dtype=torch.int32)
    want = got.clone()
    _rejection_greedy_sample(
        got, cu, draft, argmax, bonus, is_greedy, spec,
        uniform if synthetic else None, rates,
    )  # fmt: skip
    ref_greedy(want, cu, draft, argmax, bonus, is_greedy, uniform, rates)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_random_rejection_matches_reference(seed, with_draft_probs):
    from vllm.v1.sample.rejection_sampler import _rejection_random_sample

    vocab = 5
    counts, cu, draft, gen = _batch(seed, vocab=vocab)
    num_tokens, batch, spec = len(draft), len(counts), 4
    tprobs = torch.rand(num_tokens, vocab, generator=gen).softmax(-1)
    dprobs = torch.rand(num_tokens, vocab, generator=gen).softmax(-1)
    if num_tokens:
        dprobs[0] = 0.0  # a zero draft probability is a rejection, not a NaN
    dprobs = dprobs if with_draft_probs else None
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen)
    recovered = torch.randint(0, vocab, (num_tokens,), generator=gen, dtype=torch.int32)
    uniform = torch.rand(num_tokens, dtype=torch.float64, generator=gen)
    is_greedy = torch.rand(batch, generator=gen) < 0.3
    got = torch.full((batch, spec + 1), PLACEHOLDER, dtype=torch.int32)
    want = got.clone()
    _rejection_random_sample(
        got, cu, draft, dprobs, tprobs, bonus, recovered, uniform, is_greedy, spec, None
    )
    ref_random(want, cu, draft, dprobs, tprobs, bonus, recovered, uniform, is_greedy)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_batch_to_tokens(dtype):
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    x = torch.tensor([3, -1, 5, 7]).to(dtype)
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=9)
    assert got.tolist() == [3, 3, 5, 5, 5, 7]
    got = expand_batch_to_tokens(x, cu, 6, replace_from=5, replace_to=1)
    assert got.tolist() == [3, 3, 1, 1, 1, 7]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("fp64", [False, True])
def test_recovered_tokens_match_reference(seed, with_draft_probs, fp64):
    from vllm.v1.sample.rejection_sampler import _sample_recovered_tokens

    vocab = 11
    counts, cu, draft, gen = _batch(seed, vocab=vocab)  # one draft is -1
    num_tokens = len(draft)
    tprobs = torch.rand(num_tokens, vocab, generator=gen).softmax(-1)
    dprobs = torch.rand(num_tokens, vocab, generator=gen).softmax(-1)
    dprobs = dprobs if with_draft_probs else None
    q = torch.empty(len(counts), vocab, dtype=torch.float64 if fp64 else torch.float32)
    q.exponential_(generator=gen)
    inv_q = q.reciprocal()
    if num_tokens and seed == 0:
        # Ties go to the lowest id, as the kernel's argmax does.
        tprobs[0] = 1.0 / vocab
        inv_q[0] = 1.0
        if dprobs is not None:
            dprobs[0] = 0.0
    got = torch.empty_like(draft)
    _sample_recovered_tokens(got, cu, draft, dprobs, tprobs, inv_q, max_spec_len=4)
    assert got.tolist() == ref_recovered(cu, draft, dprobs, tprobs, inv_q)


# ---- EAGLE / draft-model input preparation ----------------------------------
def test_eagle_step_slot_mapping_and_metadata():
    from vllm.v1.spec_decode.utils import (
        PADDING_SLOT_ID,
        eagle_step_update_slot_mapping_and_metadata,
    )

    block, max_len = 4, 12
    positions = torch.tensor([0, 3, 10, 11], dtype=torch.int64)
    table = torch.tensor(
        [[5, 6, 7], [1, 2, 3], [9, 8, 4], [0, 2, 6]], dtype=torch.int32
    )
    seq_lens = torch.tensor([1, 4, 11, 12], dtype=torch.int32)
    out_pos = torch.empty(4, dtype=torch.int64)
    out_slot = torch.full((6,), 99, dtype=torch.int64)
    eagle_step_update_slot_mapping_and_metadata(
        positions,
        table,
        seq_lens,
        block,
        max_len,
        out_pos,
        out_slot,
        input_batch_size=6,
    )
    # 0 -> 1 (block 5); 3 -> 4 (second block); 10 -> 11 (last block);
    # 11 -> 12 = max_model_len: position 0, padding slot, seq_len 1.
    assert out_pos.tolist() == [1, 4, 11, 0]
    assert out_slot.tolist() == [21, 8, 19, PADDING_SLOT_ID] + [PADDING_SLOT_ID] * 2
    assert seq_lens.tolist() == [2, 5, 12, 1]


def test_eagle_prepare_inputs_padded():
    from vllm.v1.spec_decode.utils import _eagle_prepare_inputs_padded

    cu_draft = torch.tensor([3, 3, 5], dtype=torch.int32)  # 3, 0, 2 drafts
    valid = torch.tensor([2, 1, 3], dtype=torch.int32)  # 1, -, 2 accepted
    qsl = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    indices = torch.full((3,), 99, dtype=torch.int32)
    rejected = torch.full((3,), 99, dtype=torch.int32)
    _eagle_prepare_inputs_padded(cu_draft, valid, qsl, indices, rejected, 3)
    assert rejected.tolist() == [2, 0, 0]
    assert indices.tolist() == [1, 4, 7]


def test_eagle_prepare_next_token_padded():
    from vllm.v1.spec_decode.utils import _eagle_prepare_next_token_padded

    sampled = torch.tensor(
        [
            [4, 7, -1, -1],
            [-1, -1, -1, -1],
            [1, 2, 3, 9],
            [5, 600, -1, -1],
            [8, -1, -1, -1],
        ],
        dtype=torch.int32,
    )
    discard = torch.tensor([False, False, False, False, True])
    backup = torch.tensor([10, 11, 12, 13, 14], dtype=torch.int32)
    next_ids = torch.full((5,), 99, dtype=torch.int32)
    count = torch.full((5,), 99, dtype=torch.int32)
    _eagle_prepare_next_token_padded(
        sampled, discard, backup, next_ids, count, 512, 4, 5, sampled.stride(0),
        BLOCK_SIZE_TOKENS=4,
    )  # fmt: skip
    # Out-of-vocabulary ids (600) are not valid; a discarded request takes its
    # backup with a count of 0.
    assert next_ids.tolist() == [7, 11, 9, 5, 14]
    assert count.tolist() == [2, 0, 4, 1, 0]


def ref_copy_and_expand(
    ids, pos, next_ids, qsl, qel, pad_id, par_id, total, slots, shift, n_out
):
    out = dict(
        ids=[None] * n_out, pos=[None] * n_out, rej=[None] * n_out,
        msk=[None] * n_out, new=[None] * (len(qel) * slots), hid=[None] * total,
    )  # fmt: skip
    for r in range(len(qel)):
        qs, qn, qe = int(qsl[r]), int(qsl[r + 1]), int(qel[r])
        n_valid = qe - qs + (0 if shift else 1)
        out_start = qs + r * (slots - 1 if shift else slots)
        n_rej = qn - qe - 1
        for j in range(n_valid + slots + n_rej):
            o = out_start + j
            if j < n_valid:
                tok = int(ids[min(qs + (1 if shift else 0) + j, total - 1)])
            elif j == n_valid:
                tok = int(next_ids[r])
            elif j < n_valid + slots:
                tok = par_id
            else:
                tok = pad_id
            rejected = j >= n_valid + slots
            out["ids"][o] = tok
            out["pos"][o] = 0 if rejected else int(pos[qs]) + j
            out["rej"][o] = rejected
            out["msk"][o] = n_valid < j < n_valid + slots
            if n_valid <= j < n_valid + slots:
                out["new"][r * slots + j - n_valid] = o
            if shift and j < qn - qs:
                out["hid"][qs + j] = o
    return out


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("slots", [1, 3])
def test_copy_and_expand_eagle_inputs(shift, slots):
    from vllm.v1.spec_decode.utils import _copy_and_expand_eagle_inputs

    # Three requests of 4, 1 and 3 tokens; the first and last had 1 and 2
    # rejected drafts.
    qsl = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    qel = torch.tensor([2, 4, 5], dtype=torch.int32)
    total = 8
    ids = torch.arange(100, 100 + total, dtype=torch.int32)
    pos = torch.tensor([20, 21, 22, 23, 0, 7, 8, 9], dtype=torch.int64)
    next_ids = torch.tensor([50, 51, 52], dtype=torch.int32)
    n_out = total + 3 * (slots - (1 if shift else 0))
    got = dict(
        ids=torch.full((n_out + 4,), -7, dtype=torch.int32),
        pos=torch.full((n_out + 4,), -7, dtype=torch.int64),
        rej=torch.zeros(n_out + 4, dtype=torch.bool),
        msk=torch.zeros(n_out + 4, dtype=torch.bool),
        new=torch.full((3 * slots,), -7, dtype=torch.int32),
        hid=torch.full((total,), -7, dtype=torch.int32),
    )
    _copy_and_expand_eagle_inputs(
        target_token_ids_ptr=ids, target_positions_ptr=pos, next_token_ids_ptr=next_ids,
        out_input_ids_ptr=got["ids"], out_positions_ptr=got["pos"],
        out_is_rejected_token_mask_ptr=got["rej"], out_is_masked_token_mask_ptr=got["msk"],
        out_new_token_indices_ptr=got["new"], out_hidden_state_mapping_ptr=got["hid"],
        query_start_loc_ptr=qsl, query_end_loc_ptr=qel, padding_token_id=0,
        parallel_drafting_token_id=77, total_input_tokens=total,
        num_padding_slots_per_request=slots, shift_input_ids=shift,
        BLOCK_SIZE_TOKENS=4, batch_size=3, num_blocks=2,
    )  # fmt: skip
    want = ref_copy_and_expand(
        ids, pos, next_ids, qsl, qel, 0, 77, total, slots, shift, n_out
    )
    for key in ("ids", "pos", "rej", "msk"):
        assert got[key][:n_out].tolist() == want[key], key
        assert got[key][n_out:].tolist() == [got[key][n_out].item()] * 4  # untouched
    assert got["new"].tolist() == want["new"]
    if shift:
        assert got["hid"].tolist() == want["hid"]


# ---- the rejection sampler keeps the target distribution -------------------
def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * counts.sum()
    return float(chisquare(counts[keep].double(), expected.double()).pvalue)


def _sampling_metadata(batch: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(batch),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_sampler_keeps_the_target_distribution(with_draft_probs):
    """Speculative sampling's guarantee, through vLLM's rejection_sample on
    the plugin's kernels: with drafts drawn from q, every emitted first
    token is distributed as the target p; and a rejected draft is replaced
    by a sample of max(p - q, 0) (of p without the draft token for
    draft-free proposers). 40000 independent requests, fixed seed."""
    from vllm.v1.sample.rejection_sampler import rejection_sample

    torch.manual_seed(0)
    vocab, batch = 8, 40_000
    p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0])
    q = torch.tensor([0.05, 0.10, 0.30, 0.05, 0.20, 0.10, 0.10, 0.10])
    if with_draft_probs:
        draft = torch.multinomial(q, batch, replacement=True).to(torch.int32)
        draft_probs = q.expand(batch, vocab).contiguous()
    else:
        # An n-gram-like proposer: always token 2, no probabilities.
        draft = torch.full((batch,), 2, dtype=torch.int32)
        draft_probs = None
    logits = p.clamp(min=1e-30).log().expand(batch, vocab).contiguous()
    out = rejection_sample(
        draft,
        [1] * batch,
        1,
        torch.arange(1, batch + 1, dtype=torch.int32),
        draft_probs,
        logits,
        torch.zeros(batch, 1, dtype=torch.int64),  # bonus token 0
        _sampling_metadata(batch),
    )
    first = out[:, 0].long()
    assert _chi_square_p(torch.bincount(first, minlength=vocab), p) > 1e-3

    rejected = first != draft.long()
    assert (out[~rejected, 1] == 0).all() and (out[rejected, 1] == PLACEHOLDER).all()
    if with_draft_probs:
        residual = (p - q).clamp(min=0)
    else:
        residual = p.clone()
        residual[2] = 0.0
    residual = residual / residual.sum()
    recovered = torch.bincount(first[rejected], minlength=vocab)
    assert _chi_square_p(recovered, residual) > 1e-3
    # The acceptance rate is sum(min(p, q)) (p[2] for the fixed draft).
    accept = (p.minimum(q).sum() if with_draft_probs else p[2]).item()
    assert abs((~rejected).float().mean().item() - accept) < 0.01
