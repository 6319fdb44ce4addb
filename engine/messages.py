"""Typed messages between the engine and the worker subprocess.

Per step, one SchedulerOutput goes to the worker and one RunnerOutput comes back. The
worker keeps each request's tokens and block table between steps, so a step carries
only what changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class StartPlan:
    """What the engine decided once, before any worker starts (engine/frontend/start_plan.py),
    and every worker (and every restart of one) takes as it is.

    Attributes:
        dtype: The model's dtype ("bfloat16", "float32", ...): EngineConfig.dtype resolved for
            the device and for whether the weights run through the quantized kernel.
        quantization: How the model's linear weights are quantized (model_loader's
            plan_quantization: "gguf", "compressed-tensors", "int8", or None).
        draft_quantization: The same for speculative decoding's draft model.
        attention_backend: The backend by name ("auto" resolved; cpu_paged for batch
            invariance).
        batch_invariant: Whether outputs are batch-invariant (EngineConfig.batch_invariant
            resolved: None is on only where it costs little).
    """

    dtype: str
    quantization: str | None
    draft_quantization: str | None
    attention_backend: str
    batch_invariant: bool


@dataclass(slots=True)
class WorkerInit:
    """The first message to a worker: what to load and how much KV cache to allocate.

    Attributes:
        config: The engine configuration.
        model_dir: Hugging Face-style model directory.
        model_config: Its parsed configuration.
        plan: What the engine decided at start (dtype, attention backend, batch invariance).
        num_blocks: KV blocks to allocate; None: the worker measures its device's memory
            first, sends a WorkerMemory and allocates what the KVCacheAllocation it gets back
            says.
        max_model_len: Longest sequence (sizes the RoPE tables; with num_blocks None, an
            upper bound: the allocation's may be shorter).
        num_cpu_blocks: Blocks of the CPU swap space.
        num_sliding_blocks: Blocks of the sliding layers' own pool, where only some layers
            slide (engine/core/hybrid_kv_cache_manager.py); 0: every layer has num_blocks.
        rank: Tensor-parallel rank of this worker.
        world_size: Tensor-parallel ranks in all.
        dist_init_method: torch.distributed rendezvous (``tcp://host:port``) when
            world_size > 1.
        draft_model_dir: Speculative decoding's draft model, when its method is
            draft_model: loaded beside the model, with a KV cache of the same blocks.
        draft_model_config: Its parsed configuration.
    """

    config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    plan: StartPlan
    num_blocks: int | None
    max_model_len: int
    num_cpu_blocks: int = 0
    num_sliding_blocks: int = 0
    rank: int = 0
    world_size: int = 1
    dist_init_method: str | None = None
    draft_model_dir: Path | None = None
    draft_model_config: ModelConfig | None = None


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has no state for: newly admitted or resumed after recompute."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int = 0  # the LoRA adapter it runs with (engine/lora.py's LoRAAdapter.id); 0: none
    # The sliding layers' own table, where only some layers slide (engine/core/hybrid_kv_cache_manager.py).
    sliding_block_ids: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """What the worker runs in one step.

    Attributes:
        step_id: Increasing step number.
        new_requests: Requests to create in the worker before running.
        new_block_ids: Blocks appended to the tables of requests the worker knows.
        num_scheduled_tokens: Tokens each request runs this step, in batch order.
        finished_request_ids: Requests whose worker state is to be dropped (finished,
            aborted or preempted since the last step).
        block_tables: Whole new tables of known requests whose table changed other than
            by appending (a copy-on-write replaced a block).
        swap_out: (block, cpu block) copies into the swap space.
        swap_in: (cpu block, block) copies out of the swap space.
        copy_blocks: (source, destination) block copies (copy-on-write).
        grammar_request_ids: Structured requests that sample this step, in the order of
            the rows of ``grammar_bitmask``.
        grammar_bitmask: ``[len(grammar_request_ids), ceil(vocab / 32)]`` int32: bit i of
            word w allows token 32 w + i (None when no structured request samples).
        spec_token_ids: Speculative decoding: the drafts of requests that run their last
            known token plus drafts this step (counted in num_scheduled_tokens).
        draft_requests: With a draft model: requests whose next drafts the worker proposes
            once this step's token is known, and how many (slots for them are allocated).
        new_loras: LoRA adapters (id -> engine.lora.LoRAAdapter) the worker gets before
            this step's requests name them.
        drop_loras: Adapters the worker may forget.
        kv_store: The disk tier (engine/kv_offload.py): (block, digest) of blocks filled by
            earlier steps, to snapshot first and write to disk.
        kv_delete: Digests whose files to delete (after the stores queued before).
        kv_load: Per request, the (block, digest) run of blocks to read from disk into its
            blocks (it runs no tokens in this step).
        new_sliding_block_ids, sliding_block_tables: new_block_ids and block_tables of the
            sliding layers' own tables, where only some layers slide (their copies in
            copy_blocks are numbered after the global pool's blocks).

    The worker applies them in this order: snapshot kv_store, drop finished, swap out,
    swap in, copy, load, then runs the step.
    """

    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_requests: dict[str, int] = field(default_factory=dict)
    new_loras: dict[int, Any] = field(default_factory=dict)
    drop_loras: list[int] = field(default_factory=list)
    kv_store: list[tuple[int, bytes]] = field(default_factory=list)
    kv_delete: list[bytes] = field(default_factory=list)
    kv_load: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    new_sliding_block_ids: dict[str, list[int]] = field(default_factory=dict)
    sliding_block_tables: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def has_work(self) -> bool:
        """Whether the worker has anything to do (run, drop, add or move blocks)."""
        return bool(self.num_scheduled_tokens or self.finished_request_ids or self.new_requests
                    or self.swap_out or self.swap_in or self.copy_blocks or self.kv_store or self.kv_delete
                    or self.kv_load)


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's logprob in vLLM's shape (what ``TokenLogprobs[token_id]`` gives).

    Attributes:
        logprob: Its log probability.
        rank: 1 for the likeliest token; None where not known (a sampled token outside the top).
        decoded_token: Its text (filled in ``LLM.generate``'s outputs, as vLLM's are; None where
            nothing decoded it).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class TokenLogprobs(Mapping):
    """Logprobs of one token (sampled, or of the prompt): its own, then the top ones (most
    likely first); a prompt token's rank among the vocabulary (1: the likeliest) too.

    It is also vLLM's ``{token_id: Logprob}`` for the same position (the token and the top
    ones), so code written for vLLM's outputs (``entry[token_id].logprob``, ``entry.items()``)
    reads it as it is."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None
    #: Each token's text, for the Logprob entries (set by LLM.generate; None elsewhere).
    decoded: dict[int, str] | None = None

    def __getitem__(self, token_id: int) -> Logprob:
        text = self.decoded.get(token_id) if self.decoded is not None else None
        if token_id in self.top_token_ids:
            i = self.top_token_ids.index(token_id)
            return Logprob(self.top_logprobs[i], i + 1, text)
        if token_id == self.token_id:
            return Logprob(self.logprob, self.rank, text)
        raise KeyError(token_id)

    def __iter__(self):
        if self.token_id not in self.top_token_ids:
            yield self.token_id
        yield from self.top_token_ids

    def __len__(self) -> int:
        return len(self.top_token_ids) + (self.token_id not in self.top_token_ids)


@dataclass(slots=True)
class PromptLogprobsChunk:
    """The prompt logprobs one step computed for one request: prompt tokens
    ``start .. start + len(token_ids) - 1``, each scored from the positions before it.

    Attributes:
        start: Position in the prompt of the first token scored (at least 1).
        token_ids: ``[n]`` the prompt tokens scored.
        logprobs: ``[n]`` float32 their logprobs.
        ranks: ``[n]`` their ranks (1: the likeliest token).
        top_token_ids: ``[n, k]`` the top k tokens at each position.
        top_logprobs: ``[n, k]`` float32 their logprobs.
    """

    start: int
    token_ids: Any
    logprobs: Any
    ranks: Any
    top_token_ids: Any
    top_logprobs: Any

    def entries(self, skip: int = 0) -> list[TokenLogprobs]:
        """One TokenLogprobs per token scored, from the ``skip``-th on."""
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_values = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        return [TokenLogprobs(ids[i], values[i], top_ids[i], top_values[i], ranks[i]) for i in range(skip, len(ids))]


@dataclass(slots=True)
class RunnerOutput:
    """The worker's answer to one SchedulerOutput.

    Attributes:
        step_id: The step answered.
        sampled: Request id to the token sampled for it; requests in the middle of a
            chunked prefill sample nothing.
        logprobs: Request id to logprobs, for requests that asked.
        prompt_logprobs: Request id to the prompt logprobs this step computed, for
            requests that asked (every prefill chunk of theirs sends some).
        embeddings: Request id to its pooled float32 hidden state (not normalised), for
            embedding requests whose prompt this step finished.
        spec_sampled: Requests that ran drafts: the drafts accepted, then the token
            sampled after them (they are not in ``sampled``).
        spec_logprobs: Their logprobs, one per token of ``spec_sampled``, if asked.
        draft_token_ids: With a draft model: the drafts it proposed for the next step, for
            the requests of ``draft_requests``.
        kv_loaded: Per request of ``kv_load``, how many of its blocks were read (its run
            stops at the first block missing or damaged).
        kv_failed: Digests of blocks not on disk after all: found missing or damaged when
            read, or not stored (the writer was too far behind).
        kv_read_bytes: Bytes read from disk by the step's loads.
        kv_read_seconds: Time the loads took.
        error: Set when the step failed; every request in it is failed.
        compute_seconds: Time the worker spent on the step.
        idle_seconds: Time the worker waited for the step after answering the one before.
    """

    step_id: int
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    embeddings: dict[str, Any] = field(default_factory=dict)
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_loaded: dict[str, int] = field(default_factory=dict)
    kv_failed: list[bytes] = field(default_factory=list)
    kv_read_bytes: int = 0
    kv_read_seconds: float = 0.0
    error: str | None = None
    compute_seconds: float = 0.0
    idle_seconds: float = 0.0


@dataclass(slots=True)
class WorkerReady:
    """Sent once the worker has loaded the model and allocated the KV cache."""

    device: str
    dtype: str
    attention_backend: str
    kv_cache_bytes: int
    pid: int = 0
    compile_seconds: float = 0.0
    compiled: str = ""  # the compiled regions loaded from disk and compiled, for the start-up line
    weights: str = ""  # their format and resident size, for the start-up line
    one_call_forward: bool = False  # decode steps run in one call (engine/models/one_call_forward.py)
    batch_invariant: bool = False  # as the start plan resolved EngineConfig.batch_invariant
    weight_bytes_per_token: int = 0  # the weights one decoded token reads (DecoderForCausalLM)
    cuda_graphs: str = ""  # on a GPU: which decode steps replay CUDA graphs, or why none do
    threads: str = ""  # "2 threads on CPUs 0-1": the worker's torch threads and where they may run
    kv_offload_namespace: str = ""  # with a disk tier: the namespace of its blocks (hex)
    kv_offload_file_bytes: int = 0  # and one block's file size


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What one worker measured of its device's memory at start-up (bytes).

    Attributes:
        total: The device's memory.
        free_at_start: Free before the worker loaded anything (other processes' use
            and the worker's CUDA context already taken).
        weights: Held by torch once the model's weights were loaded.
        peak_activations: The most torch held above the weights during a forward of
            max_num_batched_tokens tokens (the scratch KV cache of that forward not counted).
        non_torch: Taken outside torch's allocator since the start (NCCL, cuBLAS workspaces).
        reserved: Held once the cache is allocated: the penalties' buffers, the CUDA
            graphs' pool (a decode step of max_num_seqs, measured).
    """

    total: int
    free_at_start: int
    weights: int
    peak_activations: int
    non_torch: int
    reserved: int = 0


@dataclass(slots=True)
class WorkerMemory:
    """Sent instead of WorkerReady by a worker started with ``num_blocks=None``, once the
    model is loaded: what it measured. The engine answers with a KVCacheAllocation."""

    memory: DeviceMemory


@dataclass(frozen=True, slots=True)
class KVCacheAllocation:
    """The engine's answer to WorkerMemory: the KV cache to allocate (every rank the same)."""

    num_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    # The sliding layers' own pool, where only some layers slide (0: every layer has num_blocks).
    num_sliding_blocks: int = 0


@dataclass(slots=True)
class WorkerProgress:
    """A start-up stage the worker has begun ("loading weights", "compiling"), sent before
    WorkerReady so that a long start says what it is doing."""

    message: str


@dataclass(slots=True)
class WorkerFailed:
    """Sent when the worker cannot start (bad model, out of memory)."""

    error: str


@dataclass(slots=True)
class Shutdown:
    """Asks the worker to exit."""
