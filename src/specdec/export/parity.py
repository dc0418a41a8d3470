"""Parity of an exported graph against the Hugging Face model it came from.

Four scenarios, each compared on logits and on the new KV rows, as max abs error:
prefill (empty past), decode (T=1 after the prefill), chain verify (T=5 after the
prefill) and a tree (5 nodes, siblings at one position). The ONNX side always runs with
the past it produced itself, as the runtime does; the Hugging Face side recomputes each
full sequence from scratch with its own causal attention, so a wrong mask, position or
cache row shows up as an error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.contract.manifest import ModelSpec
from specdec.runners.kv_int8 import dequantize_rows, quantize_rows
from specdec.runners.masks import build_masks

TREE_PARENTS = (-1, 0, 0, 1, 2)  # a root, two children, one grandchild under each


def _hf_forward(hf_model, ids: list[int]):
    """Logits [S, V] float32 and per-layer (keys, values) as [S, KVH, D] float32."""
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    rows = []
    for layer in cache.layers:
        rows.append((layer.keys[0].transpose(0, 1).float().numpy(), layer.values[0].transpose(0, 1).float().numpy()))
    return out.logits[0].float().numpy(), rows


class OnnxRunner:
    """Plain (non IO-bound) runs of an exported graph, for checks."""

    def __init__(self, onnx_path: Path, spec: ModelSpec):
        import onnxruntime as ort

        from specdec.runners.standard import session_options

        self.spec = spec
        self.session = ort.InferenceSession(str(onnx_path), session_options(), providers=["CPUExecutionProvider"])
        self.key_smoothing = None  # an int8 cache's [layers, KVH, D] key factors: its stored keys are k / factors
        if spec.kv_dtype == "int8":
            from specdec.export.kv_smoothing import read_key_smoothing

            self.key_smoothing = read_key_smoothing(onnx_path, spec.num_layers, spec.num_kv_heads)

    def run(self, tokens, positions, past, parents=None, past_positions=None):
        """past: list of (keys [P, KVH, D], values [P, KVH, D]) per layer. Returns logits [T, V], new rows."""
        if self.spec.graph == "fused":
            return self._run_fused(tokens, positions, past, parents, past_positions)
        spec = self.spec
        past_len = past[0][0].shape[0]
        past_positions = np.arange(past_len) if past_positions is None else past_positions
        mask, sliding = build_masks(past_positions, positions, parents, spec.sliding_window)
        feeds = {
            "input_ids": np.asarray([tokens], dtype=np.int64),
            "position_ids": np.asarray([positions], dtype=np.int64),
            "attention_mask": mask,
        }
        if spec.has_sliding_mask:
            feeds["sliding_attention_mask"] = sliding
        kv_dtype = np.dtype(spec.kv_dtype)
        for names, (keys, values) in zip(spec.kv, past):
            feeds[names.past_key] = keys[None].astype(kv_dtype)
            feeds[names.past_value] = values[None].astype(kv_dtype)
        wanted = ["logits"] + [n for names in spec.kv for n in (names.new_key, names.new_value)]
        outs = self.session.run(wanted, feeds)
        rows = [(outs[1 + 2 * i][0].astype(np.float32), outs[2 + 2 * i][0].astype(np.float32)) for i in range(spec.num_layers)]
        return outs[0][0], rows


    def _run_fused(self, tokens, positions, past, parents, past_positions):
        """The fused form through the runtime's own FusedRunner (the shared, in-place KV buffer it binds)."""
        from specdec.runners.factory import make_runner

        past_len, count = past[0][0].shape[0], len(tokens)
        runner = make_runner("", self.spec, "cpu", past_len + count, count, session=self.session)
        scales = getattr(runner, "scales", None)  # an int8 cache's (runners/kv_int8.py)
        smoothing = self.key_smoothing
        for layer, (keys, values) in enumerate(past):
            for kind, rows in ((0, keys), (1, values)):
                rows = rows.transpose(1, 0, 2)  # [KVH, P, D]
                if kind == 0 and smoothing is not None:
                    rows = rows / smoothing[layer][:, None]
                if scales is not None:
                    rows, scales[layer, kind, 0, :, :past_len] = quantize_rows(rows)
                runner.cache[layer, kind, 0, :, :past_len] = rows
        runner.slot_positions[:past_len] = np.arange(past_len) if past_positions is None else past_positions
        runner.length = past_len
        logits = runner.forward(tokens, positions, parents).copy()
        new = slice(past_len, past_len + count)

        def read(layer: int, kind: int) -> np.ndarray:  # [T, KVH, D] float32, as the source model's rows
            rows = (runner.cache[layer, kind, 0, :, new].astype(np.float32) if scales is None else
                    dequantize_rows(runner.cache[layer, kind, 0, :, new], scales[layer, kind, 0, :, new]))
            if kind == 0 and smoothing is not None:
                rows = rows * smoothing[layer][:, None]
            return rows.transpose(1, 0, 2)

        rows = [(read(layer, 0), read(layer, 1)) for layer in range(self.spec.num_layers)]
        return logits, rows


