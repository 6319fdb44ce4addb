"""Work a step does on prompts rather than on the next token: prompt logprobs and pooling.

Both read the final hidden states of a request's prompt positions as its prefill chunks
run, so they happen in the step that computes those positions (the hidden states are
gone after it):

* prompt logprobs: the LM head over the positions of the chunk whose next token is in
  the prompt, ``ROWS_PER_HEAD_CALL`` rows at a time, so that no ``[prompt, vocab]``
  float32 tensor ever exists for a long prompt;
* pooling (embedding requests): the last position's state, the first one's, or a running
  float32 sum of all of them, handed out once the prompt's last chunk has run.

Only rows that asked do any of this (the model runner skips the call when no row of the
batch did).
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.engine.messages import PromptLogprobsChunk, RunnerOutput
from pagoda.engine.sampling_params import POOLING_METHODS
from pagoda.engine.worker.input_batch import InputBatch

# NOTE: about 64 MiB of float32 logits per call, whatever the vocabulary.
_LOGITS_PER_HEAD_CALL = 1 << 24
# Rows of logits whose statistics are taken together: 16 x 49,152 float32 is 3 MiB.
_ROWS_IN_CACHE = 16

_LAST, _MEAN, _CLS = (1 + POOLING_METHODS.index(name) for name in ("last", "mean", "cls"))


def score_prompts(model, batch: InputBatch, out: RunnerOutput | None, hidden: torch.Tensor, rows: np.ndarray,
                  computed: np.ndarray, query_lens: np.ndarray, query_start: np.ndarray) -> None:
    """Computes the step's prompt logprobs and pooled states into ``out``.

    Args:
        model: The model (its ``compute_logits``: every tensor-parallel rank calls it).
        batch: The persistent batch (rows' prompts, what they asked, the pooling sums).
        out: Where results go; None on the ranks that return nothing.
        hidden: ``[tokens, hidden]`` the step's final hidden states.
        rows: Batch row of each scheduled request, in the step's order.
        computed: Tokens each had computed before the step.
        query_lens: Tokens each runs in the step.
        query_start: Offsets of each request's tokens in ``hidden``.
    """
    num_prompt = batch.num_prompt_tokens[rows]
    num_top = batch.num_prompt_logprobs[rows]
    # The positions of a chunk whose next token is in the prompt: they score it.
    num_scored = np.minimum(query_lens, num_prompt - 1 - computed)
    for i in np.nonzero((num_top >= 0) & (num_scored > 0))[0].tolist():
        start = int(computed[i]) + 1
        row, n = int(rows[i]), int(num_scored[i])
        targets = batch.token_ids[row, start:start + n].astype(np.int64)
        chunk = _prompt_logprobs(model, hidden[query_start[i]:query_start[i] + n], targets, int(num_top[i]),
                                 batch.vocab_size)
        if out is not None:
            out.prompt_logprobs[batch.req_ids[row]] = PromptLogprobsChunk(start, targets, *chunk)
    pooling = batch.pooling[rows]
    for i in np.nonzero(pooling)[0].tolist():
        row, first, end = int(rows[i]), int(computed[i]), int(computed[i] + query_lens[i])
        prompt_end = int(num_prompt[i])
        if first >= prompt_end:
            continue  # past its prompt (an embedding request samples one token after it)
        states = hidden[query_start[i]:query_start[i] + min(end, prompt_end) - first]
        method = int(pooling[i])
        if method == _MEAN:
            total = states.sum(dim=0, dtype=torch.float32)
            previous = batch.pooled_sums.get(row)
            batch.pooled_sums[row] = total if previous is None else previous.add_(total)
        elif method == _CLS and first == 0:
            batch.pooled_sums[row] = states[0].float()
        if end < prompt_end:
            continue
        if method == _LAST:
            pooled = states[-1].float()
        else:
            pooled = batch.pooled_sums.pop(row)
            if method == _MEAN:
                pooled = pooled.div_(prompt_end)
        if out is not None:
            out.embeddings[batch.req_ids[row]] = pooled.cpu().numpy()


def _prompt_logprobs(model, hidden: torch.Tensor, targets: np.ndarray, num_top: int,
                     vocab: int) -> tuple[np.ndarray, ...]:
    """(logprobs, ranks, top ids, top logprobs) of ``targets``, one per row of ``hidden``.

    Nothing is computed over the vocabulary that the answer does not need: the logits are
    never turned into logprobs in place (a logprob is a logit minus its row's log-sum-exp),
    a rank counts the larger logits, and the statistics go over ``_ROWS_IN_CACHE`` rows at a
    time while they are in the core's cache (7x faster than whole-chunk passes; bench
    scoring).
    """
    step = max(1, _LOGITS_PER_HEAD_CALL // vocab)
    target = torch.from_numpy(targets).to(hidden.device)
    parts = []
    for a in range(0, len(targets), step):
        logits = model.compute_logits(hidden[a:a + step]).float()
        for b in range(0, len(logits), _ROWS_IN_CACHE):
            rows = logits[b:b + _ROWS_IN_CACHE]
            lse = torch.logsumexp(rows, dim=-1, keepdim=True)
            own = rows.gather(1, target[a + b:a + b + len(rows)].unsqueeze(1))
            # NOTE: the count of larger logits by float ops (sign of the clamped
            # difference): 2.5x faster than summing a boolean comparison on the CPU.
            ranks = (rows - own).clamp_(min=0).sign_().sum(dim=-1).long() + 1
            if num_top == 1:
                top_values, top_ids = rows.max(dim=-1, keepdim=True)
            elif num_top:
                top_values, top_ids = rows.topk(num_top, dim=-1)
            else:
                top_values, top_ids = own.new_empty(len(rows), 0), target.new_empty(len(rows), 0)
            parts.append(((own - lse).squeeze(1), ranks, top_ids, top_values - lse))
    return tuple(torch.cat(column).cpu().numpy() for column in zip(*parts))
