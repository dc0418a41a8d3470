"""Export a draft and a target into one bundle folder, atomically.

Layout of a bundle::

    manifest.json          the I/O contract and sha256 of every file (specdec.contract.manifest)
    tokenizer/             tokenizer.json (+ tokenizer_config.json with the chat template)
    target/model.onnx      + model.onnx.data (external weights)
    draft/model.onnx       + model.onnx.data

Everything is written into a hidden staging folder beside the destination
(``.OUT.partial-PID``) and swapped into place only when complete, so an interrupted or failed
export never leaves a half bundle under the destination name and never touches an existing
bundle until the new one is whole (which ``--out`` may be replaced, cleanup after killed exports
and the swap: destination.py). Everything that can be checked without a model (sources, weights
files' headers, tokenizers, draft/target compatibility, the parity text) is checked before any
export starts; each model is then exported in a worker process (worker.py). Every failure is a
ValueError subclass with a one-line message.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from specdec.contract.bundle import HashCache, default_hash_cache, sha256_file
from specdec.contract.fim import find_fim_tokens
from specdec.contract.manifest import ATTENTION_FORMS, FORMAT_VERSION, MANIFEST_NAME, Manifest, SourceFile
from specdec.export.compat import check_pair_facts, check_specs, check_tokenizers, pair_facts, special_token_ids
from specdec.export.destination import check_destination, remove_dead_staging, swap_into_place
from specdec.export.quantize import (
    BLOCK_SIZE,
    BLOCK_SIZES,
    DRAFT_BLOCK_SIZE,
    GGUF_METHODS,
    LAYER_PRODUCTS,
    QUANTS,
    QuantRecipe,
    quantize_onnx,
)
from specdec.export.sources import (
    DTYPES,
    ModelSource,
    SourceError,
    load_configs,
    load_model,
    load_tokenizer,
    resolve_source,
)
from specdec.export.worker import ExportError, one_line, run_isolated

PARITY_PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n"
PARITY_EXTRA = " if n < 2: return n"


@dataclass(frozen=True)
class ExportOptions:
    target: str
    draft: str | None
    out: Path
    dtype: str = "float32"
    quant: str = "none"
    parity: bool = True
    # MatMulNBits accuracy_level: 4 = int8 activations (the fast CPU kernels; a verify pass over
    # 5 tokens then costs ~1.5x one token instead of ~2.6x with 0 = float32 compute)
    accuracy_level: int | None = 4
    block_size: int = BLOCK_SIZE  # weights per quantization scale, target
    draft_block_size: int = DRAFT_BLOCK_SIZE  # and draft (coarser: a faster draft at the same acceptance)
    # graph form: "fused" (onnxruntime's GroupQueryAttention, in-place KV) | "standard" (portable, TensorRT's
    # input) | "auto" = fused whenever the fused form can hold the export (float32, MatMulNBits or no
    # quantization), standard otherwise (float16/bfloat16, int4-qdq: TensorRT's forms).
    graph: str = "auto"
    # store one table for the token embedding and the lm_head: the lm_head's. For checkpoints whose original is
    # tied but which carry two quantized copies (the Qwen2.5-Coder GGUFs: output.weight Q6_K, token_embd Q4_K), so
    # that the int4 bundle stores the table once (tie_model_embeddings; the parity reference is the tied model).
    tie_embeddings: bool = False
    # how int4 weights are chosen (quantize.py: method "rtn" | "rtn-asym" | "k-quant", lm_head bits 4 | 8)
    # "auto": gguf-int4 for a model loaded from a .gguf file with --quant int4 (the GGUF's Q4_K blocks kept as they
    # are; measured: docs/bundle.md, "int4 weights"), k-quant for a float source
    quant_method: str = "auto"
    lm_head_bits: int = QuantRecipe.lm_head_bits
    # the draft's method when it differs (None: quant_method, "auto" judged by the draft's own source)
    draft_quant_method: str | None = None
    # "streamed" builds the fused graph layer by layer from the weights read one tensor at a time (peak memory about
    # one layer: export/streamed.py); "traced" traces the whole float model with torch.onnx (every architecture and
    # both graph forms, about twice the float32 weights in memory); "auto": streamed wherever it applies
    exporter: str = "auto"
    # the streamed exporter's KV cache element type (its folded attention reads either; the traced graphs keep
    # float32 in the fused form and the --dtype in the standard form): "auto" = DEFAULT_KV_DTYPE where it applies,
    # else float32
    kv_dtype: str = "auto"
    # the streamed fused graph's attention (contract/manifest.py ATTENTION_FORMS): "folded" reads each cache row once
    # per pass; "gqa" is onnxruntime's GroupQueryAttention (the traced exporter's, float32 KV only)
    attention: str = "folded"
    # the target's decoder-layer projections: "nbits" (MatMulNBits, int4) or "int8" (QuantRecipe.layer_products;
    # the draft keeps MatMulNBits: its passes are one token wide); "auto" = both for a streamed int4 export, the
    # loading machine measuring which to run (auto_layer_products), else nbits
    layer_products: str = "auto"

    def __post_init__(self):
        if self.quant_method == "auto" and self.draft_quant_method is None:
            object.__setattr__(self, "draft_quant_method", "auto")
        for name, source in (("quant_method", self.target), ("draft_quant_method", self.draft)):
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, auto_quant_method(source, self.quant))
        if self.graph not in ("auto", "fused", "standard"):
            raise ValueError(f"--graph {self.graph!r} is not one of auto, fused, standard")
        if self.exporter not in EXPORTERS:
            raise ValueError(f"--exporter {self.exporter!r} is not one of {', '.join(EXPORTERS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if self.attention not in ATTENTION_FORMS:
            raise ValueError(f"--attention {self.attention!r} is not one of {', '.join(ATTENTION_FORMS)}")
        if self.attention == "gqa" and self.kv_dtype not in ("auto", "float32"):
            raise ValueError(f"--kv-dtype {self.kv_dtype} needs --attention folded (GroupQueryAttention's CPU cache "
                             "is float32 here)")
        if self.kv_dtype not in ("auto", "float32") and self.exporter == "traced":
            raise ValueError(f"--kv-dtype {self.kv_dtype} is the streamed exporter's (its folded attention)")
        fused_ok = self.dtype == "float32" and self.quant != "int4-qdq"
        if self.graph == "fused" and not fused_ok:
            raise ValueError("--graph fused needs --dtype float32 and a --quant other than int4-qdq "
                             "(onnxruntime's CPU GroupQueryAttention; int4-qdq is TensorRT's form): use --graph standard")
        if self.graph == "auto":
            object.__setattr__(self, "graph", "fused" if fused_ok else "standard")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quant not in QUANTS:
            raise ValueError(f"--quant {self.quant!r} is not one of {', '.join(QUANTS)}")
        if self.quant in ("int4", "int8") and self.dtype != "float32":
            raise ValueError(f"--quant {self.quant} (MatMulNBits) applies to a float32 export: use --dtype float32")
        if self.quant == "int4-qdq" and self.dtype not in ("float32", "float16"):
            raise ValueError("--quant int4-qdq applies to a float32 or float16 export")
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError("--accuracy-level must be 0..4 (onnxruntime MatMulNBits)")
        recipes = {QuantRecipe(self.quant_method, self.lm_head_bits),  # each a one-line ValueError
                   self.recipe_for("draft")}
        if self.layer_products not in ("auto", *LAYER_PRODUCTS):
            raise ValueError(f"--layer-products {self.layer_products!r} is not one of auto, {', '.join(LAYER_PRODUCTS)}")
        if self.layer_products == "int8" and (self.quant != "int4" or self.exporter == "traced"):
            raise ValueError(f"--layer-products {self.layer_products} is the streamed exporter's, with --quant int4")
        if recipes != {QuantRecipe()} and self.quant != "int4":
            raise ValueError(f"--quant-method / --lm-head-bits apply to --quant int4, not --quant {self.quant}")
        for flag, size in (("--block-size", self.block_size), ("--draft-block-size", self.draft_block_size)):
            if size not in BLOCK_SIZES:
                raise ValueError(f"{flag} {size} is not one of {', '.join(map(str, BLOCK_SIZES))}")

    def kv_dtype_for(self, refusal: str | None) -> str:
        """The streamed export's KV type (``refusal``: why the model is the traced exporter's, None if it is not)."""
        if refusal is not None:
            if self.kv_dtype not in ("auto", "float32"):
                raise ValueError(f"--kv-dtype {self.kv_dtype} needs the streamed exporter: {refusal}")
            return "float32"
        if self.attention == "gqa":
            return "float32"
        return DEFAULT_KV_DTYPE if self.kv_dtype == "auto" else self.kv_dtype

    def block_size_for(self, role: str) -> int:
        return self.draft_block_size if role == "draft" else self.block_size

    def streamed_refusal(self, role: str, model_type: str) -> str | None:
        """Why this model cannot take the streamed exporter (None: it can)."""
        from specdec.export.streamed import STREAMED_ARCHITECTURES
        from specdec.export.weight_plan import STREAMED_METHODS

        if self.graph != "fused" or self.dtype != "float32":
            return f"the {self.graph} graph form in {self.dtype} is the traced exporter's"
        if self.quant not in ("none", "int4", "int8"):
            return f"--quant {self.quant} is the traced exporter's"
        if self.quant == "int4" and self.recipe_for(role).method not in STREAMED_METHODS:
            return f"--quant-method {self.recipe_for(role).method} is the traced exporter's"
        if model_type not in STREAMED_ARCHITECTURES:
            return f"architecture {model_type!r} is the traced exporter's (streamed: {', '.join(STREAMED_ARCHITECTURES)})"
        return None

    def weight_plan(self, role: str):
        from specdec.export.weight_plan import WeightPlan

        recipe = self.recipe_for(role)
        return WeightPlan(self.quant, recipe.method, self.block_size_for(role), recipe.lm_head_bits,
                          self.accuracy_level, float_scales=recipe.float_scales,
                          layer_products=recipe.layer_products)

    @property
    def recipe(self) -> QuantRecipe:
        products = "nbits" if self.layer_products == "auto" else self.layer_products  # export_bundle resolves auto
        return QuantRecipe(self.quant_method, self.lm_head_bits, layer_products=products)

    def recipe_for(self, role: str) -> QuantRecipe:
        """The role's int4 recipe: a draft rounds what Q4_K does not hold symmetric (``QuantRecipe.float_scales``)."""
        if role != "draft":
            return self.recipe
        method = self.quant_method if self.draft_quant_method is None else self.draft_quant_method
        return QuantRecipe(method, self.lm_head_bits, float_scales=self.quant != "int4")


