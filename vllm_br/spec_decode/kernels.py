"""Plain-torch implementations of the Triton kernels of vLLM's speculative
decoding path: the rejection sampler (vllm/v1/sample/rejection_sampler.py)
and the EAGLE / draft-model input preparation (vllm/v1/spec_decode/utils.py).

Each function takes the Triton kernel's own parameter names, so vLLM's
kernel dispatcher forwards its launch arguments by name, and does what the
whole launch grid does, vectorised over requests and tokens (no Python loop
over the batch). The Triton kernels are the specification; the tests check
these against a per-request loop written from them.
"""

from __future__ import annotations

import torch

from vllm_br import compat


def _per_request(cu_num_draft_tokens: torch.Tensor, max_spec_len: int):
    """(starts, counts, pos, valid) of a flat ragged draft batch:
    ``pos`` is [1, S] and ``valid[r, p]`` is True where request r has a
    draft token at position p."""
    cu = cu_num_draft_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    starts = cu - counts
    pos = torch.arange(max_spec_len, device=cu.device).unsqueeze(0)
    valid = pos < counts.unsqueeze(1)
    return starts, counts, pos, valid


def _gather_ragged(flat: torch.Tensor, starts: torch.Tensor, pos: torch.Tensor):
    """flat[starts[r] + p] as [B, S] (clamped in range; callers mask)."""
    if flat.numel() == 0:
        return flat.new_zeros((starts.shape[0], pos.shape[1]))
    idx = (starts.unsqueeze(1) + pos).clamp(max=flat.shape[0] - 1)
    return flat[idx]


def _write_accepted(
    output_token_ids: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    accepted: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    bonus_token_ids: torch.Tensor,
) -> None:
    """Write each selected row's tokens up to and including its first
    rejection; where nothing was rejected, the bonus token after them."""
    max_spec_len = valid.shape[1]
    rejected = (valid & ~accepted).to(torch.int32)
    rejected_before = torch.cumsum(rejected, dim=1) - rejected
    write = valid & (rejected_before == 0) & rows.unsqueeze(1)
    head = output_token_ids[:, :max_spec_len]
    head.copy_(torch.where(write, tokens.to(head.dtype), head))
    none_rejected = rejected.sum(dim=1) == 0
    bonus_col = counts.unsqueeze(1)
    current = output_token_ids.gather(1, bonus_col)
    bonus = bonus_token_ids.reshape(-1, 1).to(output_token_ids.dtype)
    take = (none_rejected & rows).unsqueeze(1)
    output_token_ids.scatter_(1, bonus_col, torch.where(take, bonus, current))


def rejection_greedy_sample_kernel(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    target_argmax_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor | None,
    max_spec_len: int,
    uniform_probs_ptr: torch.Tensor | None,
    synthetic_conditional_rates_ptr: torch.Tensor | None,
    SYNTHETIC_MODE: bool,  # noqa: N803 (the Triton kernel's names)
) -> None:
    """Greedy requests: accept drafts while they equal the target's argmax;
    the first mismatch takes the argmax, a full match adds the bonus."""
    starts, counts, pos, valid = _per_request(cu_num_draft_tokens_ptr, max_spec_len)
    draft = _gather_ragged(draft_token_ids_ptr, starts, pos)
    target = _gather_ragged(target_argmax_ptr, starts, pos)
    if SYNTHETIC_MODE:
        uniform = _gather_ragged(uniform_probs_ptr, starts, pos)
        rate = synthetic_conditional_rates_ptr[:max_spec_len].unsqueeze(0)
        accepted = (uniform < rate) & (draft >= 0)
        tokens = torch.where(accepted, draft.to(target.dtype), target)
    else:
        accepted = draft.to(target.dtype) == target
        tokens = target
    rows = (
        torch.ones_like(counts, dtype=torch.bool)
        if is_greedy_ptr is None
        else is_greedy_ptr.to(torch.bool)
    )
    _write_accepted(
        output_token_ids_ptr, rows, valid, accepted, tokens, counts, bonus_token_ids_ptr
    )


