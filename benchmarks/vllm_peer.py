"""Runs benchmark workloads through vLLM (the peer), in vLLM's own virtual environment.

This file imports nothing of Pagoda's: ``pagoda bench compare`` writes each workload's
prompts (token ids) to a JSON file and runs this script with vLLM's interpreter, so both
engines see exactly the same prompts. It prints one JSON line per timed run.

Usage (normally through ``pagoda bench compare``):

    /path/to/vllm-venv/bin/python benchmarks/vllm_peer.py --model DIR --workloads FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--workloads", required=True, help="JSON written by `pagoda bench compare`")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", default=None, metavar="JSON",
                        help='LoRA: {"modules": {name: path}, "max_loras": N, "max_lora_rank": R}; a run\'s '
                             '"loras" then names each prompt\'s adapter (null: the base model)')
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workloads) as f:
        workloads = json.load(f)
    lora = json.loads(args.lora) if args.lora else None
    extra = {}
    if lora is not None:
        from vllm.lora.request import LoRARequest

        extra = {"enable_lora": True, "max_loras": lora["max_loras"], "max_lora_rank": lora["max_lora_rank"],
                 "max_cpu_loras": max(lora["max_loras"], len(lora["modules"]))}
        adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora["modules"].items())}
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, **extra)
    print(json.dumps({"event": "started", "seconds": time.perf_counter() - start}), flush=True)
    for workload in workloads:
        for run in workload["runs"]:
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
            # NOTE: a workload with a "json_schema" holds every request to it (structured outputs).
            schema, structured = workload.get("json_schema"), None
            if schema is not None:
                from vllm.sampling_params import StructuredOutputsParams  # NOTE: vLLM >= 0.11 names it so

                structured = StructuredOutputsParams(json=schema)
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=structured)
                      for n in run["output_lens"]]
            requests = None
            if run.get("loras") is not None:
                requests = [None if name is None else adapters[name] for name in run["loras"]]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
            seconds = time.perf_counter() - start
            print(json.dumps({
                "event": "run", "workload": workload["name"], "warmup": run["warmup"], "seconds": seconds,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                "first_output": list(outputs[0].outputs[0].token_ids[:16]),
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
