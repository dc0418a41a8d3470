"""How much does onnxruntime's MatMulNBits cost for M rows against one row, on this CPU? (the verify curve's floor)

    python tools/measure/kernel_curve.py [--k 1536] [--n 8960] [--rows 1,2,3,4,5,6,8,9,16,32] [--levels 1,4] [--zero-points]
                                 [--blocks 32,128] [--layers 14] [--threads N] [--bandwidth] [--out kernel_curve.md]

A verify pass of T rows reads the same weights as a one-token pass, so if the int4 products were bound by
weight bandwidth a pass of up to ~8 rows would cost close to one row. This times a stack of MatMulNBits
nodes (the target's MLP shapes by default: 1536 -> 8960 -> 1536, ``--layers`` times, each with its own
random int4 blocks and the default zero point, so the weights stream from memory as a model's do) for each
row count, accuracy level (1: float32 compute, 4: int8 compute, the bundle's) and block size (32: what the
carried Q4_K blocks need), beside the same stack as float32 MatMuls (MLAS's SGEMM) and, with ``--int8-rows``,
as ``--layer-products int8``'s integer products, and prints each median
time and its ratio to that kernel's one-row time. Nothing else runs in the session, so the ratios are the
kernels' own; a model's pass adds attention, the lm_head and host work on top.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specdec.bench.bench import cpu_model
from specdec.bench.weights_read import read_bandwidth
from specdec.runners.standard import session_options  # the runtime's own: its shared thread pool


FLOAT_LAYERS = 6  # pairs in the float32 stack: 660 MB (a model proto holds at most 2 GB)


def nbits_model(k: int, n: int, block: int, level: int, layers: int, zero_points: bool = False) -> bytes:
    """``layers`` pairs of products, K -> N then N -> K (an MLP stack), each with its own random int4 blocks
    (and, with ``zero_points``, random 4-bit zero points, as asymmetric blocks carry)."""
    rng = np.random.default_rng(0)
    nodes, initializers = [], []
    for index, (rows_in, rows_out) in enumerate([(k, n), (n, k)] * layers):
        blocks = -(-rows_in // block)
        data = rng.integers(0, 256, (rows_out, blocks, block // 2), dtype=np.uint8)
        scales = (rng.random((rows_out, blocks)) * (0.02 / np.sqrt(rows_in))).astype(np.float32)
        initializers += [numpy_helper.from_array(data, f"W{index}"), numpy_helper.from_array(scales, f"S{index}")]
        inputs = [f"y{index - 1}" if index else "x", f"W{index}", f"S{index}"]
        if zero_points:
            packed = rng.integers(0, 256, (rows_out, -(-blocks // 2)), dtype=np.uint8)
            initializers.append(numpy_helper.from_array(packed, f"Z{index}"))
            inputs.append(f"Z{index}")
        nodes.append(helper.make_node("MatMulNBits", inputs, [f"y{index}"], domain="com.microsoft", K=rows_in,
                                      N=rows_out, bits=4, block_size=block, accuracy_level=level))
    return _model(nodes, k, initializers)


def nbits_bytes(k: int, n: int, block: int, level: int, layers: int, zero_points: bool) -> int:
    """Bytes one pass streams through the stack as MLAS holds it packed: at level 4 (int8 compute) a block is its
    codes, a float32 scale and a float32 block sum (zero points fold into the sum); at levels 0-3 (float compute)
    the codes, the float32 scale and, if present, the 4-bit zero point."""
    per_block = block // 2 + (8 if level == 4 else 4 + (0.5 if zero_points else 0))
    return int(2 * layers * n * (-(-k // block)) * per_block)


def int8_rows_model(k: int, n: int, layers: int) -> bytes:
    """The same stack as ``--layer-products int8`` writes it (export/int8_rows.py): MatMulInteger over 7-bit
    channel weights, 8-bit activations scaled per row."""
    from specdec.export.graph_writer import NodeList
    from specdec.export.int8_rows import channel_quantized, row_quantized_matmul, row_zero_points

    rng = np.random.default_rng(0)
    sink = NodeList()
    sink.node("Unsqueeze", ["x", sink.constant([0])], ["y-1"])  # the exporter's rows: [1, M, K]
    zero_points = row_zero_points(sink, "y-1")
    for index, (rows_in, rows_out) in enumerate([(k, n), (n, k)] * layers):
        q, scale = channel_quantized((rng.standard_normal((rows_out, rows_in)) / np.sqrt(rows_in)).astype(np.float32))
        row_quantized_matmul(sink, f"y{index - 1}", sink.initializer(f"W{index}", q),
                             sink.initializer(f"S{index}", scale), f"p{index}", f"y{index}", zero_points)
    sink.node("Squeeze", [f"y{2 * layers - 1}", sink.constant([0])], ["y_rows"])
    return _model(sink.nodes, k, sink.initializers)


def float_model(k: int, n: int, layers: int) -> bytes:
    rng = np.random.default_rng(0)
    nodes, initializers = [], []
    for index, (rows_in, rows_out) in enumerate([(k, n), (n, k)] * layers):
        weights = (rng.standard_normal((rows_in, rows_out)) / np.sqrt(rows_in)).astype(np.float32)
        initializers.append(numpy_helper.from_array(weights, f"W{index}"))
        nodes.append(helper.make_node("MatMul", [f"y{index - 1}" if index else "x", f"W{index}"], [f"y{index}"]))
    return _model(nodes, k, initializers)


def _model(nodes: list, k: int, initializers: list) -> bytes:
    nodes[-1].output[0] = "y"  # nothing reads the last product
    graph = helper.make_graph(nodes, "kernel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", k])], initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def median_ms(model: bytes, k: int, rows: int, threads: int, repeats: int) -> float:
    session = ort.InferenceSession(model, session_options(threads), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    for _ in range(5):
        session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=8960)
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,9,16,32")
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--blocks", default="32,128")
    parser.add_argument("--layers", type=int, default=14,
                        help="K->N->K pairs of products in the stack (default 14: ~190 MB of int4, past any cache)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per physical core)")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--no-float", action="store_true", help="skip the float32 MatMul column")
    parser.add_argument("--int8-rows", action="store_true",
                        help="add the integer products of --layer-products int8 (MatMulInteger, a scale per row)")
    parser.add_argument("--zero-points", action="store_true", help="int4 blocks with 4-bit zero points (asymmetric)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also measure the machine's read bandwidth (numpy sums of 1 GiB, one and --threads processes)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    kernels, streamed = {}, {}
    for lv in args.levels.split(","):
        for b in args.blocks.split(","):
            name = f"int4 b{b} level {lv}" + (" zp" if args.zero_points else "")
            kernels[name] = nbits_model(args.k, args.n, int(b), int(lv), args.layers, args.zero_points)
            streamed[name] = nbits_bytes(args.k, args.n, int(b), int(lv), args.layers, args.zero_points)
    if args.int8_rows:
        kernels["int8 rows (MatMulInteger)"] = int8_rows_model(args.k, args.n, args.layers)
        streamed["int8 rows (MatMulInteger)"] = 2 * args.layers * (args.k * args.n + 4 * (args.k + args.n) // 2)
    if not args.no_float:
        float_layers = min(args.layers, FLOAT_LAYERS)  # a model proto holds at most 2 GB
        kernels[f"float32 MatMul ({float_layers} pairs)"] = float_model(args.k, args.n, float_layers)
        streamed[f"float32 MatMul ({float_layers} pairs)"] = 2 * float_layers * args.k * args.n * 4
    times = {name: [median_ms(model, args.k, m, args.threads, args.repeats) for m in rows]
             for name, model in kernels.items()}
    lines = [f"{args.layers} x (K={args.k} -> N={args.n} -> K) products, {args.threads or 'default'} threads, median of {args.repeats}; "
             f"onnxruntime {ort.__version__}, {cpu_model()}, {date.today()}", "",
             "| kernel | MB streamed | bits/weight | GB/s at M=1 | " + " | ".join(f"M={m}" for m in rows) + " |",
             "|---|---|---|---|" + "---|" * len(rows)]
    for name, values in times.items():
        cells = [f"{v:.2f} ms ({v / values[0]:.2f}x)" for v in values]
        weights = 2 * (args.layers if "float32" not in name else min(args.layers, FLOAT_LAYERS)) * args.k * args.n
        mb = streamed[name] / 1e6
        lines.append(f"| {name} | {mb:.1f} | {8 * streamed[name] / weights:.2f} | {mb / values[0]:.1f} | "
                     + " | ".join(cells) + " |")
    if args.bandwidth:
        one, many = read_bandwidth(1, gib=1.0), read_bandwidth(args.threads or 2, gib=1.0)
        lines += ["", (f"read bandwidth (numpy sums of 1 GiB): {one:.1f} GB/s one process, "
                       f"{many:.1f} GB/s {args.threads or 2} processes")]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