def rejection_random_sample_kernel(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    recovered_token_ids_ptr: torch.Tensor,
    uniform_probs_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor,
    max_spec_len: int,
    vocab_size: int,
    synthetic_conditional_rates_ptr: torch.Tensor | None,
    NO_DRAFT_PROBS: bool,  # noqa: N803
    SYNTHETIC_MODE: bool,  # noqa: N803
) -> None:
    """Random requests: accept draft token d with probability
    min(1, p_target(d) / p_draft(d)) (p_draft = 1 for draft-free proposers);
    the first rejection takes the recovered token, a full acceptance adds the
    bonus."""
    starts, counts, pos, valid = _per_request(cu_num_draft_tokens_ptr, max_spec_len)
    draft = _gather_ragged(draft_token_ids_ptr, starts, pos).to(torch.int64)
    uniform = _gather_ragged(uniform_probs_ptr, starts, pos)
    if SYNTHETIC_MODE:
        rate = synthetic_conditional_rates_ptr[:max_spec_len].unsqueeze(0)
        accepted = uniform < rate
    else:
        token_idx = (starts.unsqueeze(1) + pos).clamp(
            max=max(target_probs_ptr.shape[0] - 1, 0)
        )
        column = draft.clamp(min=0)
        target_prob = target_probs_ptr[token_idx, column]
        if NO_DRAFT_PROBS:
            accepted = target_prob >= uniform
        else:
            draft_prob = draft_probs_ptr[token_idx, column]
            # A zero draft probability is rejected (as the kernel does, no NaN).
            accepted = (draft_prob > 0) & (target_prob / draft_prob >= uniform)
    # -1 pads draft ids that must be rejected.
    accepted = accepted & (draft >= 0)
    recovered = _gather_ragged(recovered_token_ids_ptr, starts, pos).to(torch.int64)
    tokens = torch.where(accepted, draft, recovered)
    rows = ~is_greedy_ptr.to(torch.bool)
    _write_accepted(
        output_token_ids_ptr, rows, valid, accepted, tokens, counts, bonus_token_ids_ptr
    )


def expand_kernel(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS: int,  # noqa: N803
) -> None:
    """output = each request's value repeated over its tokens, with
    ``replace_from`` values replaced by ``replace_to``."""
    cu = cu_num_tokens_ptr.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1)).clamp(max=MAX_NUM_TOKENS)
    values = torch.where(
        input_ptr == replace_from,
        torch.as_tensor(replace_to, dtype=input_ptr.dtype, device=input_ptr.device),
        input_ptr,
    )
    output_ptr.copy_(
        torch.repeat_interleave(values, counts, output_size=output_ptr.shape[0])
    )


def sample_recovered_tokens_kernel(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    inv_q_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int,  # noqa: N803
    NO_DRAFT_PROBS: bool,  # noqa: N803
    USE_FP64_GUMBEL: bool,  # noqa: N803
) -> None:
    """Recovered token of each draft position: a sample of
    max(p_target - p_draft, 0) (p_target without the draft token for
    draft-free proposers), drawn as argmax(prob / q) with q ~ Exp(1) per
    request (the exponential race; ties go to the lowest id as in the
    kernel)."""
    num_tokens = output_token_ids_ptr.shape[0]
    if num_tokens == 0:
        return
    cu = cu_num_draft_tokens_ptr.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    request_of_token = torch.repeat_interleave(
        torch.arange(cu.shape[0], device=cu.device), counts, output_size=num_tokens
    )
    target = target_probs_ptr[:num_tokens]
    if NO_DRAFT_PROBS:
        # A padded draft (-1) masks nothing.
        drafted = draft_token_ids_ptr[:num_tokens].to(torch.int64).unsqueeze(1)
        vocab_ids = torch.arange(target.shape[1], device=target.device)
        prob = target.masked_fill(vocab_ids == drafted, 0.0)
    else:
        prob = (target - draft_probs_ptr[:num_tokens]).clamp(min=0.0)
    score = prob.to(inv_q_ptr.dtype) * inv_q_ptr[request_of_token]
    recovered = score.argmax(dim=1).clamp(max=vocab_size - 1)
    output_token_ids_ptr.copy_(recovered.to(output_token_ids_ptr.dtype))


