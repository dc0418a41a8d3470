"""Trace one model to ONNX in one of two graph forms and describe it.

- ``standard``: ``ExportableLM``, portable standard ops (opset 18): TensorRT's input, any runtime.
- ``fused``: ``FusedLM``, attention as onnxruntime's GroupQueryAttention on a shared in-place
  KV buffer (``graph_fused``): onnxruntime only, faster, a pass does not copy the past.

Writes ``model.onnx`` plus ``model.onnx.data`` (external weights) into a folder and
returns the model's ``ModelSpec`` for the manifest.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from specdec.contract.manifest import KV_LAYOUTS, ModelSpec, fused_graph_io, fused_kv_names, graph_io, kv_names

from specdec.export.graph_fused import SCRATCH_ROWS
from specdec.export.graph_model import ExportableLM, text_config

OPSET = 18
GRAPH_FORMS = tuple(KV_LAYOUTS)  # ("standard", "fused")
ONNX_NAME = "model.onnx"
_TORCH_TO_NUMPY = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def example_inputs(lm: ExportableLM, past_len: int = 3, new_len: int = 4):
    """Trace-time inputs. Sizes are >= 2 so torch.export keeps every dimension symbolic."""
    dtype = next(lm.parameters()).dtype
    input_ids = torch.zeros((1, new_len), dtype=torch.int64)
    position_ids = torch.arange(past_len, past_len + new_len, dtype=torch.int64)[None]
    mask = torch.ones((1, new_len, past_len + new_len), dtype=torch.bool)
    masks = (mask, mask.clone()) if lm.has_sliding_mask else (mask,)
    past = tuple(
        torch.zeros((1, past_len, lm.num_kv_heads, lm.head_dim), dtype=dtype) for _ in range(2 * len(lm.layers))
    )
    return (input_ids, position_ids, *masks, *past)


def fused_example_inputs(lm, past_len: int = 3, new_len: int = 4, capacity: int = 9):
    """Trace-time inputs of the fused form (sizes >= 2 and distinct, so every dimension stays symbolic)."""
    dtype = next(lm.parameters()).dtype
    input_ids = torch.zeros((1, new_len), dtype=torch.int64)
    position_ids = torch.arange(past_len, past_len + new_len, dtype=torch.int64)[None]
    bias = torch.zeros((1, 1, new_len, past_len + new_len), dtype=torch.float32)
    biases = (bias, bias.clone()) if lm.has_sliding_mask else (bias,)
    seqlens_k = torch.tensor([past_len + new_len - 1], dtype=torch.int32)
    total = torch.tensor(past_len + new_len, dtype=torch.int32)
    logit_rows = torch.tensor([1, 2, 3], dtype=torch.int64)  # 3 of the 4 rows: its own symbolic size
    past = tuple(
        torch.zeros((1, lm.num_kv_heads, capacity, lm.head_dim), dtype=dtype) for _ in range(2 * len(lm.layers))
    )
    return (input_ids, position_ids, *biases, seqlens_k, total, logit_rows, *past)


def export_model(hf_model, role: str, out_dir: Path, special: dict, dtype: str, graph: str = "standard") -> ModelSpec:
    """Export ``hf_model`` into ``out_dir`` in graph form ``graph`` and describe it. ``special``: bos/eos/pad ids."""
    if graph not in GRAPH_FORMS:
        raise ValueError(f"graph form {graph!r} is not one of {', '.join(GRAPH_FORMS)}")
    config = text_config(hf_model.config)
    max_positions = int(getattr(config, "max_position_embeddings", 2048) or 2048)
    auto = torch.export.Dim.AUTO
    if graph == "fused":
        from specdec.export.graph_fused import FusedLM

        lm = FusedLM(hf_model, max_positions).eval()
        io, names, args = fused_graph_io, fused_kv_names, fused_example_inputs(lm)
        bias_dims = {0: auto, 2: auto, 3: auto}
        rest = ([bias_dims] * lm.has_sliding_mask + [{0: auto}, {}, {0: auto}]
                + [{0: auto, 2: auto}] * (2 * len(lm.layers)))
        dynamic = ({0: auto, 1: auto}, {0: auto, 1: auto}, bias_dims, tuple(rest))
    else:
        lm = ExportableLM(hf_model).eval()
        io, names, args = graph_io, kv_names, example_inputs(lm)
        mask_dims = {0: auto, 1: auto, 2: auto}
        rest = [mask_dims] * lm.has_sliding_mask + [{0: auto, 1: auto}] * (2 * len(lm.layers))
        dynamic = ({0: auto, 1: auto}, {0: auto, 1: auto}, mask_dims, tuple(rest))  # mirrors forward's signature
    kv_dtype = _TORCH_TO_NUMPY[next(lm.parameters()).dtype]
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    inputs, outputs = io(len(lm.layers), lm.num_kv_heads, lm.head_dim, vocab, kv_dtype, lm.has_sliding_mask)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(
            lm,
            args,
            dynamo=True,
            opset_version=OPSET,
            dynamic_shapes=dynamic,
            input_names=[spec.name for spec in inputs],
            output_names=[spec.name for spec in outputs],
            optimize=True,
            verbose=False,
        )
    program.save(str(out_dir / ONNX_NAME), external_data=True)
    del program
    gc.collect()
    _name_symbolic_dims(out_dir / ONNX_NAME, inputs, outputs)
    return ModelSpec(
        role=role,
        architecture=config.model_type,
        onnx_file=f"{role}/{ONNX_NAME}",
        inputs=inputs,
        outputs=outputs,
        kv=names(len(lm.layers)),
        num_layers=len(lm.layers),
        num_kv_heads=lm.num_kv_heads,
        head_dim=lm.head_dim,
        hidden_size=lm.hidden_size,
        vocab_size=int(vocab),
        max_positions=max_positions,
        kv_dtype=kv_dtype,
        dtype=dtype,
        quant="none",
        sliding_window=lm.sliding_window,
        bos_token_id=special["bos_token_id"],
        eos_token_ids=tuple(special["eos_token_ids"]),
        pad_token_id=special["pad_token_id"],
        graph=graph,
        kv_layout=KV_LAYOUTS[graph],
        attention_scratch_rows=SCRATCH_ROWS if graph == "fused" else 0,
    )


def _name_symbolic_dims(path: Path, inputs, outputs) -> None:
    """Replace torch.export's generated dim names (s12, ...) with the contract's names, in place."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    specs = {spec.name: spec for spec in (*inputs, *outputs)}
    for value in (*model.graph.input, *model.graph.output):
        spec = specs.get(value.name)
        if spec is None:
            raise RuntimeError(f"exported graph has an unexpected input/output {value.name!r}")
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(spec.shape):
            raise RuntimeError(f"exported {value.name} has rank {len(dims)}, the contract says {len(spec.shape)}")
        for dim, want in zip(dims, spec.shape):
            if isinstance(want, str):
                dim.Clear()
                dim.dim_param = want
    onnx.save(model, str(path))
