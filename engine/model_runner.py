"""ModelRunner: the worker's per-step work — inputs, forward, logits, sampling.

It keeps every running request's tokens and block table between steps, so the engine
sends only what changed.
"""

from __future__ import annotations

import traceback

import torch

from attention_backends import AttentionMetadata, get_attention_backend
from engine.messages import NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs, WorkerInit
from engine.model_loader import load_weights
from engine.models.llama import LlamaForCausalLM, RotaryEmbedding
from engine.platform import resolve_device, resolve_dtype
from engine.sampler import Sampler, SamplingMetadata


class CachedRequestState:
    """The worker's copy of one request."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "token_ids", "sampling_params",
                 "block_ids", "num_computed_tokens")

    def __init__(self, data: NewRequestData) -> None:
        self.request_id = data.request_id
        self.prompt_token_ids = list(data.prompt_token_ids)
        self.output_token_ids = list(data.output_token_ids)
        self.token_ids = self.prompt_token_ids + self.output_token_ids
        self.sampling_params = data.sampling_params
        self.block_ids = list(data.block_ids)
        self.num_computed_tokens = data.num_computed_tokens


class ModelRunner:
    """Owns the model, the paged KV tensors and the sampler.

    Args:
        init: What to load and how many KV blocks (and swap blocks) to allocate.
    """

    def __init__(self, init: WorkerInit) -> None:
        config, model_dir, model_config = init.config, init.model_dir, init.model_config
        num_blocks, max_model_len, num_cpu_blocks = init.num_blocks, init.max_model_len, init.num_cpu_blocks
        self.compile_seconds = 0.0
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model_config = model_config
        backend_cls = get_attention_backend(config.attention_backend, self.device)
        backend = backend_cls(model_config.num_attention_heads, model_config.num_key_value_heads,
                              model_config.head_dim, model_config.head_dim**-0.5)
        self.attention_backend = backend
        # NOTE: built on the meta device so that no time goes into random init of weights
        # that the checkpoint overwrites anyway.
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, backend, max_model_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.rotary = RotaryEmbedding(model_config, max_model_len).to(self.device)
        model.load_weights(load_weights(model_dir))
        self.model = model.eval()
        shape = backend.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_config.num_hidden_layers)
        ]
        self.kv_cache_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        # The swap space: the same layout in CPU memory (pinned when the cache is on a GPU).
        cpu_shape = backend.kv_cache_shape(num_cpu_blocks, self.block_size)
        pin = self.device.type == "cuda"
        self.cpu_caches = [
            (torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin),
             torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin))
            for _ in range(model_config.num_hidden_layers)
        ] if num_cpu_blocks else []
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.eos_token_ids = list(model_config.eos_token_ids)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Runs one step; a failure is reported in the output, never raised."""
        try:
            with torch.inference_mode():
                return self._execute(sched)
        except Exception:
            for request_id in sched.num_scheduled_tokens:
                self.requests.pop(request_id, None)
            return RunnerOutput(step_id=sched.step_id, error=traceback.format_exc())

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
        # NOTE: the order matters: a swapped-out block may be reused by this very step.
        self._move_blocks(sched.swap_out, self.kv_caches, self.cpu_caches)
        self._move_blocks(sched.swap_in, self.cpu_caches, self.kv_caches)
        self._move_blocks(sched.copy_blocks, self.kv_caches, self.kv_caches)
        for data in sched.new_requests:
            self.requests[data.request_id] = CachedRequestState(data)
        for request_id, block_ids in sched.new_block_ids.items():
            self.requests[request_id].block_ids.extend(block_ids)
        for request_id, block_ids in sched.block_tables.items():
            self.requests[request_id].block_ids = list(block_ids)
        out = RunnerOutput(step_id=sched.step_id)
        if sched.is_empty:
            return out

        states = [self.requests[request_id] for request_id in sched.num_scheduled_tokens]
        query_lens = list(sched.num_scheduled_tokens.values())
        input_ids, positions, metadata = self._prepare_inputs(states, query_lens)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)

        # Only requests whose known tokens are all computed after this step sample; the
        # rest are in the middle of a chunked prefill.
        sample_rows, sampling_states = [], []
        for i, (state, num_new) in enumerate(zip(states, query_lens)):
            state.num_computed_tokens += num_new
            if state.num_computed_tokens == len(state.token_ids):
                sample_rows.append(i)
                sampling_states.append(state)
        if not sampling_states:
            return out
        last_rows = metadata.query_start_loc[1:][torch.tensor(sample_rows)].long() - 1
        logits = self.model.compute_logits(hidden[last_rows.to(self.device)])
        sampling_metadata = SamplingMetadata.build(
            [s.sampling_params for s in sampling_states],
            [s.prompt_token_ids for s in sampling_states],
            [s.output_token_ids for s in sampling_states],
            self.eos_token_ids,
            self.model_config.vocab_size,
            device=self.device,
        )
        result = self.sampler(logits, sampling_metadata)
        token_ids = result.sampled_token_ids.tolist()
        want_logprobs = result.logprobs is not None
        if want_logprobs:
            logprobs = result.logprobs.tolist()
            logprob_ids = result.logprob_token_ids.tolist()
        for row, (state, token_id) in enumerate(zip(sampling_states, token_ids)):
            state.token_ids.append(token_id)
            state.output_token_ids.append(token_id)
            out.sampled[state.request_id] = token_id
            num_top = state.sampling_params.logprobs
            if want_logprobs and num_top is not None:
                out.logprobs[state.request_id] = TokenLogprobs(
                    token_id=token_id,
                    logprob=logprobs[row][0],
                    top_token_ids=logprob_ids[row][1 : 1 + num_top],
                    top_logprobs=logprobs[row][1 : 1 + num_top],
                )
        return out

    def _move_blocks(self, pairs: list[tuple[int, int]], src_caches, dst_caches) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([src for src, _ in pairs])
        dst_ids = torch.tensor([dst for _, dst in pairs])
        for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
            self.attention_backend.copy_blocks(src_k, dst_k, src_ids, dst_ids, self.block_size)
            self.attention_backend.copy_blocks(src_v, dst_v, src_ids, dst_ids, self.block_size)

    def _prepare_inputs(self, states: list[CachedRequestState], query_lens: list[int]):
        """Builds the flattened token batch and the attention metadata in one go."""
        input_ids: list[int] = []
        computed = []
        seq_lens = []
        for state, num_new in zip(states, query_lens):
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start : start + num_new])
            computed.append(start)
            seq_lens.append(start + num_new)
        num_tokens = len(input_ids)
        max_blocks = max(len(state.block_ids) for state in states)
        tables = [state.block_ids + [0] * (max_blocks - len(state.block_ids)) for state in states]

        query_lens_t = torch.tensor(query_lens, dtype=torch.int32)
        query_start_loc = torch.zeros(len(states) + 1, dtype=torch.int32)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        req_index = torch.repeat_interleave(torch.arange(len(states)), query_lens_t)
        offsets = torch.arange(num_tokens) - query_start_loc[:-1].long()[req_index]
        positions = torch.tensor(computed)[req_index] + offsets
        block_tables = torch.tensor(tables, dtype=torch.int32)
        slot_mapping = (block_tables[req_index, positions // self.block_size].long() * self.block_size
                        + positions % self.block_size)
        device = self.device
        metadata = AttentionMetadata(
            num_tokens=num_tokens,
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc.to(device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            slot_mapping=slot_mapping.to(device),
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        self.attention_backend.prepare(metadata)
        return torch.tensor(input_ids, device=device), positions.to(device), metadata