def eagle_step_slot_mapping_metadata_kernel(
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    seq_lens_ptr: torch.Tensor,
    out_clamped_positions_ptr: torch.Tensor,
    out_slot_mapping_ptr: torch.Tensor,
    block_size: int,
    max_model_len: int,
    n_blocks_per_req: int,
    PAD_ID: int,  # noqa: N803
    batch_size: int,
) -> None:
    """One drafting step: position + 1 (0 past max_model_len), its slot, and
    seq_len + 1 (1 past max_model_len); padding slots beyond the batch get
    PAD_ID (``out_slot_mapping`` is exactly the padded batch long)."""
    batch_size = int(batch_size)
    position = positions_ptr[:batch_size] + 1
    exceeds = position >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(position), position)
    block_number = (clamped // block_size).clamp(max=n_blocks_per_req - 1)
    rows = torch.arange(batch_size, device=position.device)
    block_id = block_table_ptr[rows, block_number].to(torch.int64)
    slot = block_id * block_size + clamped % block_size
    slot = torch.where(exceeds, torch.full_like(slot, PAD_ID), slot)
    seq_len = seq_lens_ptr[:batch_size]
    new_seq_len = torch.where(exceeds, torch.ones_like(seq_len), seq_len + 1)
    out_clamped_positions_ptr[:batch_size] = clamped
    out_slot_mapping_ptr[:batch_size] = slot
    out_slot_mapping_ptr[batch_size:] = PAD_ID
    seq_lens_ptr[:batch_size] = new_seq_len.clamp(max=max_model_len)


def eagle_prepare_inputs_padded_kernel(
    cu_num_draft_tokens_ptr: torch.Tensor,
    valid_sampled_tokens_count_ptr: torch.Tensor,
    query_start_loc_gpu_ptr: torch.Tensor,
    token_indices_to_sample_ptr: torch.Tensor,
    num_rejected_tokens_gpu_ptr: torch.Tensor,
    num_reqs: int,
) -> None:
    """Per request: rejected = drafts + 1 - valid sampled tokens (0 without
    drafts), and the index to sample = its last query token - rejected."""
    num_reqs = int(num_reqs)
    cu = cu_num_draft_tokens_ptr[:num_reqs].to(torch.int64)
    num_draft = torch.diff(cu, prepend=cu.new_zeros(1))
    valid = valid_sampled_tokens_count_ptr[:num_reqs].to(torch.int64)
    rejected = torch.where(num_draft > 0, num_draft + 1 - valid, 0)
    last_token = query_start_loc_gpu_ptr[1 : num_reqs + 1].to(torch.int64) - 1
    token_indices_to_sample_ptr[:num_reqs] = last_token - rejected
    num_rejected_tokens_gpu_ptr[:num_reqs] = rejected


def eagle_prepare_next_token_padded_kernel(
    sampled_token_ids_ptr: torch.Tensor,
    discard_request_mask_ptr: torch.Tensor,
    backup_next_token_ids_ptr: torch.Tensor,
    next_token_ids_ptr: torch.Tensor,
    valid_sampled_tokens_count_ptr: torch.Tensor,
    vocab_size: int,
    num_sampled_tokens_per_req: int,
    num_reqs: int,
    stride_sampled_token_ids: int,
    BLOCK_SIZE_TOKENS: int,  # noqa: N803
) -> None:
    """Per request: the number of valid sampled tokens (not -1, in the
    vocabulary) and the last of them as the next token; the backup token
    where there is none or the request is discarded (count 0)."""
    num_reqs = int(num_reqs)
    tokens = sampled_token_ids_ptr[:num_reqs, :num_sampled_tokens_per_req]
    is_valid = (tokens != -1) & (tokens < vocab_size)
    count = is_valid.sum(dim=1)
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    last_index = torch.where(is_valid, columns, -1).amax(dim=1, keepdim=True)
    last_token = tokens.gather(1, last_index.clamp(min=0)).squeeze(1)
    discarded = discard_request_mask_ptr[:num_reqs].to(torch.bool)
    backup = backup_next_token_ids_ptr[:num_reqs]
    use_last = (count > 0) & ~discarded
    next_token_ids_ptr[:num_reqs] = torch.where(
        use_last, last_token.to(backup.dtype), backup
    )
    valid_sampled_tokens_count_ptr[:num_reqs] = torch.where(
        discarded, torch.zeros_like(count), count
    )


def copy_and_expand_eagle_inputs_kernel(
    target_token_ids_ptr: torch.Tensor,
    target_positions_ptr: torch.Tensor,
    next_token_ids_ptr: torch.Tensor,
    out_input_ids_ptr: torch.Tensor,
    out_positions_ptr: torch.Tensor,
    out_is_rejected_token_mask_ptr: torch.Tensor,
    out_is_masked_token_mask_ptr: torch.Tensor,
    out_new_token_indices_ptr: torch.Tensor,
    out_hidden_state_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    query_end_loc_ptr: torch.Tensor,
    padding_token_id: int,
    parallel_drafting_token_id: int,
    total_input_tokens: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool,
    BLOCK_SIZE_TOKENS: int,  # noqa: N803
) -> None:
    """The drafter's inputs from the target's, per request: its valid tokens
    (shifted by one for EAGLE), the bonus token, the parallel-drafting slots
    and its rejected slots (padding), with positions counting on from the
    request's first position; plus where the new tokens and the target's
    hidden states land."""
    batch_size = query_end_loc_ptr.shape[0]
    if batch_size == 0:
        return
    device = query_start_loc_ptr.device
    total_input_tokens = int(total_input_tokens)
    slots = int(num_padding_slots_per_request)
    shift = 1 if shift_input_ids else 0
    requests = torch.arange(batch_size, device=device)
    start = query_start_loc_ptr[:batch_size].to(torch.int64)
    next_start = query_start_loc_ptr[1 : batch_size + 1].to(torch.int64)
    end = query_end_loc_ptr.to(torch.int64)
    num_valid = end - start + 1 - shift
    out_start = start + requests * (slots - shift)
    num_rejected = next_start - end - 1
    num_out = num_valid + slots + num_rejected
    total_out = total_input_tokens + batch_size * (slots - shift)

    request = torch.repeat_interleave(requests, num_out, output_size=total_out)
    first_out = torch.cumsum(num_out, 0) - num_out
    j = torch.arange(total_out, device=device) - first_out[request]
    valid_r, start_r = num_valid[request], start[request]
    is_valid = j < valid_r
    is_bonus = j == valid_r
    is_parallel = (j > valid_r) & (j < valid_r + slots)
    is_rejected = j >= valid_r + slots

    source = (start_r + shift + j).clamp(max=total_input_tokens - 1)
    ids = torch.where(is_valid, target_token_ids_ptr[source].to(torch.int64), 0)
    ids = torch.where(is_bonus, next_token_ids_ptr[request].to(torch.int64), ids)
    ids = torch.where(is_parallel, parallel_drafting_token_id, ids)
    ids = torch.where(is_rejected, padding_token_id, ids)
    positions = target_positions_ptr[start_r].to(torch.int64) + j
    positions = torch.where(is_rejected, 0, positions)

    out_idx = out_start[request] + j
    out_input_ids_ptr[out_idx] = ids.to(out_input_ids_ptr.dtype)
    out_positions_ptr[out_idx] = positions.to(out_positions_ptr.dtype)
    out_is_rejected_token_mask_ptr[out_idx] = is_rejected.to(
        out_is_rejected_token_mask_ptr.dtype
    )
    out_is_masked_token_mask_ptr[out_idx] = is_parallel.to(
        out_is_masked_token_mask_ptr.dtype
    )
    new_tokens = (out_start + num_valid).unsqueeze(1) + torch.arange(
        slots, device=device
    )
    out_new_token_indices_ptr[: batch_size * slots] = new_tokens.reshape(-1).to(
        out_new_token_indices_ptr.dtype
    )
    if shift_input_ids:
        # Hidden states are not shifted: input token k of a request goes to
        # output slot k of the same request.
        input_request = torch.repeat_interleave(
            requests, next_start - start, output_size=total_input_tokens
        )
        source_idx = torch.arange(total_input_tokens, device=device)
        out_hidden_state_mapping_ptr[:total_input_tokens] = (
            out_start[input_request] + source_idx - start[input_request]
        ).to(out_hidden_state_mapping_ptr.dtype)


def kernel_overrides() -> dict[str, object]:
    """vLLM's fully qualified kernel name -> the implementation here."""
    here = globals()
    return {
        f"{module}.{name}": here[name]
        for module, names in compat.SPEC_DECODE_KERNELS.items()
        for name in names
    }
