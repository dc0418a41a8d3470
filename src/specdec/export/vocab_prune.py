"""A cheaper draft: prune its lm_head to the K most frequent tokens of a corpus (FR-Spec, arXiv 2502.14856).

A post-export transform of the draft's ONNX graph, independent of how the graph was built:
find the node that computes ``logits`` (a MatMul, Gemm or MatMulNBits, possibly followed by
shape-free elementwise nodes such as a Cast or a soft-cap), keep only the weight rows of the
kept token ids, and declare ``logits`` as [batch, new_tokens, K]. The embedding (a Gather
over the full vocabulary) is untouched: the draft still reads every token. The kept ids go
into the bundle as ``draft/vocab_subset.npy`` (hashed like every file, named by the draft's
``ModelSpec.vocab_subset``); the runtime maps the K logits back with -inf elsewhere
(``specdec.runners.vocab_map``), so the draft's distribution is exactly zero outside the
subset and speculative sampling stays exact.

The token frequencies come from a corpus every machine has offline: the Python standard
library's sources and docstrings (``stdlib_corpus``), or a folder the user names
(``folder_corpus``). ``prune_bundle`` writes a NEW bundle folder and never modifies the
one it reads.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from specdec.contract.bundle import open_bundle
from specdec.contract.manifest import MANIFEST_NAME, Manifest, TensorSpec

SUBSET_NAME = "vocab_subset.npy"
# Measured on the Qwen2.5-Coder 0.5B/1.5B int4 pair (12 public prompts, greedy g=2, draft step / target step at
# context 256, a loaded 2-core CPU): full 151,936 tokens 0.31x, per-token acceptance 0.767; 64k 0.26x, 0.757;
# 32k 0.25x, 0.739; 16k 0.27x (noisy), 0.723. Predicted g=2 speedup (c(3) = 1.22 c(1)): 1.29x, 1.34x, 1.33x, 1.28x.
DEFAULT_DRAFT_VOCAB = 65536
STDLIB_CHARS = 16_000_000  # the whole library (~12M characters, ~3M Qwen tokens, ~32k distinct) in 3.11
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".json", ".toml")
# nodes between the lm_head and the logits output that act elementwise (their other inputs are scalars)
_ELEMENTWISE = {"Cast", "Identity", "Tanh", "Div", "Mul", "Add", "Sub"}


class PruneError(ValueError):
    """The draft vocabulary cannot be pruned as asked (bad K, no draft, an lm_head form not handled)."""


# ----------------------------------------------------------------- corpus and frequencies

def stdlib_corpus(max_chars: int = STDLIB_CHARS) -> list[str]:
    """Texts of this Python's standard library modules (code and docstrings), in a fixed order, up to
    ``max_chars`` characters; the bundled test suites are skipped (they are mostly generated data)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "tests", "site-packages", "idle_test"} & set(
        p.relative_to(root).parts))
    return _read_texts(files, max_chars, f"the standard library at {root}")


