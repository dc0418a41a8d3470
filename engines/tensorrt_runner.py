"""A model run by native TensorRT: the same interface as ``specdec.runtime.model_runner.ModelRunner``.

One execution context per optimization profile (decode, verify, prefill), all on one CUDA
stream. Per pass: ``set_input_shape`` for the actual T and past length, ``set_tensor_address``
into preallocated device buffers (the KV cache is the same pointer arithmetic as on the
host), ``execute_async_v3``, then only the T x vocab logits are copied to the host. Nothing
is allocated per step. Needs a GPU, TensorRT and cuda-python; run ``samples/gpu_check.py``.
"""

from __future__ import annotations

import numpy as np

from specdec.runtime.kv_store import DeviceKV
from specdec.runtime.manifest import ModelSpec
from specdec.runtime.masks import ancestor_matrix, chain_parents, fill_masks

from .cuda_memory import DeviceBuffer, new_stream, synchronize
from .profiles import ProfileLimits, build_profiles, profile_for
from .records import require_standard_form


class TensorRTRunner:
    def __init__(self, engine_path: str, spec: ModelSpec, limits: ProfileLimits, max_context: int):
        require_standard_form(spec)
        import tensorrt as trt

        if max_context > limits.max_context:
            raise ValueError(f"max_context {max_context} exceeds the engine's profiles ({limits.max_context})")
        self.spec = spec
        self.max_context = max_context
        self.max_step_tokens = limits.max_prefill
        logger = trt.Logger(trt.Logger.WARNING)
        with open(engine_path, "rb") as handle:  # hash already verified by specdec.engines.records
            self.engine = trt.Runtime(logger).deserialize_cuda_engine(handle.read())
        self.stream = new_stream()
        self.profiles = build_profiles(spec, limits)
        self.contexts = []
        for index in range(len(self.profiles)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, self.stream)
            self.contexts.append(context)
        kv_dtype = np.float16 if spec.kv_dtype == "float16" else np.float32
        self.kv = DeviceKV(spec.num_layers, max_context, spec.num_kv_heads, spec.head_dim, kv_dtype, self.stream)
        steps = self.max_step_tokens
        self._ids = DeviceBuffer(steps * 8)
        self._positions = DeviceBuffer(steps * 8)
        self._mask = DeviceBuffer(steps * max_context)
        self._sliding = DeviceBuffer(steps * max_context) if spec.has_sliding_mask else None
        self._logits = DeviceBuffer(steps * spec.vocab_size * 4)
        self._host_logits = np.zeros(steps * spec.vocab_size, dtype=np.float32)
        self._host_mask = np.zeros(steps * max_context, dtype=bool)
        self._host_sliding = np.zeros_like(self._host_mask) if spec.has_sliding_mask else None
        self.slot_positions = np.zeros(max_context, dtype=np.int64)
        self.length = 0
        self.forward_count = 0

    def reset(self) -> None:
        self.length = 0

    def commit(self, count: int) -> None:
        self.length += count

    def move_rows(self, sources, first_slot: int) -> None:
        self.kv.move_rows(sources, first_slot)
        for offset, slot in enumerate(sources):
            self.slot_positions[first_slot + offset] = self.slot_positions[slot]

    def forward(self, tokens, positions, parents=None, visible_past=None) -> np.ndarray:
        spec, count, past = self.spec, len(tokens), self.length
        total = past + count
        if past + count > self.max_context:
            raise ValueError(f"context of {total} tokens exceeds max_context {self.max_context}")
        context = self.contexts[profile_for(self.profiles, count)]
        ids = np.asarray(tokens, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        mask = self._host_mask[: count * total].reshape(count, total)
        sliding = None if self._host_sliding is None else self._host_sliding[: count * total].reshape(count, total)
        visible = ancestor_matrix(np.asarray(parents)) if parents is not None else ancestor_matrix(chain_parents(count))
        fill_masks(mask, sliding, past, visible, self.slot_positions[:past], pos, spec.sliding_window, visible_past)
        self._ids.upload(0, ids, self.stream)
        self._positions.upload(0, pos, self.stream)
        self._mask.upload(0, mask, self.stream)
        addresses = {"input_ids": (self._ids.ptr, (1, count)), "position_ids": (self._positions.ptr, (1, count)),
                     "attention_mask": (self._mask.ptr, (1, count, total)),
                     "logits": (self._logits.ptr, None)}
        if sliding is not None:
            self._sliding.upload(0, sliding, self.stream)
            addresses["sliding_attention_mask"] = (self._sliding.ptr, (1, count, total))
        for layer, names in enumerate(spec.kv):
            for kind, (past_name, new_name) in enumerate(((names.past_key, names.new_key),
                                                          (names.past_value, names.new_value))):
                addresses[past_name] = (self.kv.pointer(layer, kind, 0), (1, past, spec.num_kv_heads, spec.head_dim))
                addresses[new_name] = (self.kv.pointer(layer, kind, past), None)
        for name, (address, shape) in addresses.items():
            if shape is not None:
                context.set_input_shape(name, shape)
            context.set_tensor_address(name, address)
        if not context.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT execution failed")
        logits = self._host_logits[: count * spec.vocab_size]
        self._logits.download(0, logits, self.stream)
        synchronize(self.stream)
        self.slot_positions[past:total] = pos
        self.forward_count += 1
        return logits.reshape(count, spec.vocab_size)
