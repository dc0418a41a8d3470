"""``specdec-export``: a thin argv front over ``specdec.export.bundle``.

Failures are one line on stderr (exit 2 for bad input or a failed export, 1 for an internal
error; ``SPECDEC_DEBUG=1`` adds the traceback). SIGINT / SIGTERM stop the export with one line
(exit 130 / 143) after its staging folder is removed; ``--out`` is left as it was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path

from specdec.export.pair import DEFAULT_PAIR, PAIRS
from specdec.export.quantize import LAYER_PRODUCTS, LM_HEAD_BITS, QUANT_METHODS, QuantRecipe
from specdec.export.vocab_prune import DEFAULT_DRAFT_VOCAB


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec-export",
        description="Export a draft and a target causal LM (local folder or .gguf) into a specdec ONNX bundle.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="target model: a local Hugging Face folder or a .gguf file")
    source.add_argument("--pair", choices=sorted(PAIRS), help=f"a known pair from pinned packages (e.g. {DEFAULT_PAIR})")
    source.add_argument("--build-engine", metavar="BUNDLE", help="build TensorRT engines for an existing bundle")
    source.add_argument("--prune-draft-vocab", nargs=2, metavar=("BUNDLE", "K"),
                        help="write a copy of BUNDLE (to --out, a new folder) whose draft scores only the K most "
                             "frequent tokens of a corpus (FR-Spec): a cheaper draft step, outputs unchanged")
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
    parser.add_argument("--quant-method", default=None, choices=["auto", *QUANT_METHODS],
                        help="--quant int4: how the 4-bit weights are chosen (default auto: gguf-int4 for a .gguf "
                             "source, k-quant for a float one): rtn = symmetric round-to-nearest; rtn-asym = min/max with zero "
                             "points; k-quant = llama.cpp's k-quant scale/min search; gguf = a GGUF source's own "
                             "blocks carried over (Q4_K as 4-bit, Q5_0/Q6_K/Q8_0 as 8-bit: the GGUF's weights); "
                             "gguf-int4 = Q4_K carried, wider types rounded to 4 bits but attn_v (docs/bundle.md)")
    parser.add_argument("--draft-quant-method", default=None, choices=["auto", *QUANT_METHODS],
                        help="--quant int4: the draft's method when it should differ from --quant-method")
    parser.add_argument("--layer-products", default="auto", choices=["auto", *LAYER_PRODUCTS],
                        help="--quant int4: the target's decoder-layer projections as MatMulNBits (nbits) or integer "
                             "products of 7-bit channel weights and 8-bit rows (int8: prefill passes ~2.7x faster "
                             "on a CPU with AMX, 8 bits per weight); auto (default): int8 where this CPU has int8 dot "
                             "products (AMX, AVX-512 VNNI, AVX-VNNI), else nbits")
    parser.add_argument("--lm-head-bits", type=int, default=None, choices=list(LM_HEAD_BITS),
                        help=f"--quant int4: bits of the output projection (default {QuantRecipe.lm_head_bits})")
    parser.add_argument("--graph", default="auto", choices=["auto", "fused", "standard"],
                        help="graph form: fused = onnxruntime's GroupQueryAttention with the KV cache read and written "
                             "in place (CPU, fastest); standard = portable ONNX (TensorRT's input); auto (default) = "
                             "fused for float32 bundles with --quant none/int4/int8, standard for float16/bfloat16 "
                             "and int4-qdq (TensorRT's forms)")
    parser.add_argument("--exporter", default="auto", choices=["auto", "streamed", "traced"],
                        help="streamed = the fused graph built layer by layer from weights read one tensor at a "
                             "time (peak memory about one layer; Llama, Qwen2, Qwen3, Mistral); traced = the whole "
                             "float model traced by torch.onnx (every architecture and graph form; about twice the "
                             "float32 weights in memory); auto (default) = streamed wherever it applies")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "float16", "int8"],
                        help="the streamed export's KV cache type: auto (default) = float16, half float32's memory "
                             "at the same speed (perplexity within 0.05%%); int8 = llama.cpp's q8_0 KV (a float32 "
                             "scale per row of head_dim values: about a quarter of float32's memory); the traced "
                             "exporter keeps float32 (fused) or --dtype (standard)")
    parser.add_argument("--attention", default="folded", choices=["folded", "gqa"],
                        help="the streamed fused graph's attention: folded (default) reads each KV cache row once "
                             "per pass; gqa = onnxruntime's GroupQueryAttention (float32 KV; the traced exporter's)")
    parser.add_argument("--no-parity", action="store_true", help="skip the ONNX vs PyTorch parity check")
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="one table for the embedding and the lm_head (the lm_head's), stored once in int4: for "
                             "checkpoints tied in the original but shipped with two quantized copies (the "
                             "Qwen2.5-Coder GGUFs)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="K", nargs="?", const=DEFAULT_DRAFT_VOCAB,
                        help="prune the draft's output vocabulary to the K (default "
                             f"{DEFAULT_DRAFT_VOCAB}) most frequent tokens of a corpus (default corpus: the Python "
                             "standard library); the target is untouched")
    parser.add_argument("--draft-vocab-corpus", metavar="DIR", default=None,
                        help="count token frequencies in the text files under DIR instead of the standard library")
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
        from specdec.export.bundle import ExportOptions, Progress, export_bundle
        from specdec.export.pair import pair_sources
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
        if args.prune_draft_vocab:
            bundle, k = args.prune_draft_vocab
            return _prune(bundle, _vocab_k(k), args.out, args.draft_vocab_corpus, progress)
        if args.draft_vocab is not None:
            _vocab_k(args.draft_vocab)
            if not args.draft and not args.pair:
                raise ValueError("--draft-vocab prunes the draft: give --draft (or --pair)")
            if args.draft_vocab_corpus and not Path(args.draft_vocab_corpus).is_dir():
                raise ValueError(f"--draft-vocab-corpus {args.draft_vocab_corpus} is not a folder")
            from specdec.export.destination import check_destination

            check_destination(Path(args.out))
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
        full_out = args.out if args.draft_vocab is None else args.out.parent / f".{args.out.name}.full-{os.getpid()}"
        options = ExportOptions(
            target=str(target), draft=str(draft) if draft else None, out=full_out, dtype=args.dtype,
            quant=args.quant, parity=not args.no_parity, accuracy_level=args.accuracy_level, graph=args.graph,
            tie_embeddings=args.tie_embeddings, exporter=args.exporter, kv_dtype=args.kv_dtype,
            attention=args.attention, layer_products=args.layer_products,
            **{name: value for name, value in (("block_size", args.block_size),
                                               ("draft_block_size", args.draft_block_size),
                                               ("quant_method", args.quant_method),
                                               ("draft_quant_method", args.draft_quant_method),
                                               ("lm_head_bits", args.lm_head_bits)) if value is not None},
        )
        manifest = export_bundle(options, progress)
        if args.draft_vocab is not None:  # the whole bundle replaces --out only once it is pruned
            try:
                from specdec.export.vocab_prune import prune_bundle

                manifest = prune_bundle(full_out, args.draft_vocab, args.out, args.draft_vocab_corpus, progress)
            finally:
                shutil.rmtree(full_out, ignore_errors=True)
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


def _vocab_k(value) -> int:
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"K (the draft's vocabulary size) must be an integer, got {value!r}") from None
    if k < 2:
        raise ValueError(f"K (the draft's vocabulary size) must be at least 2, got {k}")
    return k


def _prune(bundle: str, k: int, out: Path, corpus, progress) -> int:
    from specdec.export.vocab_prune import prune_bundle

    manifest = prune_bundle(bundle, k, out, corpus, progress)
    notes = manifest.extra["draft_vocab"]
    print(f"bundle written to {out}: draft vocabulary {notes['k']} of {notes['of']} tokens "
          f"({notes['corpus_token_coverage']:.2%} of the corpus's tokens), lm_head {notes['lm_head']}, "
          f"max |logit error| on kept ids {notes.get('max_abs_error_on_kept_logits', float('nan')):.2e}")
    return 0


def _build_engines(bundle, args, progress) -> int:
    from specdec.runners.tensorrt.profiles import ProfileLimits
    from specdec.runners.tensorrt.build import build_engines

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