EXPORTERS = ("auto", "streamed", "traced")
KV_DTYPES = ("auto", "float32", "float16", "int8")
DEFAULT_KV_DTYPE = "float16"  # --kv-dtype auto for streamed exports (perplexity within 0.05% of float32: docs/bundle.md)


def auto_layer_products(options: ExportOptions, model_type: str) -> tuple[tuple, str]:
    """(the weight forms ``--layer-products auto`` writes the target in, why). A streamed int4 target is written
    in both (MatMulNBits' int4 blocks and int8 rows: export/int8_rows.py) and the machine that loads the bundle
    measures which to run (decoding/forms.py): which is faster depends on the CPU (on a 2-core AMX Xeon int8 rows
    made 64-token passes 0.37x and one-token passes 1.06x MatMulNBits' time; on a Zen 4 EPYC 0.51x and 1.24x), and
    a bundle is exported once and copied to other machines. Otherwise nbits alone."""
    if options.quant != "int4":
        return ("nbits",), f"--quant {options.quant}"
    refusal = "--exporter traced" if options.exporter == "traced" else options.streamed_refusal("target", model_type)
    if refusal is not None:
        return ("nbits",), refusal
    return ("nbits", "int8"), "both, the loading machine measures which to run"


def auto_quant_method(source: str | None, quant: str) -> str:
    """The int4 method "auto" stands for: gguf-int4 for a .gguf file (carried blocks), k-quant for a float source
    (llama.cpp's Q4_K search: the real pair's target within 1.1% of llama.cpp's own Q4_K_M of the same float
    folder, rtn +9.2%; benchmarks/results/2026-12-04-float-k-grid); rtn for other --quant values."""
    if quant != "int4":
        return "rtn"
    return "gguf-int4" if source and str(source).lower().endswith(".gguf") else "k-quant"


