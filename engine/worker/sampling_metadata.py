"""What the sampler reads of one step: per-row sampling tensors, gathered by the input batch.

A leaf module: the input batch builds :class:`SamplingMetadata`, the sampler consumes it, and
neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# NOTE: like vLLM, temperatures this small are treated as greedy: dividing by them
# overflows or makes sampling numerically meaningless.
greedy_temperature = 1e-5
MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step, per-row sampling tensors; optional parts are None when unused.

    Attributes:
        num_reqs: Number of rows ``B``.
        vocab_size: Width ``V`` of the logits.
        all_greedy: Every row is greedy: no temperature, filtering or noise.
        all_random: No row is greedy: no argmax pass.
        temperature: ``[B]`` float32, 1.0 on greedy rows; None when all greedy.
        greedy_mask: ``[B]`` bool, True on greedy rows; None unless the batch is mixed.
        top_k: ``[B]`` int64, ``V`` where disabled; None when no random row uses it.
        max_top_k: The largest of ``top_k``, known on the host (reading it from the
            device would wait for the GPU).
        top_p: ``[B]`` float32, 1.0 where disabled; None when no random row uses it.
        min_p: ``[B]`` float32, 0.0 where disabled; None when no random row uses it.
        seeded_rows: ``(row, step_seed)`` for random rows with a seed; ``step_seed``
            mixes the request seed with its number of output tokens.
        max_num_logprobs: Largest ``logprobs`` requested in the batch; None if none.
        edit_rows: ``[N]`` int64 row of each (row, token) whose logit changes: min_tokens'
            suppressed EOS and stop ids, logit_bias, bad words; None when no row has any.
        edit_token_ids: ``[N]`` int64 the token of each.
        edit_values: ``[N]`` float32 what is added to its logit (-inf: suppressed).
        allowed_rows: ``[R]`` int64 rows limited to their allowed_token_ids; None when none is.
        allowed_token_ids: ``[M]`` int64 the allowed tokens, and ``allowed_of`` ``[M]`` the
            index into ``allowed_rows`` of the row each belongs to.
        repetition_penalties: ``[B]`` float32; None when no row uses any penalty.
        presence_penalties: ``[B]`` float32; None when no row uses any penalty.
        frequency_penalties: ``[B]`` float32; None when no row uses any penalty.
        output_counts: ``[B, V]`` float32 count of each token in each row's output; None
            when no penalty.
        prompt_mask: ``[B, V]`` bool, True for tokens in the row's prompt; None unless
            some row has a repetition penalty.
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None
    greedy_mask: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeded_rows: list[tuple[int, int]] | None = None
    max_num_logprobs: int | None = None
    edit_rows: torch.Tensor | None = None
    edit_token_ids: torch.Tensor | None = None
    edit_values: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None
    allowed_token_ids: torch.Tensor | None = None
    allowed_of: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None


def mix_seed(seed: int, step: int) -> int:
    """Mixes a request seed and its output length into a 64-bit generator seed (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)