def _kv_error(onnx_rows, hf_rows) -> float:
    """Max abs error over layers, keys and values, comparing the last rows of both.

    The Hugging Face rows end at the same token as the ONNX rows; a sliding-window layer's
    cache may keep only its window, so only the rows both sides hold are compared.
    """
    errors = [0.0]
    for (onnx_keys, onnx_values), (hf_keys, hf_values) in zip(onnx_rows, hf_rows):
        count = min(len(onnx_keys), len(hf_keys))
        errors.append(float(np.abs(onnx_keys[len(onnx_keys) - count :] - hf_keys[len(hf_keys) - count :]).max(initial=0.0)))
        errors.append(float(np.abs(onnx_values[len(onnx_values) - count :] - hf_values[len(hf_values) - count :]).max(initial=0.0)))
    return max(errors)


def _tree_paths(tree_tokens: list[int]) -> tuple[list, list]:
    """(depth of each tree node, token path from the root to each node)."""
    depths, paths = [], []
    for node, parent in enumerate(TREE_PARENTS):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        paths.append(([] if parent < 0 else paths[parent]) + [tree_tokens[node]])
    return depths, paths


def parity_sequences(prompt_ids: list[int], extra_ids: list[int]) -> list:
    """Every token sequence the parity scenarios compare against (prefill, decode, chain, each tree path)."""
    sequences = [prompt_ids, prompt_ids + extra_ids[:1], prompt_ids + extra_ids[:5]]
    return sequences + [prompt_ids + path for path in _tree_paths(extra_ids[:5])[1]]


def reference_outputs(hf_model, prompt_ids: list[int], extra_ids: list[int]) -> dict:
    """Hugging Face logits and KV rows for every sequence the parity scenarios need, keyed by token tuple.

    Computed once per model, so the model can be freed before quantizing and the quantized
    graph is still compared with the float reference.
    """
    return {tuple(ids): _hf_forward(hf_model, ids) for ids in parity_sequences(prompt_ids, extra_ids)}


def check_parity(references: dict, onnx_path: Path, spec: ModelSpec, prompt_ids: list[int], extra_ids: list[int]) -> dict:
    """Max abs errors {scenario: {"logits": e, "kv": e}} of the graph at ``onnx_path`` vs ``reference_outputs``."""

    runner = OnnxRunner(onnx_path, spec)
    n = len(prompt_ids)
    empty = [
        (np.zeros((0, spec.num_kv_heads, spec.head_dim), np.float32),) * 2 for _ in range(spec.num_layers)
    ]
    report = {}

    hf_logits, hf_rows = references[tuple(prompt_ids)]
    logits, past = runner.run(prompt_ids, list(range(n)), empty)
    report["prefill"] = {"logits": float(np.abs(logits - hf_logits).max()), "kv": _kv_error(past, hf_rows)}

    hf_logits, hf_rows = references[tuple(prompt_ids + extra_ids[:1])]
    logits, rows = runner.run(extra_ids[:1], [n], past)
    report["decode"] = {"logits": float(np.abs(logits - hf_logits[-1:]).max()), "kv": _kv_error(rows, hf_rows)}

    chain = extra_ids[:5]
    hf_logits, hf_rows = references[tuple(prompt_ids + chain)]
    logits, rows = runner.run(chain, list(range(n, n + 5)), past)
    report["chain_verify"] = {
        "logits": float(np.abs(logits - hf_logits[-5:]).max()),
        "kv": _kv_error(rows, hf_rows),
    }

    # The graph against itself: the chain's rows vs one-token passes over the same tokens. Greedy speculation
    # equals target-only decoding only if these agree; 0.0 when the rows do not depend on the pass width.
    step_past, step_logits = past, []
    for i, token in enumerate(chain):
        one, new_rows = runner.run([token], [n + i], step_past)
        step_logits.append(one[0])
        step_past = [(np.concatenate([k, nk]), np.concatenate([v, nv])) for (k, v), (nk, nv) in zip(step_past, new_rows)]
    decoded_rows = [(k[n:], v[n:]) for k, v in step_past]
    report["rows_vs_decode"] = {
        "logits": float(np.abs(logits - np.array(step_logits)).max()),
        "kv": max(float(np.abs(a - b).max()) for chain_kv, step_kv in zip(rows, decoded_rows)
                  for a, b in zip(chain_kv, step_kv)),
    }

    tree_tokens = extra_ids[:5]
    depths, paths = _tree_paths(tree_tokens)
    logits, rows = runner.run(tree_tokens, [n + d for d in depths], past, parents=list(TREE_PARENTS))
    logit_err, kv_err = 0.0, 0.0
    for node, path in enumerate(paths):
        hf_logits, hf_rows = references[tuple(prompt_ids + path)]
        logit_err = max(logit_err, float(np.abs(logits[node] - hf_logits[-1]).max()))
        node_rows = [(k[node : node + 1], v[node : node + 1]) for k, v in rows]
        kv_err = max(kv_err, _kv_error(node_rows, hf_rows))
    report["tree"] = {"logits": logit_err, "kv": kv_err}
    return report
