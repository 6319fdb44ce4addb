"""The worker's persistent batch: one row per request it knows, updated in place.

A request keeps its row from the step that sends it to the worker until it finishes
(or is preempted). Its token ids, block table and sampling parameters live in
row-indexed arrays, so a step only writes what changed (new rows, appended blocks, the
tokens it sampled) and gathers the scheduled rows with array indexing: no per-step
rebuilding of padded block tables or sampling tensors from Python lists.

Token counts for the penalties live here too, allocated the first time a request with
a penalty arrives and updated as tokens are sampled.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.engine.messages import NewRequestData
from pagoda.engine.worker.host_copy import to_device
from pagoda.engine.worker.sampling_metadata import SamplingMetadata, greedy_temperature, mix_seed
from pagoda.engine.sampling_params import POOLING_METHODS, SamplingParams


class InputBatch:
    """Row-indexed state of the requests in the worker.

    Args:
        max_num_reqs: Rows (the most requests the worker holds at once).
        max_model_len: Longest sequence.
        block_size: Tokens per KV block.
        vocab_size: Width of the logits.
        eos_token_ids: The model's EOS ids (suppressed under min_tokens).
        device: Where sampling tensors go.
        sliding_tables: Each row also has the sliding layers' own block table (a model whose
            layers only partly slide: engine/core/hybrid_kv_cache_manager.py).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 eos_token_ids: list[int], device: torch.device, sliding_tables: bool = False) -> None:
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.sliding_block_table = np.zeros_like(self.block_table) if sliding_tables else None
        self.num_sliding_blocks = np.zeros_like(self.num_blocks) if sliding_tables else None
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.greedy = np.ones(max_num_reqs, dtype=bool)
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)  # each row's LoRA adapter (0: none)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        #: Rows with logit_bias, allowed_token_ids or bad words (their edits are built per step).
        self.has_logit_edits = np.zeros(max_num_reqs, dtype=bool)
        #: Per row with logit_bias or allowed_token_ids: its (token, bias) pairs and allowed ids.
        self.row_edits: dict[int, tuple[list[tuple[int, float]], torch.Tensor]] = {}
        # Prompt scoring: top logprobs per prompt token (-1: none) and the pooling of
        # embedding requests (0: none, else 1 + its index in POOLING_METHODS); the count of
        # rows using either, so that a batch without them checks nothing more.
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.pooling = np.zeros(max_num_reqs, dtype=np.int8)
        self.num_scoring_rows = 0
        # Mean pooling: the float32 sum of the prompt's final hidden states so far, by row.
        self.pooled_sums: dict[int, torch.Tensor] = {}
        # [rows, vocab] output token counts and prompt-token masks, for the penalties.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.row_of)

    # -- rows in and out -----------------------------------------------------------------

    def add(self, data: NewRequestData) -> int:
        """Gives a new (or resumed) request a row; returns it."""
        if not self._free_rows:
            raise RuntimeError(f"the worker holds {self.max_num_reqs} requests already")
        row = self._free_rows.pop()
        self.req_ids[row] = data.request_id
        self.row_of[data.request_id] = row
        prompt, output = data.prompt_token_ids, data.output_token_ids
        num_prompt, num_tokens = len(prompt), len(prompt) + len(output)
        self.token_ids[row, :num_prompt] = prompt
        self.token_ids[row, num_prompt:num_tokens] = output
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.set_block_ids(row, data.block_ids)
        if data.sliding_block_ids is not None:
            self.set_block_ids(row, data.sliding_block_ids, sliding=True)
        p = data.sampling_params
        self.params[row] = p
        self.lora_id[row] = data.lora_id
        greedy = p.temperature < greedy_temperature
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        has_penalty = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.has_penalty[row] = has_penalty
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.min_tokens[row] = p.min_tokens
        self.has_logit_edits[row] = bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)
        if p.logit_bias or p.allowed_token_ids:
            # NOTE: built once, not every step (allowed_token_ids may name much of the vocabulary).
            self.row_edits[row] = (list(p.logit_bias.items()) if p.logit_bias else [],
                                   torch.tensor(sorted(set(p.allowed_token_ids or ())), dtype=torch.int64,
                                                device=self.device))
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.pooling[row] = 0 if p.pooling is None else 1 + POOLING_METHODS.index(p.pooling)
        if p.prompt_logprobs is not None or p.pooling is not None:
            self.num_scoring_rows += 1
        if has_penalty:
            self._init_penalty_state(row, prompt, output)
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.params[row] = None
        self.row_edits.pop(row, None)
        if self.num_prompt_logprobs[row] >= 0 or self.pooling[row]:
            self.num_scoring_rows -= 1
            self.num_prompt_logprobs[row] = -1
            self.pooling[row] = 0
            self.pooled_sums.pop(row, None)
        self._free_rows.append(row)

    def _table(self, sliding: bool) -> tuple[np.ndarray, np.ndarray]:
        """The block tables and their lengths: the rows' own, or their sliding layers'."""
        return (self.sliding_block_table, self.num_sliding_blocks) if sliding else (self.block_table, self.num_blocks)

    def set_block_ids(self, row: int, block_ids: list[int], sliding: bool = False) -> None:
        """Replaces a row's whole block table (or its sliding layers' own)."""
        table, counts = self._table(sliding)
        table[row, : len(block_ids)] = block_ids
        counts[row] = len(block_ids)

    def append_block_ids(self, row: int, block_ids: list[int], sliding: bool = False) -> None:
        table, counts = self._table(sliding)
        start = counts[row]
        table[row, start : start + len(block_ids)] = block_ids
        counts[row] = start + len(block_ids)

    def _init_penalty_state(self, row: int, prompt: list[int], output: list[int]) -> None:
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.float32,
                                             device=self.device)
            self.prompt_mask = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.bool, device=self.device)
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=self.vocab_size)
        self.output_counts[row] = counts[: self.vocab_size].to(self.device, torch.float32)
        self.prompt_mask[row] = False
        prompt_ids = torch.tensor([t for t in prompt if 0 <= t < self.vocab_size], dtype=torch.int64)
        self.prompt_mask[row, prompt_ids.to(self.device)] = True

    # -- one step ------------------------------------------------------------------------

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Records the tokens sampled for ``rows`` (their known tokens grow by one)."""
        positions = self.num_tokens[rows]
        self.token_ids[rows, positions] = token_ids
        self.num_tokens[rows] = positions + 1
        if self.output_counts is not None:
            penalized = self.has_penalty[rows]
            if penalized.any():
                r = to_device(rows[penalized], self.device, torch.int64)
                t = to_device(token_ids[penalized], self.device, torch.int64)
                self.output_counts.index_put_((r, t), torch.ones_like(r, dtype=torch.float32), accumulate=True)

    def _logit_edits(self, md: SamplingMetadata, rows: np.ndarray, num_output: np.ndarray,
                     edits: list[tuple[int, int, float]]) -> None:
        """Adds the edits of the rows with logit_bias or bad words to ``edits``, and limits the
        rows with allowed_token_ids. A bad word's last token is suppressed where the output
        (drafts before the position included) ends with the rest of it, as vLLM does."""
        allowed_rows: list[int] = []
        allowed: list[torch.Tensor] = []
        for i in np.flatnonzero(self.has_logit_edits[rows]).tolist():
            row = int(rows[i])
            p = self.params[row]
            bias, allowed_ids = self.row_edits.get(row, ((), None))
            edits += [(i, t, v) for t, v in bias]
            if allowed_ids is not None and len(allowed_ids):
                allowed_rows.append(i)
                allowed.append(allowed_ids)
            if p.bad_words_token_ids:
                end = int(self.num_prompt_tokens[row] + num_output[i])
                longest = max(len(word) for word in p.bad_words_token_ids) - 1
                start = max(int(self.num_prompt_tokens[row]), end - longest)
                tail = self.token_ids[row, start:end].tolist()  # NOTE: the output's last tokens only
                for word in p.bad_words_token_ids:
                    head = word[:-1]
                    if not head or tail[len(tail) - len(head):] == head:
                        edits.append((i, word[-1], float("-inf")))
        if allowed_rows:
            device = self.device
            md.allowed_rows = torch.tensor(allowed_rows, dtype=torch.int64, device=device)
            md.allowed_token_ids = torch.cat(allowed)
            md.allowed_of = torch.repeat_interleave(torch.arange(len(allowed), device=device),
                                                    torch.tensor([len(a) for a in allowed], device=device))

    def _count_drafts(self, counts: torch.Tensor, rows: np.ndarray, offsets: np.ndarray) -> None:
        """Adds to each penalized logits row's output counts the drafts before its position
        (they are written after the row's known tokens)."""
        index = np.flatnonzero(self.has_penalty[rows] & (offsets > 0))
        if not len(index):
            return
        lengths = offsets[index]
        pair_rows = np.repeat(index, lengths)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = np.repeat(self.num_tokens[rows[index]], lengths) + within
        tokens = self.token_ids[rows[pair_rows], positions].astype(np.int64)
        r = to_device(pair_rows.astype(np.int64), self.device)
        t = to_device(tokens, self.device)
        counts.index_put_((r, t), torch.ones(len(r), dtype=counts.dtype, device=self.device), accumulate=True)

    def count_output(self, row: int, token_ids: list[int]) -> None:
        """Adds tokens to a penalized row's output counts (those appended past append_sampled)."""
        if self.output_counts is not None and self.has_penalty[row]:
            t = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            self.output_counts[row].index_put_((t,), torch.ones(len(t), device=self.device), accumulate=True)

    def sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """The sampler's view of ``rows``, gathered from the row arrays.

        Args:
            rows: The batch row of each logits row (a speculating request's repeats).
            offsets: Each logits row's output position past the row's known tokens (its
                draft position; None: all 0): the noise of seeded rows, min_tokens and the
                penalties' counts take the drafts before it as output.
        """
        device = self.device
        greedy = self.greedy[rows]
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        md = SamplingMetadata(num_reqs=len(rows), vocab_size=self.vocab_size, all_greedy=all_greedy,
                              all_random=all_random)

        def tensor(values: np.ndarray) -> torch.Tensor:
            return to_device(values, device)

        if not all_greedy:
            random = ~greedy
            md.temperature = tensor(self.temperature[rows])
            if not all_random:
                md.greedy_mask = tensor(greedy)
            top_k = self.top_k[rows]
            if (top_k[random] < self.vocab_size).any():
                top_k = np.where(random, top_k, self.vocab_size)
                md.top_k, md.max_top_k = tensor(top_k), int(top_k.max())
            top_p = self.top_p[rows]
            if (top_p[random] < 1.0).any():
                md.top_p = tensor(np.where(random, top_p, 1.0).astype(np.float32))
            min_p = self.min_p[rows]
            if (min_p[random] > 0.0).any():
                md.min_p = tensor(np.where(random, min_p, 0.0).astype(np.float32))
            md.seeded_rows = [
                (i, mix_seed(p.seed, int(self.num_tokens[row] - self.num_prompt_tokens[row])
                             + (0 if offsets is None else int(offsets[i]))))
                for i, row in enumerate(rows.tolist())
                if not greedy[i] and (p := self.params[row]).seed is not None
            ]
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            md.max_num_logprobs = int(num_logprobs.max())
        num_output = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        if offsets is not None:
            num_output = num_output + offsets
        edits: list[tuple[int, int, float]] = []  # (row in the step, token, added to its logit)
        for i in np.nonzero(num_output < self.min_tokens[rows])[0].tolist():
            p = self.params[rows[i]]
            banned = set(p.stop_token_ids) if p.ignore_eos else {*p.stop_token_ids, *self.eos_token_ids}
            edits += [(i, t, float("-inf")) for t in sorted(banned) if 0 <= t < self.vocab_size]
        if self.has_logit_edits[rows].any():
            self._logit_edits(md, rows, num_output, edits)
        if edits:
            r, t, v = zip(*edits)
            md.edit_rows = torch.tensor(r, dtype=torch.int64, device=device)
            md.edit_token_ids = torch.tensor(t, dtype=torch.int64, device=device)
            md.edit_values = torch.tensor(v, dtype=torch.float32, device=device)
        if self.has_penalty[rows].any():
            index = tensor(rows.astype(np.int64))
            md.repetition_penalties = tensor(self.repetition_penalty[rows])
            md.presence_penalties = tensor(self.presence_penalty[rows])
            md.frequency_penalties = tensor(self.frequency_penalty[rows])
            md.output_counts = self.output_counts.index_select(0, index)
            if offsets is not None:
                self._count_drafts(md.output_counts, rows, offsets)
            if (self.repetition_penalty[rows] != 1.0).any():
                md.prompt_mask = self.prompt_mask.index_select(0, index)
        return md
