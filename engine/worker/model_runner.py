"""ModelRunner: the worker's per-step work — inputs, forward, logits, sampling.

Requests live in a persistent :class:`~pagoda.engine.worker.input_batch.InputBatch` between steps, so
the engine sends only what changed and a step's inputs are gathered with array
indexing. Decode requests (one new token) are placed first in the flattened batch,
which lets the attention backends treat them as one contiguous slice.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pagoda.environment import read_int
from pagoda.attention_backends import AttentionMetadata, get_attention_backend
from pagoda.engine.tensor_parallel import head_share
from pagoda.engine.worker.distributed import init_tensor_parallel
from pagoda.engine.worker.host_copy import to_device
from pagoda.engine.worker.input_batch import InputBatch
from pagoda.engine.worker.kv_offload_io import KVOffloadIO
from pagoda.engine.kv_offload import KVOffloadTarget, model_fingerprint, namespace_of, write_description
from pagoda.engine.messages import (DeviceMemory, KVCacheAllocation, RunnerOutput, SchedulerOutput, TokenLogprobs,
                                    WorkerInit)
from pagoda.engine.config import SIMULATED_DEVICE_MEMORY_ENV, compiles_model
from pagoda.engine.families import FAMILIES
from pagoda.engine.model_loader import compressed_tensors_config, default_cache_dir, float_checkpoint, load_weights
from pagoda.engine.models import linear
from pagoda.engine.models.linear import choose_packing, describe_amx_rows
from pagoda.engine.models.compressed_tensors import CompressedTensorsCheckpoint
from pagoda.engine.models.lora import LoRAManager
from pagoda.engine.models.decoder import DecoderForCausalLM, RotaryEmbedding
from pagoda.engine.models.precompiled import WARM_UP_PREFILL_TOKENS, cache_key
from pagoda.engine.models.quantized import GroupQuantized, quantize_int8, quantized_weights
from pagoda.engine.platform import attention_shape, resolve_device, resolve_kv_cache_dtype
from pagoda.engine.worker.prompt_scoring import score_prompts
from pagoda.engine.worker.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the paged KV tensors, the persistent batch and the sampler.

    Args:
        init: What to load and how many KV blocks (and swap blocks) to allocate.
        progress: Called with a line as each long start-up stage begins (None: silent).
    """

    def __init__(self, init: WorkerInit, progress: Callable[[str], None] | None = None) -> None:
        progress = progress or (lambda message: None)
        config, model_config = init.config, init.model_config
        # NOTE: on CUDA each tensor-parallel rank its own GPU; Ray shows an actor only its own
        # (as cuda:0), so ranks take no offset there.
        offset = init.rank if config.distributed_executor_backend == "mp" else 0
        self.device = resolve_device(config.device, offset)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        plan = init.plan  # NOTE: decided in the engine (engine/frontend/start_plan.py), taken as it is
        self.dtype = getattr(torch, plan.dtype)
        fp8_cache = resolve_kv_cache_dtype(config.kv_cache_dtype)
        self.kv_cache_dtype = fp8_cache or self.dtype
        self.block_size = config.block_size
        self.model_config = model_config
        self.tp = tp = init_tensor_parallel(init.rank, init.world_size, init.dist_init_method, self.device)
        # NOTE: by name: checked to run on this worker's device, not chosen again
        backend_cls = get_attention_backend(plan.attention_backend, self.device, fp8_cache,
                                            attention_shape(model_config, self.dtype))
        self.batch_invariant = plan.batch_invariant
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._free_at_start = torch.cuda.mem_get_info(self.device)[0]
        self.lora: LoRAManager | None = None  # with --enable-lora (set by _load_model)
        self.model, self.attention_backend = self._load_model(init.model_dir, model_config, backend_cls, init,
                                                              progress)
        # Speculative decoding's draft model: its own KV cache over the same blocks, so the
        # block tables and slots of a step serve both models.
        self.draft = self.draft_backend = None
        self.draft_kv_caches = self.draft_cpu_caches = []
        if init.draft_model_dir is not None:
            self.draft, self.draft_backend = self._load_model(init.draft_model_dir, init.draft_model_config,
                                                              backend_cls, init, progress, draft=True)
        self._init, self._progress = init, progress
        self.kv_caches = None
        self.batch: InputBatch | None = None  # with the cache (allocate)
        self.offload: KVOffloadIO | None = None  # the disk tier's reads and writes, with kv_offload_dir
        self._last_step_failed = False
        if init.num_blocks is not None:
            self.allocate(KVCacheAllocation(init.num_blocks, init.num_cpu_blocks, init.max_model_len,
                                            init.num_sliding_blocks))

    def allocate(self, allocation: KVCacheAllocation) -> None:
        """Allocates the KV cache (and the draft's, and the swap space), the persistent batch
        and the sampler, then compiles and warms the model up: the second half of the start."""
        init, progress, config, model_config = self._init, self._progress, self._init.config, self.model_config
        graphs_off = self._decode_graphs_off(config)
        # NOTE: with CUDA graphs, one block past the pool's: the padding rows' scratch block.
        self.kv_caches, self.cpu_caches = self._allocate_caches(self.attention_backend, model_config, allocation,
                                                                extra_blocks=0 if graphs_off is not None else 1)
        self.kv_cache_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        if self.draft is not None:
            self.draft_kv_caches, self.draft_cpu_caches = self._allocate_caches(self.draft_backend,
                                                                                init.draft_model_config, allocation)
            self.kv_cache_bytes += sum(k.nbytes + v.nbytes for k, v in self.draft_kv_caches)
        if config.offloads_kv:
            self.offload = self._open_offload(config, init)
        # Whole steps in one C call where the model allows (engine/models/one_call_forward.py).
        self.one_call_forward = self.model.prepare_one_call_forward(self.kv_caches)
        if self.model.layer_by_layer_reason and self.device.type == "cpu":
            progress(f"steps run layer by layer: the one-call forward has no {self.model.layer_by_layer_reason} "
                     f"({model_config.architecture})")
        if self.draft is not None:
            self.draft.prepare_one_call_forward(self.draft_kv_caches)
        # NOTE: the engine's seed drives unseeded sampling, so a run is reproducible as a whole.
        self.sampler = Sampler(config.seed)
        self.batch = InputBatch(config.max_num_seqs, allocation.max_model_len, self.block_size,
                                model_config.vocab_size, list(model_config.eos_token_ids), self.device,
                                sliding_tables=bool(allocation.num_sliding_blocks))
        self.num_global_blocks = allocation.num_blocks
        self._failed: set[str] = set()
        self.compile_seconds = 0.0
        self.compile_description = ""
        # NOTE: not across tensor-parallel ranks, whose all-reduces sit inside the compiled regions.
        # NOTE: not with batch_invariant: inductor compiles a one-row batch apart, and its
        # code rounds differently from the many-row code's.
        # NOTE: nor where every step runs in one call: the compiled regions would serve no step
        # (the warm-up then allocates the call's activations before the first request, with
        # batch invariance too).
        compiles = compiles_model(config, self.device.type, self.tp.world_size, self.batch_invariant)
        if (compiles or self.batch_invariant) and self.model.one_call_takes_every_step():
            progress("every step runs in one C call: nothing to compile")
            self._warm_up()
        elif compiles:
            self._compile(progress)
        self.decode_graphs = None
        self.graphs_description = graphs_off or ""
        if graphs_off is None:
            self._capture_decode_graphs(allocation, progress)

    def _open_offload(self, config, init: WorkerInit) -> KVOffloadIO:
        """The offload tier's reader and writer: in host memory, and on disk in the namespace of
        this model's weights and of this cache's layout (a block of any other never reads as
        one of these)."""
        host_bytes = config.kv_offload_host_bytes or 0
        if config.kv_offload_dir is None:
            return KVOffloadIO(None, self.kv_caches, host_bytes)
        description = {
            "model": model_fingerprint(Path(init.model_dir)),
            "architecture": self.model_config.architecture,
            "dtype": str(self.dtype), "kv_cache_dtype": str(self.kv_cache_dtype),
            "quantization": config.quantization, "batch_invariant": self.batch_invariant,
            "attention_backend": self.attention_backend.name, "block_size": self.block_size,
            "blocks": [[list(t.shape[1:]), str(t.dtype)] for pair in self.kv_caches for t in pair],
        }
        target = KVOffloadTarget(Path(config.kv_offload_dir), namespace_of(description))
        write_description(target, {**description, "model_path": str(init.model_dir)})
        return KVOffloadIO(target, self.kv_caches, host_bytes)

    def _compile(self, progress) -> None:
        """Compiles the model's regions (loading them where an earlier start kept them) and
        warms them up. On a GPU, where this path has not been run by this project's checks
        yet, a failure leaves the model eager, with the error in the log."""
        key = [*self.model.describe_code()]
        if self.device.type == "cuda":
            key += [torch.cuda.get_device_name(self.device), torch.cuda.get_device_capability(self.device),
                    torch.version.cuda]
        directory = default_cache_dir() / "compiled" / cache_key(*key)
        if directory.is_dir() and any(directory.glob("*.bin")):
            progress(f"loading the compiled model from {directory}")
        else:
            progress(f"compiling the model with torch.compile (tens of seconds; later starts load it from "
                     f"{directory}; --enforce-eager skips it)")
        start = time.perf_counter()
        try:
            self.model.compile_regions(directory)
            self._warm_up()
        except Exception:
            if self.device.type != "cuda":
                raise
            logger.exception("compiling the model failed on %s: it runs eagerly", self.device)
            progress("compiling the model failed (the worker's log has the error): it runs eagerly")
            self.model.use_eager_regions()
            self.compile_description = "compiling failed: eager (see the log)"
            return
        self.compile_seconds = time.perf_counter() - start
        regions = self.model._regions
        loaded, compiled = sum(r.loaded for r in regions), sum(r.compiled for r in regions)
        self.compile_description = f"{loaded} compiled regions loaded" + (f", {compiled} compiled" if compiled else "")
        logger.info("compiled the model in %.1f s (%s)", self.compile_seconds, self.compile_description)

    def _decode_graphs_off(self, config) -> str | None:
        """Why decode steps run without CUDA graphs (None: they take them; "" on the CPU,
        where there are none to take)."""
        if self.device.type != "cuda":
            return "" if self.device.type == "cpu" else f"no CUDA graphs on {self.device.type}"
        if config.enforce_eager:
            return "no CUDA graphs (--enforce-eager)"
        if self.tp.world_size > 1:
            return "no CUDA graphs under tensor parallelism yet"
        if self._init.draft_model_dir is not None:
            return "no CUDA graphs with a draft model yet"
        if self.model_config.is_moe:  # NOTE: the experts' grouping reads its counts back (moe.py)
            return "no CUDA graphs with mixture-of-experts layers yet"
        if not self.attention_backend.supports_decode_graphs:
            return f"no CUDA graphs with the {self.attention_backend.name} attention backend yet"
        if self.model_config.sliding_layers is not None:  # NOTE: a graph replays one block table a step
            return "no CUDA graphs with sliding layers beside global ones yet"
        return None

    def _capture_decode_graphs(self, allocation: KVCacheAllocation, progress) -> None:
        """Captures the decode buckets, then checks each replay against the eager forward; a
        mismatch leaves decode steps eager (engine/worker/cuda_graphs.py)."""
        from pagoda.engine.worker.cuda_graphs import DecodeGraphs

        config = self._init.config
        graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs, allocation.max_model_len,
                              self.block_size, scratch_block=allocation.num_blocks)
        progress(f"capturing CUDA graphs of decode batches of 1 to {graphs.max_batch} ({len(graphs.sizes)} sizes; "
                 "--enforce-eager skips them)")
        try:
            graphs.capture_all()
            problem = graphs.check(allocation.num_blocks, self.model_config.vocab_size)
        except Exception as exc:  # noqa: BLE001 - an op the capture refuses, or no memory for its pool
            logger.exception("capturing the CUDA graphs failed")
            problem = f"the capture failed: {type(exc).__name__}: {exc}"
            del graphs
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if problem is not None:
            logger.warning("CUDA graphs off: %s", problem)
            self.graphs_description = f"CUDA graphs off ({problem})"
            return
        self.decode_graphs = graphs
        self.graphs_description = (f"CUDA graphs of decode batches of 1 to {graphs.max_batch} "
                                   f"({len(graphs.sizes)} sizes, captured in {graphs.capture_seconds:.1f} s)")

    def _load_model(self, model_dir, model_config, backend_cls, init: WorkerInit,
                    progress: Callable[[str], None], draft: bool = False) -> tuple[DecoderForCausalLM, object]:
        """Builds a model (the draft model: without LoRA slots) and its attention backend and
        loads (and packs) its weights."""
        config, tp = init.config, self.tp
        heads = head_share(model_config.num_attention_heads, model_config.num_key_value_heads, tp.rank,
                           tp.world_size)
        backend = backend_cls(heads.num_heads, heads.num_kv_heads, model_config.head_dim,
                              model_config.attention_scale)
        if self.batch_invariant:
            backend.batch_invariant = True  # cpu_paged: every row by the vector kernel alone
        # NOTE: built on the meta device so that no time goes into random init of weights
        # that the checkpoint overwrites anyway.
        with torch.device("meta"):
            model = DecoderForCausalLM(model_config, backend, init.max_model_len, tp)
        # NOTE: not to_empty(): empty_like() of a meta tensor imports sympy (0.3-0.8 s of a start).
        model = model._apply(lambda t: torch.empty(t.shape, device=self.device,
                                                   dtype=self.dtype if t.is_floating_point() else t.dtype))
        model.rotary = RotaryEmbedding(model_config, init.max_model_len).to(self.device)
        if model.local_rotary is not None:
            model.local_rotary = RotaryEmbedding(model_config, init.max_model_len, local=True).to(self.device)
        start = time.perf_counter()
        progress(f"loading weights from {model_dir} ({self.device}, {str(self.dtype).removeprefix('torch.')})")
        mode = init.plan.draft_quantization if draft else init.plan.quantization
        if config.enable_lora and not draft:
            # NOTE: before packing: a gate/up layer with slots is packed without its fused activation.
            self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            model.lora_context = self.lora.context
        if mode == "gguf":
            # NOTE: the file's blocks first: the floats of the layers they fill are never read
            # (nor dequantized, nor held: the empty tensors above are never touched).
            quantized = self._quantize(model, model_dir, mode, None)
            family, taken = FAMILIES[model_config.architecture], model.quantized_names()
            model.load_weights(load_weights(
                model_dir, skip=lambda name: family.checkpoint_name(name.removeprefix("model.")) in taken))
        else:
            weights = load_weights(float_checkpoint(model_dir))
            compressed = compressed_tensors_config(model_dir)
            if compressed is not None:  # int8 weights, dequantized for the float model (and kept if used)
                compressed = CompressedTensorsCheckpoint(compressed, keep=mode == "compressed-tensors")
                weights = compressed.dequantizing(weights)
            model.load_weights(weights)
            quantized = self._quantize(model, model_dir, mode, compressed)
        packing = choose_packing(self.device, self.dtype, self.batch_invariant)
        if packing is not None:
            model.pack_weights(packing, self.batch_invariant)
        resident = sum(t.nbytes for t in model.parameters()) + sum(
            t.nbytes for t in (model._packed_lm_head or ())[:1])
        self.weights_description = f"{quantized}{resident / 1e6:.0f} MB of weights"
        progress(f"weights loaded in {time.perf_counter() - start:.1f} s ({self.weights_description})"
                 + (f", packed for the {packing} matrix kernel" if packing else "")
                 + (f" (AMX tiles from {describe_amx_rows(model)} rows; measured in "
                    f"{linear.calibration_seconds * 1e3:.0f} ms)" if packing == "amx" and not self.batch_invariant
                    else ""))
        return model.eval(), backend

    def _quantize(self, model: DecoderForCausalLM, model_dir, mode: str | None,
                  compressed: CompressedTensorsCheckpoint | None) -> str:
        """Quantizes the model's linear layers as ``mode`` says (model_loader.plan_quantization
        of EngineConfig.quantization); returns what was done, for the start-up line."""
        if mode is None:
            return ""
        if mode in ("gguf", "compressed-tensors"):
            checkpoint = quantized_weights(model_dir) if mode == "gguf" else compressed.quantized

            def pick(names, weight):
                parts = [checkpoint.get(name) for name in names]
                return None if any(part is None for part in parts) else GroupQuantized.cat(parts)
        else:
            def pick(names, weight):
                return quantize_int8(weight) if weight.shape[1] % 32 == 0 else None
        packings = model.quantize_weights(pick)
        counts = {name: packings.count(name) for name in sorted(set(packings))}
        source = {"gguf": "GGUF types", "int8": "int8"}.get(mode) or f"compressed-tensors {compressed.description}"
        return (f"{source}: "
                + ", ".join(f"{count} layers {name}" for name, count in counts.items()) + "; ")

    def _allocate_caches(self, backend, model_config, allocation: KVCacheAllocation,
                         extra_blocks: int = 0) -> tuple[list, list]:
        """A model's KV cache (zeroed) and its swap space, one (key, value) pair per layer (the
        sliding layers' of num_sliding_blocks where they have a pool of their own)."""
        sliding = set(model_config.sliding_layers or ()) if allocation.num_sliding_blocks else set()

        def layer_cache(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            num_blocks = allocation.num_sliding_blocks if layer in sliding else allocation.num_blocks + extra_blocks
            return tuple(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                         for shape in backend.kv_cache_shapes(num_blocks, self.block_size))

        caches = [layer_cache(layer) for layer in range(model_config.num_hidden_layers)]
        swap = allocate_swap_space(backend.kv_cache_shapes(allocation.num_cpu_blocks, self.block_size),
                                   model_config.num_hidden_layers, self.kv_cache_dtype, pin=self.device.type == "cuda")
        return caches, swap if allocation.num_cpu_blocks else []

    def measure_memory(self) -> DeviceMemory:
        """What sizing the KV cache from the device's memory needs (called before
        :meth:`allocate`): the weights held, the activations' peak over a step of
        max_num_batched_tokens tokens with max_num_seqs rows of logits (times the drafts'),
        what the penalties' buffers and the CUDA graphs will hold, and what was taken outside
        torch since the start.

        On the CPU only with SIMULATED_DEVICE_MEMORY_ENV set (tests): the weights are
        measured, nothing else.
        """
        config = self._init.config
        if self.device.type != "cuda":
            simulated = read_int(SIMULATED_DEVICE_MEMORY_ENV)
            if simulated is None:
                raise RuntimeError("the KV cache is sized from the device's memory only on a GPU")
            models = [self.model] + ([self.draft] if self.draft is not None else [])
            weights = sum(t.nbytes for model in models for t in (*model.parameters(), *model.buffers()))
            return DeviceMemory(total=int(simulated), free_at_start=int(simulated), weights=weights,
                                peak_activations=0, non_torch=0)
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(device)
        spec = config.speculative_config
        rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))

        def peak_of(query_lens: list[int], logit_rows: int) -> int:
            torch.cuda.reset_peak_memory_stats(device)
            scratch = self._profile_forward(query_lens, logit_rows)
            torch.cuda.synchronize(device)
            return max(0, torch.cuda.max_memory_allocated(device) - weights - scratch)

        # The largest step: max_num_batched_tokens tokens in requests of at most max_model_len.
        longest = self._init.max_model_len
        tokens = config.max_num_batched_tokens
        peak = peak_of([longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else []), rows)
        # Held once the cache is allocated: the penalties' [max_num_seqs, vocab] counts and
        # prompt mask, and the CUDA graphs' pool (about a decode step's activations).
        reserved = config.max_num_seqs * self.model_config.vocab_size * 5
        if self._decode_graphs_off(config) is None:
            reserved += peak_of([1] * config.max_num_seqs, config.max_num_seqs)
        non_torch = self._free_at_start - torch.cuda.mem_get_info(device)[0] - torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        return DeviceMemory(total=torch.cuda.mem_get_info(device)[1], free_at_start=self._free_at_start,
                            weights=weights, peak_activations=peak, non_torch=max(0, non_torch), reserved=reserved)

    def _profile_forward(self, query_lens: list[int], num_rows: int) -> int:
        """One step of requests of ``query_lens`` tokens from position 0 over a one-block
        scratch cache (every token's keys written to block 0), then logits, a softmax and a
        sort (top-p's) for ``num_rows`` rows. Returns the scratch cache's bytes."""
        key_shape, value_shape = self.attention_backend.kv_cache_shapes(1, self.block_size)
        caches = [(torch.zeros(key_shape, dtype=self.kv_cache_dtype, device=self.device),
                   torch.zeros(value_shape, dtype=self.kv_cache_dtype, device=self.device))
                  for _ in range(self.model_config.num_hidden_layers)]
        lens = np.array(query_lens)
        positions = np.concatenate([np.arange(n) for n in query_lens])
        with torch.inference_mode():
            metadata = self._metadata(lens, lens, np.zeros((len(lens), -(-int(lens.max()) // self.block_size)),
                                                           dtype=np.int32), positions)
            hidden = self.model(torch.zeros(len(positions), dtype=torch.long, device=self.device),
                                to_device(positions, self.device, torch.long), caches, metadata)
            rows = torch.arange(num_rows, device=self.device) % len(positions)
            logits = self.model.compute_logits(hidden[rows]).float()
            torch.softmax(logits, dim=-1).sort(dim=-1)
        return sum(k.nbytes + v.nbytes for k, v in caches)

    def _warm_up(self) -> None:
        """Runs a prefill (WARM_UP_PREFILL_TOKENS, or less where the model is shorter) and a decode
        on block 0, so compilation happens at start-up.

        Both shapes are compiled: torch.compile treats a batch of one token apart. (Where
        steps run in one call, both take that path and nothing is compiled: the compiled
        regions then serve only a step the call leaves, compiled at its first.)
        """
        with torch.inference_mode():
            prefill = max(2, min(WARM_UP_PREFILL_TOKENS, self.batch.token_ids.shape[1] - 2))
            for query_len, seq_len in ((prefill, prefill), (1, prefill + 1)):
                positions = torch.arange(seq_len - query_len, seq_len, device=self.device)
                blocks = -(-seq_len // self.block_size)
                metadata = self._metadata(np.array([query_len]), np.array([seq_len]),
                                          np.zeros((1, blocks), dtype=np.int32), positions.cpu().numpy())
                ids = torch.zeros(query_len, dtype=torch.long, device=self.device)
                self.model(ids, positions, self.kv_caches, metadata)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Runs one step; a failure is reported in the output, never raised.

        The requests of a failed step are dropped here (the engine fails them). The step
        after it was sent before the engine knew, so it may still name them: they are
        skipped until the engine lists them as finished.
        """
        try:
            with torch.inference_mode():
                out = self._execute(sched)
            self._last_step_failed = False
            return out
        except Exception:
            self._last_step_failed = True
            for request_id in sched.num_scheduled_tokens:
                self.batch.remove(request_id)
                self._failed.add(request_id)
            return RunnerOutput(step_id=sched.step_id, error=traceback.format_exc())

    def _apply_changes(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        batch = self.batch
        if sched.kv_store or sched.kv_delete:
            # NOTE: first: this step's swaps, copies and loads may write into these blocks.
            # After a failed step, blocks it was to fill may be among them: none is stored.
            stores = sched.kv_store
            out.kv_failed = [digest for _, digest in stores] if self._last_step_failed else self.offload.store(stores)
            self.offload.delete(sched.kv_delete)
        for request_id in sched.finished_request_ids:
            batch.remove(request_id)
            self._failed.discard(request_id)
        if self._failed:
            for request_id in self._failed:
                sched.num_scheduled_tokens.pop(request_id, None)
                for changes in (sched.new_block_ids, sched.block_tables, sched.new_sliding_block_ids,
                                sched.sliding_block_tables):
                    changes.pop(request_id, None)
        # NOTE: the order matters: a swapped-out block may be reused by this very step.
        for caches, cpu_caches in ((self.kv_caches, self.cpu_caches), (self.draft_kv_caches, self.draft_cpu_caches)):
            self._move_blocks(sched.swap_out, caches, cpu_caches)
            self._move_blocks(sched.swap_in, cpu_caches, caches)
        self._copy_blocks(sched.copy_blocks)
        if self.lora is not None:
            self.lora.drop(sched.drop_loras)
            self.lora.add(sched.new_loras)
        for data in sched.new_requests:
            batch.add(data)
        for request_id, block_ids in sched.new_block_ids.items():
            batch.append_block_ids(batch.row_of[request_id], block_ids)
        for request_id, block_ids in sched.block_tables.items():
            batch.set_block_ids(batch.row_of[request_id], block_ids)
        if batch.sliding_block_table is not None:
            for request_id, block_ids in sched.new_sliding_block_ids.items():
                batch.append_block_ids(batch.row_of[request_id], block_ids, sliding=True)
            for request_id, block_ids in sched.sliding_block_tables.items():
                batch.set_block_ids(batch.row_of[request_id], block_ids, sliding=True)
        if sched.kv_load:
            out.kv_loaded, failed, out.kv_read_bytes, out.kv_read_seconds = self.offload.load(sched.kv_load)
            out.kv_failed += failed

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput(step_id=sched.step_id)
        self._apply_changes(sched, out)
        if sched.is_empty:
            return out
        batch = self.batch
        scheduled = sched.num_scheduled_tokens
        row_of = batch.row_of
        rows = np.fromiter((row_of[r] for r in scheduled), dtype=np.int64, count=len(scheduled))
        query_lens = np.fromiter(scheduled.values(), dtype=np.int32, count=len(scheduled))
        lora_ids = None if self.lora is None else batch.lora_id[rows]
        if lora_ids is not None and lora_ids.any():
            # NOTE: each adapter's requests together (decodes first still): one run of rows each.
            order = np.lexsort((lora_ids, query_lens > 1))
            rows, query_lens, lora_ids = rows[order], query_lens[order], lora_ids[order]
        elif query_lens.max() > 1:
            order = np.argsort(query_lens > 1, kind="stable")  # decodes first
            rows, query_lens = rows[order], query_lens[order]
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + query_lens
        num_drafts = self._drafts_of(rows, sched.spec_token_ids) if sched.spec_token_ids else None

        # The flattened batch: request i owns rows query_start[i]:query_start[i + 1].
        req_of_token = np.repeat(np.arange(len(rows)), query_lens)
        query_start = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        positions = np.arange(len(req_of_token), dtype=np.int32) - query_start[req_of_token] + computed[req_of_token]
        token_rows = rows[req_of_token]
        input_ids = batch.token_ids[token_rows, positions]
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        block_tables = batch.block_table[rows, :max_blocks]
        device = self.device
        graphs = self.decode_graphs
        if lora_ids is not None and self.lora.begin_step(lora_ids, query_lens):
            graphs = None  # NOTE: the graphs are the base model's
        if graphs is not None and query_lens.max() == 1 and num_drafts is None and len(rows) <= graphs.max_batch:
            slots = block_tables[np.arange(len(rows)), positions // self.block_size].astype(np.int64)
            hidden = graphs.run(input_ids, positions, seq_lens, block_tables,
                                slots * self.block_size + positions % self.block_size)
        else:
            metadata = self._metadata(query_lens, seq_lens, block_tables, positions, token_rows)
            input_tensor = to_device(input_ids, device, torch.long)
            position_tensor = to_device(positions, device, torch.long)
            hidden = self.model(input_tensor, position_tensor, self.kv_caches, metadata)
            if self.draft is not None:
                # The draft model's cache follows every token the model computes.
                self.draft(input_tensor, position_tensor, self.draft_kv_caches, metadata)
            if self.lora is not None:
                self.lora.end_step()
        batch.num_computed_tokens[rows] = seq_lens
        if batch.num_scoring_rows:
            score_prompts(self.model, batch, out if self.tp.rank == 0 else None, hidden, rows, computed, query_lens,
                          query_start)

        # Only requests whose known tokens are all computed sample; the rest are in the
        # middle of a chunked prefill. A request with drafts samples at each of them too.
        known = batch.num_tokens[rows] if num_drafts is None else batch.num_tokens[rows] + num_drafts
        samples = seq_lens == known
        if not samples.any():
            return out
        sample_rows = rows[samples]
        ends = query_start[1:][samples].astype(np.int64)
        offsets = None
        if num_drafts is None:
            logit_rows, last = sample_rows, ends - 1
        else:
            # Every position of a request with k drafts gives logits: its last k + 1 rows.
            counts = num_drafts[samples] + 1
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            logit_rows, last = np.repeat(sample_rows, counts), np.repeat(ends - counts, counts) + offsets
        last = to_device(last, device)
        md = batch.sampling_metadata(logit_rows, offsets) if self.tp.rank == 0 else None
        # NOTE: plain greedy rows with nothing else reading the logits: where the LM head's
        # kernel can, it picks the tokens without writing the logits out (never under tensor
        # parallelism, so every rank takes the logits below together).
        fused, last_hidden = None, hidden[last]
        if md is not None and Sampler.plain_greedy(md) and sched.grammar_bitmask is None and num_drafts is None:
            fused = self.model.greedy_tokens(last_hidden)
        if fused is None:
            greedy_rows = None
            if md is not None and not md.all_random:
                greedy_rows = (torch.arange(len(logit_rows), device=device) if md.all_greedy
                               else to_device(np.flatnonzero(batch.greedy[logit_rows]), device))
            logits = self.model.compute_logits(last_hidden, greedy_rows)
            if sched.grammar_bitmask is not None:
                _mask_logits(logits, logit_rows, [row_of[r] for r in sched.grammar_request_ids],
                             sched.grammar_bitmask)
        # NOTE: rank 0 samples and every other rank takes its tokens, so all keep the same ids.
        if fused is not None:
            result = SamplerOutput(sampled_token_ids=fused)
            sampled = fused
        elif self.tp.rank == 0:
            result = self.sampler(logits, md)
            sampled = result.sampled_token_ids
        else:
            sampled = torch.empty(len(logit_rows), dtype=torch.int64, device=device)
        token_ids = self.tp.broadcast(sampled.to(torch.int64)).cpu().numpy()
        entries = self._logprob_entries(result, logit_rows) if self.tp.rank == 0 and result.logprobs is not None \
            else None
        if num_drafts is not None:
            token_ids, entries = self._verify(out, sched.spec_token_ids, sample_rows, counts, token_ids, entries)
            keep = counts == 1
            sample_rows = sample_rows[keep]
        if len(sample_rows):
            batch.append_sampled(sample_rows, token_ids)
        if sched.draft_requests:
            self._propose_drafts(out, sched.draft_requests)
        if self.tp.rank != 0:
            return out
        request_ids = [batch.req_ids[row] for row in sample_rows.tolist()]
        out.sampled = dict(zip(request_ids, token_ids.tolist()))
        if entries is not None:
            out.logprobs = {request_id: entry for request_id, entry in zip(request_ids, entries) if entry is not None}
        return out

    def _logprob_entries(self, result, logit_rows: np.ndarray) -> list[TokenLogprobs | None]:
        """Each logits row's TokenLogprobs (None for rows of requests that did not ask)."""
        logprobs = result.logprobs.tolist()
        logprob_ids = result.logprob_token_ids.tolist()
        entries: list[TokenLogprobs | None] = []
        for i, row in enumerate(logit_rows.tolist()):
            num_top = int(self.batch.num_logprobs[row])
            entries.append(None if num_top < 0 else TokenLogprobs(
                token_id=logprob_ids[i][0], logprob=logprobs[i][0],
                top_token_ids=logprob_ids[i][1 : 1 + num_top], top_logprobs=logprobs[i][1 : 1 + num_top]))
        return entries

    def _propose_drafts(self, out: RunnerOutput, requests: dict[str, int]) -> None:
        """The draft model's next drafts for ``requests`` (id to how many), whose token this
        step sampled: greedily, one position at a time for all of them, writing its K/V of
        the token and of each draft but the last into the slots the scheduler allocated
        ahead."""
        batch = self.batch
        known = [(batch.row_of[r], n) for r, n in requests.items() if r in batch.row_of]
        if not known:
            return
        device = self.device
        rows = np.array([row for row, _ in known], dtype=np.int64)
        counts = np.array([n for _, n in known], dtype=np.int64)
        positions = (batch.num_tokens[rows] - 1).astype(np.int32)  # each request's newest token
        tokens = batch.token_ids[rows, positions].astype(np.int64)
        drafts: list[list[int]] = [[] for _ in known]
        active = np.arange(len(rows))
        for i in range(int(counts.max())):
            active = active[counts[active] > i]
            seq_lens = positions[active] + 1
            tables = batch.block_table[rows[active], :-(-int(seq_lens.max()) // self.block_size)]
            metadata = self._metadata(np.ones(len(active), dtype=np.int32), seq_lens, tables, positions[active],
                                      rows[active])
            hidden = self.draft(torch.from_numpy(tokens[active]).to(device),
                                torch.from_numpy(positions[active]).to(device, torch.long), self.draft_kv_caches,
                                metadata)
            proposed = self.draft.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            tokens[active] = proposed
            positions[active] += 1
            for j, token in zip(active.tolist(), proposed.tolist()):
                drafts[j].append(token)
        out.draft_token_ids = {batch.req_ids[row]: d for row, d in zip(rows.tolist(), drafts)}

    def _drafts_of(self, rows: np.ndarray, spec: dict[str, list[int]]) -> np.ndarray:
        """Writes each request's drafts after its known tokens; returns their counts by row."""
        batch = self.batch
        num_drafts = np.zeros(len(rows), dtype=batch.num_tokens.dtype)
        index_of = {row: i for i, row in enumerate(rows.tolist())}
        for request_id, drafts in spec.items():
            row = batch.row_of.get(request_id)
            if row is None or row not in index_of:
                continue  # failed in an earlier step
            start = batch.num_tokens[row]
            batch.token_ids[row, start:start + len(drafts)] = drafts
            num_drafts[index_of[row]] = len(drafts)
        return num_drafts

    def _verify(self, out: RunnerOutput, spec: dict[str, list[int]], sample_rows: np.ndarray, counts: np.ndarray,
                token_ids: np.ndarray, entries: list | None) -> tuple[np.ndarray, list | None]:
        """Keeps each speculating request's drafts up to the first that differs from the
        token sampled at its position, and the sample there (into ``out.spec_sampled``);
        returns the tokens and logprobs of the other requests.

        Drafts are a function of the tokens before them, so a draft kept exactly when the
        sample at its position equals it leaves the outputs distributed as without drafts
        (engine/core/drafting.py). The drafts rejected leave the request's computed tokens.
        """
        batch = self.batch
        starts = np.cumsum(counts) - counts
        single = counts == 1
        for i in np.flatnonzero(~single).tolist():
            row, start, k = int(sample_rows[i]), int(starts[i]), int(counts[i]) - 1
            request_id = batch.req_ids[row]
            drafted = spec[request_id]
            tokens = token_ids[start:start + k + 1].tolist()
            accepted = 0
            while accepted < k and tokens[accepted] == drafted[accepted]:
                accepted += 1
            kept = tokens[:accepted + 1]
            position = batch.num_tokens[row]
            batch.token_ids[row, position:position + len(kept)] = kept
            batch.num_tokens[row] = position + len(kept)
            batch.num_computed_tokens[row] -= k - accepted
            batch.count_output(row, kept)
            out.spec_sampled[request_id] = kept
            if entries is not None and entries[start] is not None:
                out.spec_logprobs[request_id] = entries[start:start + len(kept)]
        firsts = starts[single]
        return token_ids[firsts], None if entries is None else [entries[j] for j in firsts.tolist()]

    def _metadata(self, query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                  positions: np.ndarray, token_rows: np.ndarray | None = None,
                  table: np.ndarray | None = None) -> AttentionMetadata:
        """The attention metadata of a batch (token_rows: None for the warm-up's block 0), and
        of its sliding layers' own tables where they have them (``table``: the batch's table
        that ``block_tables`` was gathered from)."""
        device = self.device
        block_size = self.block_size
        batch = self.batch
        table = batch.block_table if table is None and batch is not None else table
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        if token_rows is None:
            block_ids = np.zeros(len(positions), dtype=np.int64)
        else:
            block_ids = table[token_rows, positions // block_size].astype(np.int64)
        slot_mapping = block_ids * block_size + positions % block_size
        metadata = AttentionMetadata(
            num_tokens=int(query_start[-1]),
            query_lens=query_lens.tolist(),
            seq_lens=seq_lens.tolist(),
            query_start_loc=to_device(query_start, device),
            seq_lens_tensor=to_device(seq_lens.astype(np.int32), device),
            block_tables=to_device(block_tables, device),
            slot_mapping=to_device(slot_mapping, device),
            block_tables_host=block_tables,
            block_size=block_size,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        self.attention_backend.prepare(metadata)
        sliding = None if batch is None else batch.sliding_block_table
        if sliding is not None and table is not sliding:
            # NOTE: each request's first token's row is its row in the batch.
            tables = (np.zeros_like(block_tables) if token_rows is None
                      else sliding[token_rows[query_start[:-1]], :block_tables.shape[1]])
            metadata.sliding = self._metadata(query_lens, seq_lens, tables, positions, token_rows, sliding)
        return metadata

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies: of the global pool's blocks in every layer that reads it, and
        of the sliding layers' own (numbered after the global pool's blocks) in theirs."""
        if not pairs:
            return
        sliding = self.batch.sliding_block_table is not None
        if not sliding:
            self._move_blocks(pairs, self.kv_caches, self.kv_caches)
            self._move_blocks(pairs, self.draft_kv_caches, self.draft_kv_caches)
            return
        offset, layers = self.num_global_blocks, set(self.model_config.sliding_layers)
        own = [cache for i, cache in enumerate(self.kv_caches) if i in layers]
        others = [cache for i, cache in enumerate(self.kv_caches) if i not in layers]
        self._move_blocks([(s, d) for s, d in pairs if s < offset], others, others)
        self._move_blocks([(s - offset, d - offset) for s, d in pairs if s >= offset], own, own)

    def _move_blocks(self, pairs: list[tuple[int, int]], src_caches, dst_caches) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([src for src, _ in pairs])
        dst_ids = torch.tensor([dst for _, dst in pairs])
        for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
            self.attention_backend.copy_blocks(src_k, dst_k, src_ids, dst_ids, self.block_size)
            self.attention_backend.copy_blocks(src_v, dst_v, src_ids, dst_ids, self.block_size)


def allocate_swap_space(shapes: tuple[tuple[int, ...], ...], num_layers: int, dtype: torch.dtype,
                        pin: bool) -> list[tuple[torch.Tensor, ...]]:
    """The swap space: per layer, a (keys, values) pair of the cache's ``shapes`` in CPU memory,
    all of them views of one buffer (pinned when the cache is on a GPU: one pinned allocation,
    not two per layer that the driver maps and registers apart).

    NOTE: left uninitialised: a block is only ever read back after a whole block was swapped
    into it; and unpinned pages that are never touched cost no memory (4 GiB by default;
    zeroing them took about a second of every start).
    """
    sizes = [math.prod(shape) for shape in shapes]
    buffer = torch.empty(num_layers * sum(sizes), dtype=dtype, pin_memory=pin)
    views = iter(buffer.split(sizes * num_layers))
    return [tuple(next(views).view(shape) for shape in shapes) for _ in range(num_layers)]


def _mask_logits(logits: torch.Tensor, sample_rows: np.ndarray, grammar_rows: list[int],
                 bitmask: np.ndarray) -> None:
    """Sets to -inf, in place, the logits of the tokens the grammars of structured requests
    do not allow (bit i of word w allows token 32 w + i), with one unpack and one masked
    fill over their rows.

    Args:
        logits: ``[len(sample_rows), V]``, the step's sampling rows.
        sample_rows: Batch row of each logits row.
        grammar_rows: Batch row of each bitmask row.
        bitmask: ``[len(grammar_rows), ceil(V / 32)]`` int32.
    """
    position = np.full(int(max(sample_rows.max(), max(grammar_rows))) + 1, -1, dtype=np.int64)
    position[sample_rows] = np.arange(len(sample_rows))
    index = position[np.asarray(grammar_rows, dtype=np.int64)]
    keep = index >= 0  # NOTE: a row the engine thought samples always does; guard anyway
    index, bitmask = index[keep], bitmask[keep]
    # NOTE: unpacked by numpy (0.3 ms for 64 rows of 49,152 tokens); a shift-and-mask in torch
    # took several times longer.
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, count=logits.shape[1],
                         bitorder="little")
    disallowed = to_device(np.logical_not(bits, out=bits).view(np.bool_), logits.device)
    if len(index) == logits.shape[0] and (index == np.arange(len(index))).all():
        logits.masked_fill_(disallowed, float("-inf"))  # every sampling row is structured
    else:
        rows = to_device(index, logits.device)
        logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
