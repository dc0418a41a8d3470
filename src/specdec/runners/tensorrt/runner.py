"""A model run by native TensorRT: the same interface as ``specdec.runners.standard.ModelRunner``.

One execution context per optimization profile (decode, verify, prefill), all on one CUDA
stream. Per pass: ``set_input_shape`` for the actual T and past length, ``set_tensor_address``
into preallocated device buffers (the KV cache is the same pointer arithmetic as on the
host), ``execute_async_v3``, then only the T x vocab logits are copied to the host. Nothing
is allocated per step. Needs a GPU, TensorRT and cuda-python; run ``tools/check/gpu_check.py``.
"""

from __future__ import annotations

import numpy as np

from specdec.runners.kv_store import DeviceKV
from specdec.contract.manifest import BundleError, ModelSpec
from specdec.contract.limits import MAX_PASS_TOKENS
from specdec.runners.runner import Runner

from specdec.runners.cuda_memory import DeviceBuffer, new_stream, synchronize
from specdec.runners.tensorrt.profiles import ProfileLimits, build_profiles, profile_for
from specdec.runners.tensorrt.records import require_standard_form


# the most tokens one pass of the decoder carries: a prompt chunk, or a tree plus the pending tokens


class TensorRTRunner(Runner):
    """Masks, lengths and compaction come from the shared ``Runner``; this class binds device buffers and runs."""

    def __init__(self, engine_path: str, spec: ModelSpec, limits: ProfileLimits, max_context: int):
        require_standard_form(spec)
        import tensorrt as trt

        if max_context > limits.max_context:
            raise ValueError(f"max_context {max_context} exceeds the engine's profiles ({limits.max_context})")
        if limits.max_prefill < MAX_PASS_TOKENS:  # refused here, not as a failed pass mid-generation
            raise BundleError(f"the {spec.role} engine's largest profile takes {limits.max_prefill} tokens per pass; "
                              f"the decoder's passes take up to {MAX_PASS_TOKENS} (prompt chunks, trees): rebuild the "
                              f"engines with max_prefill >= {MAX_PASS_TOKENS}")
        self._init_book(spec, max_context, limits.max_prefill)
        logger = trt.Logger(trt.Logger.WARNING)
        with open(engine_path, "rb") as handle:  # hash already verified by specdec.runners.tensorrt.records
            self.engine = trt.Runtime(logger).deserialize_cuda_engine(handle.read())
        if self.engine is None:  # TensorRT logs why and returns None
            raise BundleError(f"TensorRT could not deserialize {engine_path}: rebuild it with specdec-export build-engine")
        self.stream = new_stream()
        self.profiles = build_profiles(spec, limits)
        self.contexts = []
        for index in range(len(self.profiles)):
            context = self.engine.create_execution_context()
            if context is None:  # TensorRT's answer when the device memory for activations is missing
                raise RuntimeError("TensorRT could not create an execution context (out of device memory?)")
            context.set_optimization_profile_async(index, self.stream)
            self.contexts.append(context)
        kv_dtype = np.float16 if spec.kv_dtype == "float16" else np.float32
        self.kv = DeviceKV(spec.num_layers, max_context, spec.num_kv_heads, spec.head_dim, kv_dtype, self.stream)
        steps = self.max_step_tokens
        self._ids = DeviceBuffer(steps * 8)
        self._positions = DeviceBuffer(steps * 8)
        self._device_mask = DeviceBuffer(steps * max_context)
        self._device_sliding = DeviceBuffer(steps * max_context) if spec.has_sliding_mask else None
        self._logits = DeviceBuffer(steps * spec.vocab_size * 4)
        self._host_logits = np.zeros(steps * spec.vocab_size, dtype=np.float32)

    def _move_kv(self, sources, first_slot: int) -> None:
        self.kv.move_rows(sources, first_slot)

    def _run(self, ids, pos, mask, sliding, past) -> np.ndarray:
        spec, count = self.spec, len(ids)
        total = past + count
        context = self.contexts[profile_for(self.profiles, count)]
        self._ids.upload(0, ids, self.stream)
        self._positions.upload(0, pos, self.stream)
        self._device_mask.upload(0, np.ascontiguousarray(mask), self.stream)
        addresses = {"input_ids": (self._ids.ptr, (1, count)), "position_ids": (self._positions.ptr, (1, count)),
                     "attention_mask": (self._device_mask.ptr, (1, count, total)),
                     "logits": (self._logits.ptr, None)}
        if sliding is not None:
            self._device_sliding.upload(0, np.ascontiguousarray(sliding), self.stream)
            addresses["sliding_attention_mask"] = (self._device_sliding.ptr, (1, count, total))
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
        return logits.reshape(count, spec.vocab_size)


def tensorrt_runners(root, manifest, max_context: int) -> dict:
    """{role: TensorRTRunner} for a bundle whose engines were built and verified for this device."""
    from specdec.runners.tensorrt.records import verified_engine
    from specdec.runners.tensorrt.build import current_device

    device = current_device()
    runners = {}
    for role, spec in manifest.models().items():
        path, record = verified_engine(root, manifest, role, device)
        limits = ProfileLimits(record.max_context, record.max_verify, record.max_prefill)
        runners[role] = TensorRTRunner(str(path), spec, limits, max_context)
    return runners