def tie_model_embeddings(model) -> str:
    """Make the token embedding read the lm_head's table (one Parameter), in place; returns what was done.
    Raises ExportError if the two tables differ in shape or the model has no separate lm_head."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ExportError("--tie-embeddings needs a bias-free lm_head")
    if head.weight is embedding.weight:
        return "embeddings already tied"
    if tuple(head.weight.shape) != tuple(embedding.weight.shape):
        raise ExportError(f"--tie-embeddings: the lm_head table {tuple(head.weight.shape)} and the embedding "
                          f"{tuple(embedding.weight.shape)} differ in shape")
    import torch

    with torch.no_grad():
        drift = float((embedding.weight.float() - head.weight.float()).abs().max())
    embedding.weight = head.weight
    model.config.tie_word_embeddings = True
    return f"embedding tied to the lm_head's table (max abs difference of the two tables was {drift:.3g})"


def rss_gib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB, from /proc (0 where unknown)."""
    values = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    values[line.split(":")[0]] = int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)


class Progress:
    """Timestamped progress lines on stderr, with this process's memory (current / peak GiB)."""

    def __init__(self, stream=None):
        self.start = time.monotonic()
        self.stream = stream

    def __call__(self, message: str) -> None:
        rss, peak = rss_gib()
        print(f"[{time.monotonic() - self.start:7.1f}s {rss:5.1f}/{peak:4.1f} GiB] {message}",
              file=self.stream or sys.stderr, flush=True)


