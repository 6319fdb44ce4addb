"""Turns one step's logits into sampled token ids, batched over requests.

The model worker gathers a :class:`~pagoda.engine.worker.sampling_metadata.SamplingMetadata`
from its input batch once per step for the rows that sample, then calls :class:`Sampler` on
the ``[B, V]`` logits. Everything is vectorized over the
batch; the only per-row Python loop draws the noise of seeded rows, so that a seeded
request is reproducible whatever it is batched with.

Order of operations (as in vLLM V1):
    1. logprobs from the raw logits (``log_softmax`` before any penalty or temperature);
    2. logit edits: EOS and stop token ids of rows still short of ``min_tokens`` get -inf, as do
       bad words' last tokens; ``logit_bias`` is added; rows with ``allowed_token_ids`` keep those
       only;
    3. repetition, presence and frequency penalties;
    4. greedy rows: argmax of the penalized logits;
    5. random rows: temperature, top-k, top-p, min-p, then exponential-race sampling
       (``argmax(probs / Exponential(1) noise)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.engine.worker.sampling_metadata import MASK64, SamplingMetadata

@dataclass(slots=True)
class SamplerOutput:
    """What one step sampled.

    Attributes:
        sampled_token_ids: ``[B]`` int64.
        logprobs: ``[B, 1+K]`` float32 raw logprobs: the sampled token's first, then the
            top ``K`` in descending order, ``K`` being the batch's largest ``logprobs``.
            Rows that asked for fewer ignore the extra columns. None when no row asked.
        logprob_token_ids: ``[B, 1+K]`` int64 token ids matching ``logprobs``.
    """

    sampled_token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None


class Sampler:
    """Samples one token per row; stateless apart from its random generators.

    Args:
        seed: Seed of the generator used by unseeded rows; None seeds it from the OS.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Samples from ``[B, V]`` logits of any float dtype (computed in float32).

        Args:
            logits: Raw model logits, one row per request; not modified.
            metadata: This step's :class:`SamplingMetadata`.

        Returns:
            The sampled ids, plus logprobs when some row asked for them.
        """
        md = metadata
        assert logits.shape == (md.num_reqs, md.vocab_size), (logits.shape, md.num_reqs, md.vocab_size)
        if self.plain_greedy(md):
            return SamplerOutput(sampled_token_ids=_argmax(logits))  # the common path
        no_edits = md.edit_rows is None and md.allowed_rows is None and md.repetition_penalties is None
        # NOTE: copy, so the in-place edits below never touch the caller's tensor.
        logits = logits.to(torch.float32, copy=not no_edits or not md.all_greedy)
        raw_logprobs = None if md.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if md.edit_rows is not None:
            logits.index_put_((md.edit_rows, md.edit_token_ids), md.edit_values, accumulate=True)
        if md.allowed_rows is not None:
            keep = torch.zeros(len(md.allowed_rows), md.vocab_size, dtype=torch.bool, device=logits.device)
            keep[md.allowed_of, md.allowed_token_ids] = True
            logits[md.allowed_rows] = logits[md.allowed_rows].masked_fill(~keep, float("-inf"))
        if md.repetition_penalties is not None:
            _apply_penalties(logits, md)

        greedy = None if md.all_random else _argmax(logits)
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample(logits, md)
            if greedy is not None:
                sampled = torch.where(md.greedy_mask, greedy, sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        top = raw_logprobs.topk(md.max_num_logprobs, dim=-1)
        ids = torch.cat([sampled.unsqueeze(1), top.indices], dim=1)
        values = torch.cat([raw_logprobs.gather(1, sampled.unsqueeze(1)), top.values], dim=1)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=values, logprob_token_ids=ids)

    @staticmethod
    def plain_greedy(md: SamplingMetadata) -> bool:
        """Whether every row takes its largest logit as it comes: greedy, with no penalties,
        no logit edits and no logprobs (the model may then pick the tokens itself)."""
        return (md.all_greedy and md.edit_rows is None and md.allowed_rows is None and md.repetition_penalties is None
                and md.max_num_logprobs is None)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, filters and the exponential race; edits ``logits`` in place."""
        logits.div_(md.temperature.unsqueeze(1))
        logits = _apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
            probs.masked_fill_(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        seeded = md.seeded_rows or []
        if len(seeded) < md.num_reqs:
            noise.exponential_(generator=self._generator(self._default_generators, probs.device, self._seed))
        if seeded:
            gen = self._generator(self._seeded_generators, probs.device, 0)
            for row, step_seed in seeded:
                gen.manual_seed(step_seed)
                noise[row].exponential_(generator=gen)
        # NOTE: exponential_ may return exactly 0; clamping keeps 0/0 from making NaNs.
        return probs.div_(noise.clamp_(min=1e-20)).argmax(dim=-1)

    @staticmethod
    def _generator(cache: dict[torch.device, torch.Generator], device: torch.device, seed: int | None) -> torch.Generator:
        gen = cache.get(device)
        if gen is None:
            gen = cache[device] = torch.Generator(device=device)
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(seed & MASK64)
        return gen


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit (the first one on ties), in any float dtype.

    NOTE: max(dim).indices is the same answer as argmax, and on the CPU it was 2.6-4.6x
    faster (64 x 49152 logits: 5.1 ms -> 1.1 ms in bfloat16).
    """
    return logits.max(dim=-1).indices


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Applies repetition, presence and frequency penalties in place."""
    counts = md.output_counts
    seen_in_output = counts > 0
    if md.prompt_mask is not None:
        seen = md.prompt_mask | seen_in_output
        rep = md.repetition_penalties.unsqueeze(1).expand_as(logits)
        scale = torch.where(logits > 0, 1.0 / rep, rep)
        logits.copy_(torch.where(seen, logits * scale, logits))
    logits.sub_(md.frequency_penalties.unsqueeze(1) * counts)
    logits.sub_(md.presence_penalties.unsqueeze(1) * seen_in_output)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                       max_top_k: int) -> torch.Tensor:
    """Masks (to -inf) the tokens outside each row's top-k (at most ``max_top_k``), then
    outside its top-p mass."""
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        # NOTE: topk of the largest k needed avoids a full sort; ties at the k-th value stay.
        kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill_(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)