def folder_corpus(folder: str | Path, max_chars: int = 4 * STDLIB_CHARS) -> list[str]:
    """Texts of the source and documentation files under ``folder`` (by suffix), up to ``max_chars``."""
    root = Path(folder)
    if not root.is_dir():
        raise PruneError(f"--draft-vocab-corpus {folder} is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    return _read_texts(files, max_chars, str(folder))


def _read_texts(files, max_chars: int, where: str) -> list[str]:
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # binary or unreadable: not corpus text
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    if not texts:
        raise PruneError(f"no readable text files in {where}")
    return texts


def token_frequencies(tokenizer, texts: list[str], vocab_size: int) -> np.ndarray:  # [V] int64
    """How often each token id occurs in ``texts``. ``tokenizer``: a ``tokenizers.Tokenizer``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    batch = 64
    for start in range(0, len(texts), batch):
        for encoding in tokenizer.encode_batch(texts[start : start + batch], add_special_tokens=False):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def choose_kept_ids(frequencies: np.ndarray, k: int, always=()) -> np.ndarray:  # [K] int64, ascending
    """The ``k`` most frequent ids, always including ``always`` (e.g. EOS). Ties, including the ids the corpus
    never uses once K exceeds its distinct tokens, go to the lower id: a BPE vocabulary numbers its merges in
    the order they were learned, so lower ids are the more common ones in the tokenizer's own training text."""
    vocab = frequencies.shape[0]
    always = sorted({int(t) for t in always if t is not None and 0 <= int(t) < vocab})
    if not len(always) < k < vocab:
        raise PruneError(f"--draft-vocab {k} must be between {len(always) + 1} and {vocab - 1} "
                         f"(the vocabulary has {vocab} tokens)")
    order = np.lexsort((np.arange(vocab), -frequencies))  # by count descending, then id
    chosen = set(always)
    for token in order:
        if len(chosen) == k:
            break
        chosen.add(int(token))
    return np.array(sorted(chosen), dtype=np.int64)


# ----------------------------------------------------------------- the graph

def prune_lm_head(model, kept_ids: np.ndarray, vocab_size: int) -> str:
    """Slice the lm_head of an ``onnx.ModelProto`` (weights loaded) to ``kept_ids``, in place; returns its form.

    Handles MatMul / Gemm with a constant weight (directly, or through a Transpose of one, as a tied
    embedding is exported) and com.microsoft MatMulNBits (rows of B, scales, zero points, bias)."""
    from onnx import numpy_helper

    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    consumers: dict = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def is_scalar(name):
        return name in initializers and int(np.prod(initializers[name].dims)) == 1

    chain, node = [], producer.get("logits")
    while node is not None and node.op_type in _ELEMENTWISE:
        if any(not is_scalar(name) for name in node.input[1:]):
            raise PruneError(f"logits come from {node.op_type} with a non-scalar operand: lm_head form not handled")
        chain.append(node)
        node = producer.get(node.input[0])
    if node is None or node.op_type not in ("MatMul", "Gemm", "MatMulNBits"):
        raise PruneError(f"logits are not computed by a MatMul/Gemm/MatMulNBits (found "
                         f"{node.op_type if node is not None else 'a graph input'}): lm_head form not handled")
    for name in [node.output[0]] + [n.output[0] for n in chain]:
        if name != "logits" and len(consumers.get(name, [])) != 1:
            raise PruneError(f"the lm_head output {name} has other consumers: pruning would change them")
    kept = np.asarray(kept_ids, dtype=np.int64)

    def replace_initializer(name: str, array: np.ndarray, suffix: str) -> str:
        """A new initializer (the old one may be shared, e.g. a tied embedding); returns its name."""
        new_name = f"{name}.{suffix}"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), new_name))
        return new_name

    if node.op_type == "MatMulNBits":
        attrs = {a.name: a for a in node.attribute}
        if attrs["N"].i != vocab_size:
            raise PruneError(f"the lm_head MatMulNBits has N={attrs['N'].i}, not the vocabulary size {vocab_size}")
        for index in (1, 2, 3, 5):  # B [N, blocks, blob], scales, zero_points, bias; [4] g_idx is per K
            if index < len(node.input) and node.input[index]:
                name = node.input[index]
                if name not in initializers:
                    raise PruneError(f"MatMulNBits input {name} is not a constant: lm_head form not handled")
                array = numpy_helper.to_array(initializers[name])
                rows = array.reshape(vocab_size, -1)[kept]
                node.input[index] = replace_initializer(name, rows.reshape((len(kept),) + array.shape[1:])
                                                        if array.shape[0] == vocab_size else rows.reshape(-1),
                                                        f"vocab{len(kept)}")
        attrs["N"].i = len(kept)
        form = "MatMulNBits"
    else:
        trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        weight = node.input[1]
        transpose = producer.get(weight)
        if transpose is not None and transpose.op_type == "Transpose" and transpose.input[0] in initializers:
            base = numpy_helper.to_array(initializers[transpose.input[0]])  # [V, H]: a tied embedding
            perm = [a.ints for a in transpose.attribute if a.name == "perm"]
            if base.ndim != 2 or (perm and list(perm[0]) != [1, 0]) or base.shape[0] != vocab_size:
                raise PruneError("lm_head weight is a Transpose this pruner does not handle")
            node.input[1] = replace_initializer(transpose.input[0], base[kept].T, f"lm_head{len(kept)}")
        elif weight in initializers:
            array = numpy_helper.to_array(initializers[weight])
            axis = 0 if trans_b else array.ndim - 1
            if array.shape[axis] != vocab_size:
                raise PruneError(f"lm_head weight {weight} has shape {array.shape}, no axis of the vocabulary size")
            node.input[1] = replace_initializer(weight, np.take(array, kept, axis=axis), f"vocab{len(kept)}")
        else:
            raise PruneError(f"lm_head weight {weight} is not a constant: lm_head form not handled")
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] in initializers:
            bias = numpy_helper.to_array(initializers[node.input[2]])
            if bias.shape and bias.shape[-1] == vocab_size:
                node.input[2] = replace_initializer(node.input[2], bias[..., kept], f"vocab{len(kept)}")
        form = node.op_type
    _drop_unused_initializers(graph)
    # shapes recorded for the old width: the logits output is declared anew, stale inferred shapes dropped
    touched = {node.output[0]} | {n.output[0] for n in chain}
    kept_info = [info for info in graph.value_info if info.name not in touched]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    for output in graph.output:
        if output.name == "logits":
            output.type.tensor_type.shape.dim[-1].Clear()
            output.type.tensor_type.shape.dim[-1].dim_value = len(kept)
    return form


def _drop_unused_initializers(graph) -> None:
    """Remove what only the old lm_head read: a Transpose of a tied embedding, the old weights."""
    def used_names():
        return {name for node in _nodes_within(graph) for name in node.input} | {o.name for o in graph.output}

    used = used_names()
    for node in [n for n in graph.node if n.op_type == "Transpose" and not set(n.output) & used]:
        graph.node.remove(node)
    used = used_names()
    for tensor in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(tensor)