def hash_tree(root: Path) -> dict:
    return {
        str(path.relative_to(root).as_posix()): sha256_file(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }


def tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("specdec", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "gguf"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _write_failure(exc: OSError, where: Path) -> str:
    """One line for a failed write, naming the path and the free space (numpy's errors name neither)."""
    try:
        free = f"{shutil.disk_usage(where if where.exists() else where.parent).free / 1e6:.0f} MB free there"
    except OSError:
        free = "free space unknown"
    path = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    reason = exc.strerror or " ".join(str(exc).split())
    full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"writing the export under {where.absolute()} failed{full}: {reason}{path}; {free}"


def source_file(given: str, source: ModelSource) -> SourceFile | None:
    """The manifest's provenance record of a single-file source (a GGUF): the path as given, its name, size and
    sha256; None for a folder source."""
    if not source.gguf_file:
        return None
    path = source.path / source.gguf_file
    hashes = HashCache(default_hash_cache())  # remembered: a bench checking the file later need not hash it again
    digest = hashes.sha256(path)
    hashes.save()
    return SourceFile(path=str(given), file_name=source.gguf_file, size=path.stat().st_size, sha256=digest)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _export_float(role, source: ModelSource, tokenizer, options: ExportOptions, staging: Path, progress) -> tuple:
    """Load, export and check the float graph (run in a worker process). Returns what quantization needs."""
    from specdec.export.onnx_export import ONNX_NAME, export_model
    from specdec.export.parity import check_parity, reference_outputs

    progress(f"{role}: loading {source.label} ({options.dtype})")
    try:
        model = load_model(source, options.dtype)
    except (SourceError, MemoryError):
        raise
    except Exception as exc:  # a truncated / corrupt weights file: safetensors, gguf and torch each raise their own
        raise SourceError(f"cannot load the {role} model from {source.label}: {one_line(exc)}") from None
    if options.tie_embeddings:
        progress(f"{role}: {tie_model_embeddings(model)}")
    special = special_token_ids(model, tokenizer)
    prompt, extra = _encode(tokenizer, PARITY_PROMPT), _encode(tokenizer, PARITY_EXTRA)
    extra = (extra * 5)[:5]
    references = None
    if options.parity:
        progress(f"{role}: PyTorch reference outputs for the parity check")
        references = reference_outputs(model, prompt, extra)
    float_dir = staging / (role if options.quant == "none" else f".{role}-float")
    progress(f"{role}: exporting ONNX ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")
    try:
        spec = export_model(model, role, float_dir, special, options.dtype, options.graph)  # consumes the model
    except OSError as exc:
        raise ExportError(f"{role}: {_write_failure(exc, float_dir)}") from None
    del model
    gc.collect()
    parity = {}
    if references is not None and options.dtype == "float32":
        progress(f"{role}: parity check of the float graph (prefill, decode, chain verify, tree)")
        parity["float"] = check_parity(references, float_dir / ONNX_NAME, spec, prompt, extra)
    elif references is not None:
        parity["float"] = "skipped: onnxruntime's CPU kernels do not cover every float16/bfloat16 op this graph uses"
    return spec, parity, references, prompt, extra, float_dir


def _export_streamed(role, source: ModelSource, tokenizer, options: ExportOptions, staging: Path, progress,
                     folder: str | None = None) -> tuple:
    """The streamed exporter in a worker process (export/streamed.py): (spec, parity, weight report), written into
    ``staging / folder`` (default: the role's folder; the spec's onnx_file names it)."""
    from specdec.export.streamed import export_streamed

    parity_ids = None
    if options.parity:
        parity_ids = (_encode(tokenizer, PARITY_PROMPT), (_encode(tokenizer, PARITY_EXTRA) * 5)[:5])
    plan = options.weight_plan(role)
    what = f"{options.quant}, {plan.method}" if options.quant == "int4" else options.quant
    folder = folder or role
    progress(f"{folder}: streamed export of {source.label} ({what}, layers {plan.layer_products})")
    try:
        spec, parity, report = export_streamed(role, source, tokenizer, plan, staging / folder, progress, parity_ids,
                                               tie_embeddings=options.tie_embeddings,
                                               kv_dtype=options.kv_dtype_for(None), attention=options.attention)
        return replace(spec, onnx_file=f"{folder}/{Path(spec.onnx_file).name}"), parity, {"exporter": "streamed",
                                                                                          **report}
    except OSError as exc:
        raise ExportError(f"{role}: {_write_failure(exc, staging / folder)}") from None


def _export_one(role, source: ModelSource, tokenizer, options: ExportOptions, staging: Path, progress) -> tuple:
    """Export one model: streamed where it applies (``ExportOptions.exporter``), else the float graph traced in a
    worker process, then (after it has exited) quantization. Returns (spec, parity reports, weight report)."""
    model_type = _model_type(source)
    refusal = options.streamed_refusal(role, model_type)
    if options.exporter == "streamed" and refusal:
        raise ExportError(f"{role}: --exporter streamed cannot export this model: {refusal}")
    try:
        options.kv_dtype_for(refusal if options.exporter != "traced" else "--exporter traced")
    except ValueError as exc:
        raise ExportError(f"{role}: {exc}") from None
    if refusal is not None and options.recipe_for(role).layer_products != "nbits":
        raise ExportError(f"{role}: --layer-products {options.layer_products} needs the streamed exporter: {refusal}")
    if options.exporter != "traced" and refusal is None:
        return run_isolated(_export_streamed, role, source, tokenizer, options, staging, _for_worker(progress))
    return _export_traced(role, source, tokenizer, options, staging, progress)


def _model_type(source: ModelSource) -> str:
    from specdec.export.graph_model import text_config

    return text_config(load_configs(source)[0]).model_type


def _export_traced(role, source: ModelSource, tokenizer, options: ExportOptions, staging: Path, progress) -> tuple:
    """The traced exporter: the float graph in a worker process, then (after it has exited) quantization."""
    from specdec.export.onnx_export import ONNX_NAME
    from specdec.export.parity import check_parity

    spec, parity, references, prompt, extra, float_dir = run_isolated(
        _export_float, role, source, tokenizer, options, staging, _for_worker(progress)
    )
    carried = {}
    if options.quant != "none":
        block = options.block_size_for(role)
        recipe = options.recipe_for(role)
        method = f", {recipe.method}" + (f", lm_head {recipe.lm_head_bits}-bit" if recipe.lm_head_bits != 4
                                         else "") if options.quant == "int4" else ""
        progress(f"{role}: quantizing weights to {options.quant} (block {block}{method})")
        carried = quantize_onnx(float_dir / ONNX_NAME, staging / role / ONNX_NAME, options.quant,
                                options.accuracy_level, block_size=block, recipe=recipe,
                                gguf_path=source.path / source.gguf_file if source.gguf_file else None)
        if carried:
            progress(f"{role}: carried from the GGUF: {carried['carried']} ({carried['left']} weights left to rtn)")
        shutil.rmtree(float_dir)
        spec = replace(spec, quant=options.quant)
        if references is not None:
            progress(f"{role}: parity check of the {options.quant} graph (error includes quantization)")
            parity[options.quant] = check_parity(references, staging / role / ONNX_NAME, spec, prompt, extra)
    return spec, parity, {"exporter": "traced", **carried}


def _silent(message: str) -> None:
    pass


def _for_worker(progress):
    """The progress reporter a worker process can use (callers' closures cannot cross processes)."""
    return progress if isinstance(progress, Progress) else _silent


def _check_parity_text(role: str, tokenizer) -> None:
    for text in (PARITY_PROMPT, PARITY_EXTRA):
        if not _encode(tokenizer, text):
            raise ExportError(f"the {role} tokenizer encodes the parity text {text!r} to no token ids: "
                              "the export cannot be checked; fix the tokenizer or pass --no-parity")


def export_bundle(options: ExportOptions, progress=None) -> Manifest:
    """Export ``options.target`` (and ``options.draft``) into ``options.out``; returns the manifest written.

    Raises a ValueError subclass (SourceError, IncompatiblePair, ExportError) with one line on any
    failure; ``options.out`` is then exactly as it was.
    """
    progress = progress or Progress()
    started = time.monotonic()
    out = Path(options.out)
    check_destination(out)
    target_source = resolve_source(options.target)
    draft_source = resolve_source(options.draft) if options.draft else None
    for role, source in (("target", target_source), ("draft", draft_source)):
        method = options.recipe_for(role).method
        if method in GGUF_METHODS and source is not None and not source.gguf_file:
            raise ExportError(f"--quant-method {method} carries a GGUF's blocks over: the {role} {source.label} "
                              "is not a .gguf file")
    forms = (options.layer_products,)
    if options.layer_products == "auto":
        forms, why = auto_layer_products(options, _model_type(target_source))
        options = replace(options, layer_products=forms[0])
        if options.quant == "int4":  # int8 needs int4; other quants say nothing
            progress(f"target's layer products: {' and '.join(forms)} ({why})")
    progress("loading tokenizers")
    tokenizers = {"target": load_tokenizer(target_source)}
    if draft_source is not None:
        tokenizers["draft"] = load_tokenizer(draft_source)
        check_tokenizers(tokenizers["target"], tokenizers["draft"])
        # vocabulary and special tokens from the configs: a mismatch costs seconds here, not two exports
        for note in check_pair_facts(pair_facts(*load_configs(target_source), tokenizers["target"]),
                                     pair_facts(*load_configs(draft_source), tokenizers["draft"])):
            progress(note)
    if options.parity:
        for role, tokenizer in tokenizers.items():
            _check_parity_text(role, tokenizer)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create the folder for --out {out}: {one_line(exc)}") from None
    remove_dead_staging(out, progress)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        specs, parity, carried = {}, {}, {}
        if draft_source is not None:
            specs["draft"], parity["draft"], carried["draft"] = _export_one(
                "draft", draft_source, tokenizers["draft"], options, staging, progress)
        specs["target"], parity["target"], carried["target"] = _export_one(
            "target", target_source, tokenizers["target"], options, staging, progress)
        for form in forms[1:]:  # the target again, its layers in another weight form (its own folder)
            other, parity[f"target-{form}"], _ = run_isolated(
                _export_streamed, "target", target_source, tokenizers["target"],
                replace(options, layer_products=form), staging, _for_worker(progress), f"target-{form}")
            base = specs["target"]
            if replace(other, onnx_file=base.onnx_file) != base:
                raise ExportError(f"the target's {form} graph does not share the {forms[0]} graph's contract")
            specs["target"] = replace(base, weight_forms=((forms[0], base.onnx_file),
                                                          *base.weight_forms[1:], (form, other.onnx_file)))
        if draft_source is not None:
            specs["draft"] = check_specs(specs["target"], specs["draft"])
        if not save_tokenizer(tokenizers["target"], staging / "tokenizer"):
            progress("the source tokenizer has no chat template: the bundle generates but cannot chat")
        progress("hashing files")
        given = {"target": options.target, "draft": options.draft}
        sources = {role: record for role, source in (("target", target_source), ("draft", draft_source))
                   if source is not None and (record := source_file(given[role], source)) is not None}
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            target=specs["target"],
            draft=specs.get("draft"),
            tokenizer_file="tokenizer/tokenizer.json",
            fim_tokens=find_fim_tokens(_token_id_of(tokenizers["target"])),
            sources=sources,
            files=hash_tree(staging),
            tools=tool_versions(),
            extra={"parity_max_abs_error": parity, "export_seconds": round(time.monotonic() - started, 1),
                   **({"quant_block_size": {role: options.block_size_for(role) for role in specs}}
                      if options.quant != "none" else {}),
                   **({"quant_recipe": options.recipe.to_dict()} if options.quant == "int4" else {}),
                   **({"draft_quant_recipe": options.recipe_for("draft").to_dict()}
                      if options.quant == "int4" and draft_source is not None
                      and options.recipe_for("draft") != options.recipe else {}),
                   "exporter": {role: report.get("exporter", "traced") for role, report in carried.items()},
                   **({"weights_stored": {role: report["stored"] for role, report in carried.items()
                                          if report.get("stored")}}
                      if any(report.get("stored") for report in carried.values()) else {}),
                   **({"quant_carried_from_gguf": {role: {k: v for k, v in report.items() if k != "exporter"}
                                                   for role, report in carried.items()}}
                      if any(report.get("carried") for report in carried.values()) else {}),
                   **({"tied_embeddings": "lm_head"} if options.tie_embeddings else {})},
        )
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        swap_into_place(staging, out)
    except OSError as exc:
        raise ExportError(_write_failure(exc, staging)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def save_tokenizer(tokenizer, folder: Path) -> bool:
    """Write the runtime's tokenizer files into ``folder``, with the chat template when the source has one.

    Hugging Face folders and GGUF files alike: transformers' GGUF loader puts the file's
    ``tokenizer.chat_template`` into the tokenizer. transformers writes it as ``chat_template.jinja``
    (or ``chat_templates/`` for several); an older writer that drops it gets it written here.
    Returns whether the bundle can chat."""
    tokenizer.save_pretrained(str(folder))
    template = getattr(tokenizer, "chat_template", None)
    config = folder / "tokenizer_config.json"
    written = (folder / "chat_template.jinja").is_file() or (folder / "chat_templates").is_dir() or (
        config.is_file() and "chat_template" in json.loads(config.read_text(encoding="utf-8")))
    if isinstance(template, str) and template and not written:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif isinstance(template, dict) and template and not written:
        (folder / "chat_templates").mkdir()
        for name, text in template.items():
            (folder / "chat_templates" / f"{name}.jinja").write_text(text, encoding="utf-8")
    return bool(template)


def _token_id_of(tokenizer):
    """A transformers tokenizer's text -> id lookup that says None for a token it does not have (not unk)."""
    return tokenizer.get_vocab().get
