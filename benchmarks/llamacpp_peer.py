"""Runs benchmark workloads through llama.cpp (llama-cpp-python), in its own virtual
environment, on a GGUF file as it ships (its quantized weights).

This file imports nothing of Pagoda's: ``pagoda bench compare --peer llamacpp`` writes each
workload's prompts (token ids) to a JSON file and runs this script with the llama.cpp
environment's interpreter. Every request is a sequence of one llama.cpp context: prompts are
decoded in batches of up to ``--n-batch`` tokens (each prompt's last token asks for logits),
then every unfinished sequence decodes one token per ``llama_decode``, greedily (argmax),
until its output length. It prints one JSON line per run.

Usage (normally through ``pagoda bench compare``):

    /path/to/llamacpp-venv/bin/python benchmarks/llamacpp_peer.py --gguf FILE --workloads FILE.json

With ``--quantize TYPE OUT`` it writes the GGUF file quantized by llama.cpp's own quantizer
instead (``pagoda bench random-model --gguf``): TYPE is one of QUANT_TYPES.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _first(module, *names):
    """The first of ``names`` the bindings have (llama.cpp renames its API now and then)."""
    for name in names:
        function = getattr(module, name, None)
        if function is not None:
            return function
    raise AttributeError(f"llama_cpp has none of {names}")


class Runner:
    def __init__(self, gguf: str, n_ctx: int, n_seq: int, n_batch: int, threads: int, verbose: bool = False,
                 extra_bufts: bool = True) -> None:
        import llama_cpp as ll
        import numpy as np

        self.ll, self.np = ll, np
        if not verbose:
            # NOTE: kept on self: llama.cpp holds the callback for the process's life.
            self._quiet = ll.llama_log_callback(lambda level, text, data: None)
            ll.llama_log_set(self._quiet, None)
        ll.llama_backend_init()
        model_params = ll.llama_model_default_params()
        if hasattr(model_params, "use_extra_bufts"):
            model_params.use_extra_bufts = extra_bufts
        self.model = _first(ll, "llama_model_load_from_file", "llama_load_model_from_file")(gguf.encode(),
                                                                                          model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        if hasattr(params, "kv_unified"):
            # NOTE: a cache stream per sequence (n_ctx / n_seq cells each): with one unified
            # cache every token attends over every sequence's cells, masked.
            params.kv_unified = False
        self.ctx = _first(ll, "llama_init_from_model", "llama_new_context_with_model")(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        vocab = ll.llama_model_get_vocab(self.model) if hasattr(ll, "llama_model_get_vocab") else self.model
        self.n_vocab = _first(ll, "llama_vocab_n_tokens", "llama_n_vocab")(vocab)
        self.n_batch = n_batch
        self.batch = ll.llama_batch_init(n_batch, 0, n_seq)

    def clear(self) -> None:
        ll = self.ll
        if hasattr(ll, "llama_memory_clear"):
            ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        else:
            _first(ll, "llama_kv_self_clear", "llama_kv_cache_clear")(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """One llama_decode of (token, position, sequence, wants logits); returns the argmax
        token of each sequence that wanted logits."""
        batch, ll = self.batch, self.ll
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(items)
        if ll.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (is the context too small?)")
        out = {}
        for i, (_, _, seq, logits) in enumerate(items):
            if logits:
                row = self.np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out[seq] = int(row.argmax())
        return out

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        self.clear()
        outputs: list[list[int]] = [[] for _ in prompts]
        pending: list[tuple[int, int, int, bool]] = []
        for seq, prompt in enumerate(prompts):
            pending += [(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
        for start in range(0, len(pending), self.n_batch):
            for seq, token in self._decode(pending[start:start + self.n_batch]).items():
                outputs[seq].append(token)
        while True:
            items = [(out[-1], len(prompts[seq]) + len(out) - 1, seq, True)
                     for seq, out in enumerate(outputs) if len(out) < output_lens[seq]]
            if not items:
                return outputs
            for start in range(0, len(items), self.n_batch):
                for seq, token in self._decode(items[start:start + self.n_batch]).items():
                    outputs[seq].append(token)


def cpu_lists_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX tiles."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


#: The file types --quantize writes: name -> llama.cpp's llama_ftype constant.
QUANT_TYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
               "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
               "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def quantize(source: str, kind: str, target: str, threads: int) -> int:
    """Writes ``source`` (a float GGUF file) quantized to ``kind`` at ``target``, by llama.cpp."""
    import llama_cpp as ll

    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, QUANT_TYPES[kind])
    params.nthread = threads
    start = time.perf_counter()
    failed = ll.llama_model_quantize(source.encode(), target.encode(), params)
    print(json.dumps({"event": "quantized", "type": kind, "failed": failed, "seconds": time.perf_counter() - start}),
          flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="the GGUF file")
    parser.add_argument("--workloads", help="JSON written by `pagoda bench compare`")
    parser.add_argument("--quantize", nargs=2, metavar=("TYPE", "OUT"), help="write the file quantized instead")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extra-bufts", choices=["auto", "on", "off"], default="auto",
                        help="llama.cpp's repacked weight buffers (its default, on): auto is off where the CPU "
                             "lists AMX, whose repack died with SIGILL on a machine of this project (PEERS.md), "
                             "on elsewhere")
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument("--verbose", action="store_true", help="keep llama.cpp's own log")
    args = parser.parse_args()
    if args.quantize:
        return quantize(args.gguf, args.quantize[0], args.quantize[1], args.threads)
    if not args.workloads:
        parser.error("--workloads (or --quantize) is needed")
    with open(args.workloads) as f:
        workloads = json.load(f)
    n_seq = max(len(run["prompts"]) for w in workloads for run in w["runs"])
    longest = max(len(p) + n for w in workloads for run in w["runs"] for p, n in zip(run["prompts"], run["output_lens"]))
    start = time.perf_counter()
    extra_bufts = args.extra_bufts == "on" or (args.extra_bufts == "auto" and not cpu_lists_amx())
    runner = Runner(args.gguf, n_seq * (-(-longest // 256) * 256), n_seq, args.n_batch, args.threads, args.verbose,
                    extra_bufts)
    print(json.dumps({"event": "started", "seconds": time.perf_counter() - start, "extra_bufts": extra_bufts}),
          flush=True)
    for workload in workloads:
        for run in workload["runs"]:
            start = time.perf_counter()
            outputs = runner.generate(run["prompts"], run["output_lens"])
            seconds = time.perf_counter() - start
            print(json.dumps({"event": "run", "workload": workload["name"], "warmup": run["warmup"],
                              "seconds": seconds, "output_tokens": sum(len(o) for o in outputs),
                              "first_output": outputs[0][:16]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
