"""LLM: offline batch generation on the same core loop as the server."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pagoda.engine.frontend.data_parallel import create_engine
from pagoda.engine.frontend.embedding import embedding_of, embedding_params
from pagoda.engine.config import EngineConfig
from pagoda.engine.frontend.output_processor import OutputKind
from pagoda.engine.lora import LoRAError, LoRARequest
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


def log_to_stderr() -> None:
    """Pagoda's INFO lines (the start-up stages) to stderr, as vLLM's LLM shows its own, unless
    the program configured logging itself (a handler on the root or on "pagoda")."""
    logger = logging.getLogger("pagoda")
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # NOTE: silent once the program configures the root logger later (basicConfig, a log
    # file): the records go on to its handlers, and are not printed twice.
    handler.addFilter(lambda _record: not logging.getLogger().handlers)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LLM:
    """Generates for a batch of prompts, vLLM style.

    Example:
        >>> llm = LLM(dtype="float32", max_model_len=512)
        >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        >>> out[0].outputs[0].text

    Args:
        model: Model directory or GGUF file; None for the default model.
        plugin_manager: A pluggy PluginManager to use instead of building one from
            the config (see pagoda.engine.core.plugin_manager.create_plugin_manager).
        **kwargs: Any EngineConfig field (dtype, block_size, num_kv_blocks,
            max_model_len, max_num_seqs, max_num_batched_tokens,
            enable_chunked_prefill, ...).
    """

    def __init__(self, model: str | None = None, plugin_manager=None, **kwargs) -> None:
        unknown = sorted(set(kwargs) - set(EngineConfig.field_names()))
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(EngineConfig.field_names())}")
        self.config = EngineConfig(model=model, **kwargs)
        log_to_stderr()
        self._loop = new_event_loop()
        self.engine = create_engine(self.config, plugin_manager)
        try:
            self._loop.run_until_complete(self.engine.start())
        except BaseException:
            self._loop.run_until_complete(self.engine.shutdown())
            self._loop.close()
            raise

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name for it)."""
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for each prompt (a string or a list of token ids).

        Args:
            prompts: One prompt or a list.
            sampling_params: One for all prompts, or one per prompt.
            priority: Per-prompt priority (lower first) for the priority policy.
            use_tqdm: A progress bar over the prompts on stderr, where stderr is a terminal
                (as vLLM's, which shows it everywhere).
            lora_request: The LoRA adapter for all prompts, or one per prompt (None: the base
                model); an adapter not loaded yet is loaded from its path (needs
                ``enable_lora=True``).

        Returns:
            One finished RequestOutput per prompt, in order.

        Raises:
            ValueError: A prompt or parameter is invalid; nothing was run.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = self._lora_names(lora_request, len(prompts))
        bar = None
        if use_tqdm and len(prompts) > 1 and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", unit="prompt")
        try:
            outputs = self._loop.run_until_complete(self._run(prompts, params_list, priorities, bar, loras))
        finally:
            if bar is not None:
                bar.close()
        if any(p.logprobs is not None or p.prompt_logprobs is not None for p in params_list):
            self._decode_logprobs(outputs)
        return outputs

    def _lora_names(self, lora_request, count: int) -> list[str | None]:
        """Each prompt's adapter name, loading adapters named for the first time."""
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"got {len(requests)} LoRA requests for {count} prompts")
        for request in {r for r in requests if r is not None}:
            loaded = self.engine.loras.get(request.lora_name) if self.engine.loras is not None else None
            if loaded is None:
                self._loop.run_until_complete(self.engine.load_lora_adapter(request.lora_name, request.lora_path))
            elif request.lora_path and Path(request.lora_path).expanduser() != Path(loaded.path):
                raise LoRAError(f"LoRA adapter {request.lora_name!r} is loaded from {loaded.path}, not "
                                f"{request.lora_path}")
        return [None if r is None else r.lora_name for r in requests]

    def _decode_logprobs(self, outputs: list[RequestOutput]) -> None:
        """Each logprobs entry's tokens as text (vLLM's ``Logprob.decoded_token``), one decode per
        distinct token."""
        texts: dict[int, str] = {}
        decode = self.engine.tokenizer.decode
        entries = [e for out in outputs for e in (out.prompt_logprobs or []) if e is not None]
        entries += [e for out in outputs for o in out.outputs for e in (o.logprobs or [])]
        for entry in entries:
            for token_id in entry:
                if token_id not in texts:
                    texts[token_id] = decode([token_id])
            entry.decoded = {token_id: texts[token_id] for token_id in entry}

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[np.ndarray]:
        """One embedding per prompt: its final hidden states pooled as the engine's
        ``pooling`` says (last token by default), unit length unless
        ``normalize_embeddings=False``.

        Returns:
            One float32 vector of the model's hidden size per prompt, in order.

        Raises:
            ValueError: A prompt is invalid (empty, or too long for max_model_len).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = embedding_params(self.config)
        outputs = self._loop.run_until_complete(self._run(prompts, [params] * len(prompts), [0] * len(prompts)))
        return [embedding_of(output, self.config) for output in outputs]

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _run(self, prompts: list[Prompt], params_list: list[SamplingParams],
                   priorities: list[int], bar=None, loras: list[str | None] | None = None) -> list[RequestOutput]:
        streams = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, params, priority, lora in zip(prompts, params_list, priorities, loras):
                streams.append(self.engine.add_request(prompt, params, priority=priority,
                                                       output_kind=OutputKind.FINAL, lora_name=lora))
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        results = await asyncio.gather(*(self._last(stream, bar) for stream in streams))
        return list(results)

    async def _last(self, stream, bar=None) -> RequestOutput:
        output = None
        async for output in self.engine.stream_outputs(stream):
            pass
        if bar is not None:
            bar.update(1)
        return output

    def sleep(self, level: int = 1) -> None:
        """Frees the worker's memory (its process) until wake_up(), as vLLM's ``LLM.sleep``."""
        self._loop.run_until_complete(self.engine.sleep(level))

    def wake_up(self) -> None:
        """Starts the worker again after sleep()."""
        self._loop.run_until_complete(self.engine.wake_up())

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, as vLLM's ``LLM.reset_prefix_cache`` does.

        Returns:
            True when the whole cache was emptied; False when requests still hold
            cached blocks (those stay cached).
        """
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the worker process; the LLM cannot be used afterwards."""
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(self.engine.shutdown())
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed() and not loop.is_running():
            try:
                self.shutdown()
            except Exception:
                pass
