"""``specdec-export``: a thin argv front over ``specdec.export.bundle``.

Failures are one line on stderr (exit 2 for bad input or a failed export, 1 for an internal
error; ``SPECDEC_DEBUG=1`` adds the traceback). SIGINT / SIGTERM stop the export with one line
(exit 130 / 143) after its staging folder is removed; ``--out`` is left as it was.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from .pair import DEFAULT_PAIR, PAIRS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec-export",
        description="Export a draft and a target causal LM (local folder or .gguf) into a specdec ONNX bundle.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="target model: a local Hugging Face folder or a .gguf file")
    source.add_argument("--pair", choices=sorted(PAIRS), help=f"a known pair from pinned packages (e.g. {DEFAULT_PAIR})")
    source.add_argument("--build-engine", metavar="BUNDLE", help="build TensorRT engines for an existing bundle")
    parser.add_argument("--draft", help="draft model: a local Hugging Face folder or a .gguf file (optional)")
    parser.add_argument("--out", type=Path, help="bundle folder to write (replaced atomically)")
    parser.add_argument("--engine", choices=["none", "tensorrt"], default="none",
                        help="also build TensorRT engines from the exported ONNX (GPU machine with TensorRT)")
    parser.add_argument("--engine-max-context", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--quant", default="none", choices=["none", "int4", "int8", "int4-qdq"],
                        help="weight-only quantization: int4/int8 = onnxruntime MatMulNBits (fastest on CPU); "
                             "int4-qdq = standard DequantizeLinear+MatMul (TensorRT int4 weight-only; onnxruntime runs it too)")
    parser.add_argument("--accuracy-level", type=int, default=4,
                        help="MatMulNBits accuracy_level 0..4 (default 4: int8 activations, fastest on CPU)")
    parser.add_argument("--block-size", type=int, default=None, help="target: weights per quantization scale (default 32)")
    parser.add_argument("--draft-block-size", type=int, default=None,
                        help="draft: weights per quantization scale (default 128: a faster draft; its accuracy "
                             "only moves the acceptance rate, never the output)")
    parser.add_argument("--graph", default="auto", choices=["auto", "fused", "standard"],
                        help="graph form: fused = onnxruntime's GroupQueryAttention with the KV cache read and written "
                             "in place (CPU, fastest); standard = portable ONNX (TensorRT's input); auto (default) = "
                             "fused for float32 onnxruntime bundles, standard otherwise")
    parser.add_argument("--no-parity", action="store_true", help="skip the ONNX vs PyTorch parity check")
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that ``finally`` blocks clean up (like KeyboardInterrupt)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _debug(exc: BaseException) -> None:
    if os.environ.get("SPECDEC_DEBUG"):
        print(getattr(exc, "detail", "") or "".join(traceback.format_exception(exc)), file=sys.stderr)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("specdec-export: interrupted (SIGINT): the unfinished export was removed, --out is as it was",
              file=sys.stderr)
        return 130
    except Terminated:
        print("specdec-export: terminated (SIGTERM): the unfinished export was removed, --out is as it was",
              file=sys.stderr)
        return 143
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(args) -> int:
    try:
        from .bundle import ExportOptions, Progress, export_bundle
        from .pair import pair_sources
    except ImportError as exc:
        print(f"specdec-export: error: {exc.name} is missing: install the export extra, pip install 'specdec[export]'",
              file=sys.stderr)
        return 2
    progress = Progress()
    try:
        if args.build_engine:
            return _build_engines(args.build_engine, args, progress)
        if args.out is None:
            raise ValueError("--out is required")
        if args.engine == "tensorrt" and args.graph == "fused":
            raise ValueError("--engine tensorrt needs --graph standard (TensorRT cannot build the fused onnxruntime form)")
        if args.engine == "tensorrt" and args.graph == "auto":
            args.graph = "standard"  # engines are built from the portable form
        if args.engine == "tensorrt" and args.quant in ("int4", "int8"):
            raise ValueError(f"--engine tensorrt cannot use --quant {args.quant} (onnxruntime's MatMulNBits): "
                             "use --quant int4-qdq (int4 weight-only TensorRT can build) or --quant none")
        if args.pair:
            target, draft = pair_sources(args.pair, progress)
        else:
            target, draft = args.target, args.draft
        options = ExportOptions(
            target=str(target), draft=str(draft) if draft else None, out=args.out, dtype=args.dtype,
            quant=args.quant, parity=not args.no_parity, accuracy_level=args.accuracy_level, graph=args.graph,
            **{name: value for name, value in (("block_size", args.block_size),
                                               ("draft_block_size", args.draft_block_size)) if value is not None},
        )
        manifest = export_bundle(options, progress)
        if args.engine == "tensorrt":
            return _build_engines(args.out, args, progress)
    except (ValueError, OSError) as exc:
        print(f"specdec-export: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        _debug(exc)
        return 2
    except Exception as exc:  # a bug, not bad input: still one line, the traceback on request
        print(f"specdec-export: internal error: {type(exc).__name__}: {' '.join(str(exc).split())} "
              "(set SPECDEC_DEBUG=1 for the traceback)", file=sys.stderr)
        _debug(exc)
        return 1
    print(summary(manifest, args.out))
    return 0


def _build_engines(bundle, args, progress) -> int:
    from specdec.engines.profiles import ProfileLimits
    from specdec.engines.tensorrt_build import build_engines

    manifest = build_engines(bundle, ProfileLimits(max_context=args.engine_max_context), progress=progress)
    for role, record in manifest.engines.items():
        print(f"{role}: {record['file']} (TensorRT {record['tensorrt_version']}, sm {record['compute_capability']})")
    return 0


def summary(manifest, out: Path) -> str:
    lines = [f"bundle written to {out} in {manifest.extra.get('export_seconds')} s"]
    for role, spec in manifest.models().items():
        size = sum((out / rel).stat().st_size for rel in manifest.files if rel.startswith(f"{role}/"))
        lines.append(
            f"  {role}: {spec.architecture}, {spec.num_layers} layers, vocab {spec.vocab_size}, "
            f"{spec.dtype}/{spec.quant}, {spec.graph} graph, {size / 1e6:.1f} MB"
        )
        for graph, report in manifest.extra["parity_max_abs_error"].get(role, {}).items():
            if isinstance(report, dict):
                cells = ", ".join(f"{k} logits {v['logits']:.2e} kv {v['kv']:.2e}" for k, v in report.items())
            else:
                cells = report
            lines.append(f"    parity ({graph}, max abs error vs PyTorch): {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
