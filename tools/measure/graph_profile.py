"""Profile a bundle's graphs: node counts by op type, per-op-type time of a decode and a T=5 pass (``--widths``), the
cost of one pass at two context lengths (does a pass's cost grow with the context?), and the weight products
alone (every MatMulNBits / MatMulInteger of the graph, same weights, one token): what the rest of a one-token
pass costs is the difference, measured without the profiler (whose per-node cost inflates small ops).

    python tools/measure/graph_profile.py BUNDLE [--role target] [--weight-form nbits|int8] [--contexts 256,1500]
        [--widths 1,5] [--repeats 20] [--threads N]

Works on both graph forms (standard and fused) through the runtime's own runner (make_runner).
Times are wall-clock on this machine: compare ratios between forms measured the same way, not
absolute numbers on a loaded machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specdec.contract.manifest import forms_of
from specdec.runners.huge_pages import collapse_resident


def node_counts(onnx_path: Path, options) -> tuple[collections.Counter, collections.Counter]:
    """(op counts in the file, op counts after onnxruntime's load-time optimizations)."""
    import onnx
    import onnxruntime as ort

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    raw = collections.Counter(node.op_type for node in graph.node)
    with tempfile.TemporaryDirectory() as folder:
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
        fused = collections.Counter(node.op_type for node in optimized.node)
    return raw, fused


def _fill(runner, length: int, rng) -> None:
    """Prefill ``length`` random tokens in chunks."""
    runner.reset()
    step = runner.max_step_tokens
    for start in range(0, length, step):
        chunk = rng.integers(3, runner.spec.vocab_size, size=min(step, length - start))
        runner.forward(chunk, np.arange(start, start + len(chunk)))
        runner.commit(len(chunk))


PREFILL_FROM = 17  # passes this wide or wider are timed as prefill chunks: logits of the last row only (as catch_up)


def pass_seconds(runner, length: int, count: int, repeats: int, rng) -> tuple[float, float]:
    """(median, fastest) seconds of one pass of ``count`` new tokens after ``length`` valid slots (never committed).
    On a loaded machine the fastest run is the better estimate of the cost itself."""
    _fill(runner, length, rng)
    tokens = rng.integers(3, runner.spec.vocab_size, size=count)
    positions = np.arange(length, length + count)
    last = count >= PREFILL_FROM
    runner.forward(tokens, positions, last_logits_only=last)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(tokens, positions, last_logits_only=last)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


_PRODUCTS = {"MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat"}
_ELEMENT = {1: np.float32, 2: np.uint8, 3: np.int8}  # onnx element types a product's activation takes


def products_alone_session(onnx_path: Path, threads):
    """(products, run): ``run()`` runs a graph holding only ``onnx_path``'s weight products for one token.

    Each product keeps its own weights (the bundle's external data, read in place: nothing is written into the
    bundle) and gets a random activation row of the width and element type its graph feeds it; computed zero
    points get zeros. Nothing else of the pass runs, so its time is what the weights' bytes cost."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from specdec.runners.standard import session_options

    model = onnx.load(str(onnx_path), load_external_data=False)
    weights = {tensor.name: tensor for tensor in model.graph.initializer}
    makers = {out: node for node in model.graph.node for out in node.output}
    rng = np.random.default_rng(0)
    nodes, feeds, used = [], {}, []
    for index, node in enumerate(n for n in model.graph.node if n.op_type in _PRODUCTS):
        maker = makers.get(node.input[0])
        element = 1
        if maker is not None and maker.op_type == "Cast":
            element = next((a.i for a in maker.attribute if a.name == "to"), 1)
        elif maker is not None and maker.op_type == "QuantizeLinear":  # uint8 codes (zero point 128)
            element = 2
        width = (next(a.i for a in node.attribute if a.name == "K") if node.op_type == "MatMulNBits"
                 else weights[node.input[1]].dims[0])
        inputs = []
        for position, name in enumerate(node.input):
            if not name or name in weights:
                inputs.append(name)
                continue
            fed = f"in{index}.{position}"
            dtype = _ELEMENT[element]
            feeds[fed] = (rng.standard_normal((1, 1, width)).astype(dtype) if position == 0
                          else np.zeros((), dtype))
            inputs.append(fed)
        product = helper.make_node(node.op_type, inputs, [f"out{index}"], domain=node.domain, name=node.name)
        product.attribute.extend(node.attribute)
        nodes.append(product)
        used += [name for name in node.input if name in weights]
    if not nodes:
        raise ValueError(f"{onnx_path.name} holds no weight products (MatMulNBits / MatMulInteger)")
    graph = helper.make_graph(
        nodes, "products",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
         for name, value in feeds.items()],
        [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.INT32 if node.op_type == "MatMulInteger"
                                       else onnx.TensorProto.FLOAT, None) for node in nodes],
        [weights[name] for name in dict.fromkeys(used)])
    alone = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    options = session_options(threads)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(onnx_path.parent))
    session = ort.InferenceSession(alone.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return len(nodes), lambda: session.run(None, feeds)


def products_beside_pass(runner, onnx_path: Path, length: int, threads, repeats: int, rng) -> tuple[int, float, float]:
    """(products, median seconds of the products alone, median seconds of a whole one-token pass after ``length``
    cached tokens), the two run alternately so that a burst of load on a shared machine lands on both alike."""
    count, run = products_alone_session(onnx_path, threads)
    _fill(runner, length, rng)
    collapse_resident()  # the second session's weights on 2 MiB pages too
    token = rng.integers(3, runner.spec.vocab_size, size=1)
    alone, whole = [], []
    for round_index in range(repeats + 1):
        for kind in ("alone", "whole") if round_index % 2 else ("whole", "alone"):
            start = time.perf_counter()
            run() if kind == "alone" else runner.forward(token, [length])
            (alone if kind == "alone" else whole).append(time.perf_counter() - start)
    return count, statistics.median(alone[1:]), statistics.median(whole[1:])  # the first round warms up


def op_profile(onnx_path: Path, filled, threads, count: int, repeats: int, rng) -> dict:
    """Per-op-type microseconds per pass of ``count`` tokens after the context ``filled`` (a runner) holds.

    A second session with onnxruntime profiling on gets a copy of ``filled``'s cache, so only the
    measured passes are profiled.
    """
    import onnxruntime as ort

    from specdec.runners.standard import session_options

    options = session_options(threads)
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as folder:
        options.profile_file_prefix = os.path.join(folder, "profile")
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        runner = type(filled)("", filled.spec, "cpu", filled.max_context, filled.max_step_tokens, session=session)
        runner.cache[...] = filled.cache
        if getattr(filled, "scales", None) is not None:  # an int8 cache's scales (runners/kv_int8.py)
            runner.scales[...] = filled.scales
        runner.slot_positions[:] = filled.slot_positions
        runner.length = filled.length
        tokens = rng.integers(3, filled.spec.vocab_size, size=count)
        for _ in range(repeats + 1):
            runner.forward(tokens, np.arange(filled.length, filled.length + count),
                           last_logits_only=count >= PREFILL_FROM)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]  # skip warm-up
    per_run = [collections.Counter() for _ in runs]
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            for index, (begin, end) in enumerate(runs):
                if begin <= event["ts"] <= end:
                    per_run[index][event["args"].get("op_name", "?")] += event["dur"]
    ops = {op for run in per_run for op in run}
    medians = {op: statistics.median(run[op] for run in per_run) for op in ops}  # robust to a loaded machine
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], default="target")
    parser.add_argument("--contexts", default="256,1500", help="two or more context lengths for the per-pass cost")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weight-form", default=None, help="which of the model's weight forms (default: the first)")
    parser.add_argument("--widths", default="1,5", help="pass widths profiled and timed, up to 64 (a prefill chunk)")
    args = parser.parse_args(argv)
    try:
        from specdec.runners.factory import make_runner
        from specdec.contract.manifest import Manifest
        from specdec.runners.standard import session_options

        manifest = Manifest.read(args.bundle)
        spec = manifest.models().get(args.role)
        if spec is None:
            raise ValueError(f"the bundle has no {args.role}")
        contexts = [int(c) for c in args.contexts.split(",")]
        widths = [int(w) for w in args.widths.split(",")]
        if not widths or min(widths) < 1 or max(widths) > 64:
            raise ValueError("--widths must be in 1..64")
        if max(contexts) + max(widths) > spec.max_positions or min(contexts) < 1:
            raise ValueError(f"--contexts must be in 1..{spec.max_positions - max(widths)} for this model")
        forms = forms_of(spec)
        if args.weight_form is not None and args.weight_form not in forms:
            raise ValueError(f"--weight-form: the {args.role} has {', '.join(map(str, forms))}")
    except (ValueError, OSError) as exc:
        print(f"graph_profile: error: {exc}", file=sys.stderr)
        return 2
    onnx_path = args.bundle / (forms[args.weight_form] if args.weight_form else spec.onnx_file)
    rng = np.random.default_rng(0)
    raw, optimized = node_counts(onnx_path, session_options(args.threads))
    print(f"{args.role}: {spec.architecture}, {spec.graph} graph, quant {spec.quant}, {spec.num_layers} layers, "
          f"weight form {args.weight_form or next(iter(forms))}")
    print(f"nodes in the file: {sum(raw.values())}; after onnxruntime's load-time fusions: {sum(optimized.values())}")
    print("  file:     " + ", ".join(f"{op} {n}" for op, n in raw.most_common()))
    print("  optimized: " + ", ".join(f"{op} {n}" for op, n in optimized.most_common()))
    runner = make_runner(str(onnx_path), spec, "cpu", max(contexts) + 64, 64, args.threads)
    collapse_resident()  # its weights on 2 MiB pages, as a load leaves them (runners/huge_pages.py)
    _fill(runner, contexts[0], rng)
    for count in widths:
        profile = op_profile(onnx_path, runner, args.threads, count, args.repeats, rng)
        total = sum(profile.values())
        print(f"per-op-type time, T={count} at context {contexts[0]} (us per pass, {total:.0f} us in kernels):")
        print("  " + ", ".join(f"{op} {us:.0f} ({100 * us / total:.0f}%)" for op, us in profile.items()))
    for count in widths:
        cells = []
        for length in contexts:
            median, fastest = pass_seconds(runner, length, count, args.repeats, rng)
            cells.append(f"context {length}: median {1000 * median:.2f} ms, fastest {1000 * fastest:.2f} ms")
        print(f"one pass of T={count}: " + "; ".join(cells))
        if count == 1 and not any(node in raw for node in _PRODUCTS):
            print("no weight products in this graph (MatMulNBits / MatMulInteger): nothing to time alone")
        elif count == 1:
            products, alone, whole = products_beside_pass(runner, onnx_path, contexts[0], args.threads,
                                                          args.repeats, rng)
            print(f"the {products} weight products alone, one token: median {1000 * alone:.2f} ms; the whole pass "
                  f"at context {contexts[0]}, alternating with them: {1000 * whole:.2f} ms; the rest of the pass "
                  f"{1000 * (whole - alone):+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