def _nodes_within(graph):
    """Every node of ``graph`` and of its subgraphs (If / Scan bodies read the outer graph's initializers)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _nodes_within(subgraph)


# ----------------------------------------------------------------- the bundle

def prune_bundle(bundle: str | Path, k: int, out: str | Path, corpus_dir: str | Path | None = None,
                 progress=None, check: bool = True) -> Manifest:
    """Write ``out``: a copy of ``bundle`` whose draft scores only the ``k`` most frequent tokens of the corpus
    (the standard library, or ``corpus_dir``). ``bundle`` is only read. ``check``: compare the pruned draft's
    logits with the full draft's on the kept ids (a 4-token pass) and record the error in the manifest."""
    import onnx
    from tokenizers import Tokenizer

    from specdec.export.bundle import hash_tree, tool_versions
    from specdec.export.destination import check_destination, remove_dead_staging, swap_into_place

    progress = progress or (lambda message: None)
    started = time.monotonic()
    source, out = Path(bundle), Path(out)
    if isinstance(k, bool) or not isinstance(k, int):
        raise PruneError(f"--draft-vocab must be an integer, got {k!r}")
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise PruneError(f"--out {out} must be a new folder outside {bundle}: the source bundle is never modified")
    manifest = open_bundle(source, verify=True)
    draft = manifest.draft
    if draft is None:
        raise PruneError(f"{bundle} has no draft model to prune")
    if draft.vocab_subset is not None:
        raise PruneError(f"{bundle}'s draft is already pruned ({draft.vocab_subset}): prune the full bundle")
    check_destination(out)
    remove_dead_staging(out)

    progress("counting token frequencies in " + (str(corpus_dir) if corpus_dir else "the Python standard library"))
    texts = folder_corpus(corpus_dir) if corpus_dir else stdlib_corpus()
    tokenizer = Tokenizer.from_file(str(source / manifest.tokenizer_file))
    counts = token_frequencies(tokenizer, texts, draft.vocab_size)
    always = [*draft.eos_token_ids, *manifest.target.eos_token_ids, draft.bos_token_id, draft.pad_token_id]
    kept = choose_kept_ids(counts, k, always)
    coverage = float(counts[kept].sum() / max(counts.sum(), 1))
    progress(f"keeping {k} of {draft.vocab_size} tokens ({coverage:.2%} of the corpus's tokens)")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    draft_onnx = source / draft.onnx_file
    draft_dir = Path(draft.onnx_file).parent
    try:
        for relative in manifest.files:  # everything but the draft's graph and its weights, copied
            if Path(relative).parent == draft_dir and relative.startswith(draft.onnx_file):
                continue
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / relative, staging / relative)
        progress(f"pruning the draft's lm_head ({draft.onnx_file})")
        model = onnx.load(str(draft_onnx), load_external_data=True)
        form = prune_lm_head(model, kept, draft.vocab_size)
        target_onnx = staging / draft.onnx_file
        target_onnx.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(target_onnx), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=target_onnx.name + ".data", size_threshold=1024)
        del model
        subset = draft_dir / SUBSET_NAME
        np.save(staging / subset, kept)
        outputs = tuple(TensorSpec(s.name, s.dtype, s.shape[:-1] + (k,)) if s.name == "logits" else s
                        for s in draft.outputs)
        new_draft = replace(draft, outputs=outputs, vocab_subset=subset.as_posix())
        notes = {"k": k, "of": draft.vocab_size, "corpus": str(corpus_dir) if corpus_dir else "python-stdlib",
                 "corpus_token_coverage": round(coverage, 5), "lm_head": form, "source_bundle": source.name}
        if check:
            progress("checking the pruned draft against the full one (logits on the kept ids)")
            notes["max_abs_error_on_kept_logits"] = _compare(draft_onnx, target_onnx, draft, new_draft, kept)
        new = replace(manifest, draft=new_draft, files=hash_tree(staging), tools={**manifest.tools, **tool_versions()},
                      extra={**manifest.extra, "draft_vocab": notes,
                             "prune_seconds": round(time.monotonic() - started, 1)})
        (staging / MANIFEST_NAME).write_text(new.to_json())
        swap_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return new


def _compare(full_onnx: Path, pruned_onnx: Path, spec, pruned_spec, kept: np.ndarray) -> float:
    """Max |full[..., kept] - pruned| over a 4-token pass from an empty cache, each graph through the runtime's
    runner for its form (so the check feeds exactly the manifest's contract)."""
    from specdec.runners.factory import make_runner

    tokens = kept[:4]
    logits = []
    for path, model_spec, kept_ids in ((full_onnx, spec, None), (pruned_onnx, pruned_spec, kept)):
        runner = make_runner(str(path), model_spec, "cpu", len(tokens), len(tokens), kept_ids=kept_ids)
        logits.append(runner.forward(tokens, range(len(tokens))).copy())
        del runner
    full, pruned = logits  # both [T, V]: the runner maps the pruned graph's K columns back to the vocabulary
    return float(np.max(np.abs(full[:, kept] - pruned[:, kept])))
