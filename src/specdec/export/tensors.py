"""A model's weights read one tensor at a time, from safetensors shards or a GGUF file: never the whole model.

``open_weights(source)`` gives a ``Weights`` reader whose ``get(name)`` returns one tensor as float32 numpy,
named as Hugging Face names it (``model.layers.3.self_attn.q_proj.weight``), and, for a GGUF, ``grid(name)``:
the tensor's own quantized blocks (``gguf_blocks.Grid``) for the methods that carry them over.

- safetensors: each shard's header is parsed once; a tensor's bytes are read with one ``readinto`` into a buffer
  of its own (not a memory map: mapped pages of a 4 GB shard count as resident), bfloat16 widened by a shift, so
  holding a tensor costs its size in float32 plus its stored bytes while it converts.
- GGUF: ``gguf.GGUFReader`` maps the file; a tensor is dequantized (``gguf.quants.dequantize``) when asked for.
  Names follow llama.cpp's (``blk.N.attn_q.weight``); ``GGUF_NAMES`` maps them. llama.cpp stores a Llama's q and k
  rows permuted for its rotary layout: undone here, as transformers' GGUF loader undoes it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from specdec.export.gguf_blocks import KINDS, Grid, grid_of

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                       "I64": np.int64, "I32": np.int32}

# Hugging Face name (layer index as {i}) -> llama.cpp's GGUF name
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
ROWS_PER_CHUNK = 8192  # a GGUF tensor is dequantized (or decoded into a Grid) this many rows at a time


class WeightsError(ValueError):
    """A weight a model needs is missing or unreadable."""


class Weights:
    """One tensor at a time, by Hugging Face name."""

    def names(self) -> set:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (a new array the caller owns)."""
        raise NotImplementedError

    def grid(self, name: str) -> tuple[str, Grid] | None:
        """(storage type, its quantized blocks as a Grid) when the source holds ``name`` in a carried type."""
        return None

    def close(self) -> None:
        pass


class SafetensorsWeights(Weights):
    def __init__(self, folder: Path):
        self.entries = {}  # name -> (path, dtype, shape, absolute start, end)
        for path in sorted(Path(folder).glob("*.safetensors")):
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                start, end = entry["data_offsets"]
                self.entries[name] = (path, entry["dtype"], tuple(entry["shape"]), 8 + length + start, 8 + length + end)

    def names(self) -> set:
        return set(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def get(self, name: str) -> np.ndarray:
        try:
            path, dtype, shape, start, end = self.entries[name]
        except KeyError:
            raise WeightsError(f"tensor {name} is not in the safetensors files") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise WeightsError(f"tensor {name} has dtype {dtype}, which the exporter does not read")
        raw = np.empty((end - start) // np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize, _SAFETENSORS_DTYPES[dtype])
        with open(path, "rb") as handle:
            handle.seek(start)
            if handle.readinto(memoryview(raw).cast("B")) != end - start:
                raise WeightsError(f"{path} ends inside tensor {name}: truncated")
        if dtype == "BF16":
            widened = raw.astype(np.uint32)
            del raw
            widened <<= 16
            return widened.view(np.float32).reshape(shape)
        return raw.astype(np.float32, copy=False).reshape(shape)


class GGUFWeights(Weights):
    def __init__(self, path: Path, num_heads: int, num_kv_heads: int):
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        field = self.reader.fields.get("general.architecture")
        self.architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self._names = {}
        for hf, gguf in GGUF_NAMES.items():
            if "{i}" not in hf:
                if gguf in self.tensors:
                    self._names[hf] = gguf
                continue
            for name in self.tensors:
                match = re.fullmatch(re.escape(gguf).replace(r"\{i\}", r"(\d+)"), name)
                if match:
                    self._names[hf.replace("{i}", match.group(1))] = name

    def names(self) -> set:
        return set(self._names)

    def _tensor(self, name: str):
        try:
            return self.tensors[self._names[name]]
        except KeyError:
            raise WeightsError(f"tensor {name} ({GGUF_NAMES.get(_LAYER.sub('model.layers.{i}.', name), '?')}) is "
                               "not in the GGUF file") from None

    def _rows(self, name: str) -> np.ndarray | None:
        """The row order that undoes llama.cpp's rotary permutation of a Llama's q / k (None: as stored)."""
        if self.architecture != "llama" or not re.search(r"\.(q|k)_proj\.(weight|bias)$", name):
            return None
        heads = self.num_heads if ".q_proj." in name else self.num_kv_heads
        rows = self._tensor(name).data.shape[0]
        half = rows // heads // 2
        # stored row (h, d, j) -> Hugging Face row (h, j, d): transformers' _reverse_permute_weights as a gather
        return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)

    def get(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        tensor = self._tensor(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dimension first
        data = tensor.data
        if len(shape) == 1:
            values = dequantize(data, tensor.tensor_type).astype(np.float32).reshape(shape)
        else:  # row chunks: dequantizing a whole 150k-row table at once takes several times its size
            values = np.empty(shape, np.float32)
            for start in range(0, shape[0], ROWS_PER_CHUNK):
                part = data[start : start + ROWS_PER_CHUNK]
                values[start : start + len(part)] = dequantize(part, tensor.tensor_type).reshape(len(part), -1)
        order = self._rows(name)
        return values[order] if order is not None else values

    def grid(self, name: str) -> tuple[str, Grid] | None:
        tensor = self._tensor(name)
        kind = tensor.tensor_type.name
        if kind not in KINDS or len(tensor.shape) != 2:
            return None
        rows = tensor.data.shape[0]
        parts = [grid_of(tensor.data[start : start + ROWS_PER_CHUNK], kind)
                 for start in range(0, rows, ROWS_PER_CHUNK)]  # row chunks, as get()
        grid = parts[0] if len(parts) == 1 else Grid(
            parts[0].bits, np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
            np.concatenate([p.zero for p in parts]),
            None if parts[0].correction is None else np.concatenate([p.correction for p in parts]),
            float(sum(p.exact_blocks * p.scale.size for p in parts) / sum(p.scale.size for p in parts)))
        order = self._rows(name)
        if order is not None:
            grid = Grid(grid.bits, grid.q[order], grid.scale[order], grid.zero[order],
                        None if grid.correction is None else grid.correction[order], grid.exact_blocks)
        return kind, grid

    def storage_type(self, name: str) -> str:
        return self._tensor(name).tensor_type.name


def open_weights(source, num_heads: int, num_kv_heads: int) -> Weights:
    """The reader of a ``sources.ModelSource``: its GGUF file, or its folder's safetensors shards."""
    if source.gguf_file:
        return GGUFWeights(source.path / source.gguf_file, num_heads, num_kv_heads)
    return SafetensorsWeights(source.path)
