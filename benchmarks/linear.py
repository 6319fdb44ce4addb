"""`pagoda bench linear`: the CPU's matrix products per batch size, by packing.

Times one decoder's four products (q/k/v, o, gate/up, down) over ``--layers`` layers with
distinct weights, so that the weights come from memory as they do in the model, for each
packing this machine has:

- ``onednn``: oneDNN's blocked layout and matrix products, the MLP's SiLU(gate) * up as an
  element-wise pass after the gate/up product;
- ``blocked``: Pagoda's kernel (native/csrc/packed_linear.c) with AVX512-BF16,
  SiLU(gate) * up in the gate/up product's epilogue (what the model runs);
- ``amx``: the same kernel and layout, on AMX tiles from the number of rows calibrated per
  shape (engine/models/linear.py: amx_min_rows; the calibration runs before the timing);
- ``q8``, ``q4m``: the quantized kernel (native/csrc/quant_linear.c) on the
  weights quantized to int8 (``--quantization int8``) and to GGUF's Q4_1 (the default
  model's file), activations quantized per row; SiLU(gate) * up element-wise. Where AMX
  tiles run, from the calibrated number of rows on them (quant_amx_min_rows), the weight
  dequantized a chunk at a time.

Each layer's products are one compiled function, as the model's regions are, so every
variant pays the same per-call costs. The shapes default to SmolLM2-135M's.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from pagoda.benchmarks.progress import emit, table
from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda.engine.models import linear  # the packings, and the pagoda:: ops they run
from pagoda.engine.models import quantized


def _variants(args: argparse.Namespace, weights: dict[str, torch.Tensor]) -> dict:
    """name -> (pack a [N, K] weight, pack the [2I, K] gate/up weight, one layer's products).

    Each layer is one compiled function, as in the model (engine/models/decoder.py), so that
    SiLU(gate) * up is fused into one element-wise pass where it is not in the kernel and
    every variant pays the same per-call costs. ``weights``: one layer's, to calibrate "amx" on.
    """
    inter, hidden = args.intermediate_size, args.hidden_size
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    out_features = {"qkv": qkv, "o": hidden, "gate_up": 2 * inter, "down": hidden}

    def layer_of(packing: str, rows: dict[str, int]):
        # NOTE: each product by the method the model's layer would have (engine/models/linear.py)
        methods = {name: linear.method_for(packing, rows[name],
                                           fused_silu_mul=name == "gate_up" and packing in linear.BLOCKED_LAYOUT)
                   for name in out_features}

        def layer(x, attn, w_qkv, w_o, w_gate_up, w_down):
            act = methods["gate_up"].silu_mul(x, w_gate_up, inter)
            # NOTE: every result is returned, or the compiler drops the products it does not need.
            return (methods["qkv"].apply(x, w_qkv, None, qkv), methods["o"].apply(attn, w_o, None, hidden),
                    methods["down"].apply(act, w_down, None, hidden))
        return torch.compile(layer, dynamic=True)

    variants = {}
    for packing in filter(linear.packing_available, linear.PACKINGS):
        pack = functools.partial(linear.pack_weight, packing=packing)
        pack_mlp = linear_kernels.pack_silu_mul_weight if packing in linear.BLOCKED_LAYOUT else pack
        rows = dict.fromkeys(out_features, 0)
        if packing == "amx":
            rows = {name: linear.amx_min_rows((pack_mlp if name == "gate_up" else pack)(w), out_features[name],
                                              fused_silu_mul=name == "gate_up")
                    for name, w in weights.items()}
            print(f"amx: the tiles from {rows} rows")
        variants[packing] = (pack, pack_mlp, layer_of(packing, rows))
    if kernel_library.available() and hidden % 32 == inter % 32 == 0:
        # the quantized kernel (inputs in groups of 32): int8 from the weights, and Q4_1 as in a GGUF file
        for packing, quantize in (("q8", quantized.quantize_int8), ("q4m", _q4_1)):
            pack = functools.partial(_pack_quantized, quantize=quantize)
            rows = dict.fromkeys(out_features, 0)
            if linear.packing_available("amx"):  # as the model runs them: many rows on the tiles
                rows = {name: linear.quant_amx_min_rows(pack(w), packing, out_features[name], w.shape[1],
                                                        fused_silu_mul=name == "gate_up")
                        for name, w in weights.items()}
                print(f"{packing}: the tiles from {rows} rows")
            variants[packing] = (pack, pack, layer_of(packing, rows))
    return variants


def _q4_1(weight: torch.Tensor) -> quantized.GroupQuantized:
    """``weight`` as a GGUF file's Q4_1 blocks hold it (gguf's quantizer), read as the engine reads them."""
    import gguf

    blocks = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.Q4_1)
    return quantized.from_gguf(blocks, "Q4_1", tuple(weight.shape))


def _pack_quantized(weight: torch.Tensor, quantize) -> torch.Tensor:
    return quantized.pack(quantize(weight))


def _forward(layer_fn, x: torch.Tensor, attn: torch.Tensor, layers: list) -> None:
    for weights in layers:
        layer_fn(x, attn, *weights)


def run_linear_bench(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    hidden, inter = args.hidden_size, args.intermediate_size
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    shapes = {"qkv": (qkv, hidden), "o": (hidden, args.num_heads * args.head_dim), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter)}
    weights = [{name: torch.randn(shape, dtype=torch.bfloat16) * 0.02 for name, shape in shapes.items()}
               for _ in range(args.layers)]
    flop_per_row = 2 * sum(n * k for n, k in shapes.values()) * args.layers
    variants = _variants(args, weights[0])
    if not variants:
        print("no packing is available on this machine (bfloat16 needs oneDNN or AVX512-BF16; the quantized "
              "kernel a C compiler and sizes in multiples of 32)")
        return 1
    packed = {name: [[(pack_mlp if key == "gate_up" else pack)(w) for key, w in layer.items()]
                     for layer in weights]
              for name, (pack, pack_mlp, _) in variants.items()}
    print(f"{args.layers} layers x (qkv {qkv}x{hidden}, o {hidden}x{args.num_heads * args.head_dim}, "
          f"gate/up {2 * inter}x{hidden} + SiLU-mul, down {hidden}x{inter}), bfloat16 activations, "
          f"{torch.get_num_threads()} threads; ms (best of {args.repeats}) and GFLOP/s")
    records = []
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, hidden, dtype=torch.bfloat16)
            attn = torch.randn(rows, args.num_heads * args.head_dim, dtype=torch.bfloat16)  # o_proj's input
            forwards = {name: functools.partial(_forward, layer_fn, x, attn, packed[name])
                        for name, (_, _, layer_fn) in variants.items()}
            # NOTE: two warm-up runs: the first compiles, the second takes what is created
            # lazily at the first real call (oneDNN's primitives for the shape), so that even
            # one repeat times the product alone.
            for forward in forwards.values():
                forward()
                forward()
            # NOTE: the variants take turns, so that a drift in the machine's speed (tens of
            # percent here within minutes) is shared between them.
            best = dict.fromkeys(forwards, float("inf"))
            for _ in range(args.repeats):
                for name, forward in forwards.items():
                    start = time.perf_counter()
                    forward()
                    best[name] = min(best[name], time.perf_counter() - start)
            result = {"rows": rows}
            for name, seconds in best.items():
                result[f"{name}_ms"] = float(f"{seconds * 1e3:.3g}")
                # NOTE: three significant digits, not a fixed decimal: a tiny shape's rate
                # is well below 0.1 GFLOP/s and must not print as 0.
                result[f"{name}_gflops"] = float(f"{flop_per_row * rows / seconds / 1e9:.3g}")
            records.append(result)
            emit(args, result, f"{rows} rows: " + ", ".join(f"{name} {result[f'{name}_ms']} ms" for name in best))
    print()
    print(table(records, [("rows", "rows", "d")] + [(f"{name} {unit}", f"{name}_{key}", "")
                                                  for name in variants for unit, key in (("ms", "ms"),
                                                                                        ("GFLOP/s", "gflops"))]))
    return 0


def add_linear_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("linear", help="matrix products per batch size: oneDNN against Pagoda's bfloat16 "
                                            "and quantized kernels (CPU)")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 64, 256, 2048],
                   help="batch sizes (tokens), comma-separated")
    p.add_argument("--layers", type=int, default=30, help="layers with distinct weights")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden-size", type=int, default=576)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.set_defaults(func=run_linear_bench)
