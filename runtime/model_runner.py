"""One exported model: an onnxruntime session, its preallocated KV cache, and IO binding.

The cache is one array ``[layers, 2 (key, value), batch=1, max_context, kv_heads, head_dim]``
allocated once. Slot j holds the keys/values of one token; ``length`` slots are valid.
A forward pass over T new tokens binds ``cache[l, :, :, :length]`` as the past (read in
place) and ``cache[l, :, :, length:length+T]`` as the output for the new rows, so the
graph writes them straight into the cache: nothing is concatenated or copied on the host.
``commit(n)`` keeps the first n new rows; rejected rows are simply overwritten by the next
pass. Rollback is moving ``length``.
"""

from __future__ import annotations

import numpy as np

from .kv_store import DeviceKV, HostKV
from .manifest import BundleError, ModelSpec
from .masks import ancestor_matrix, chain_parents, fill_masks

# The CUDA arena grows only by what is requested (no power-of-two jumps): on Jetson's unified memory
# the default strategy can take memory the CPU side needs.
_CUDA = ("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": [_CUDA, "CPUExecutionProvider"],
    "tensorrt": [("TensorrtExecutionProvider", {"trt_max_workspace_size": 1 << 30}), _CUDA, "CPUExecutionProvider"],
}
_NUMPY_KV = {"float32": np.float32, "float16": np.float16}


def providers_for(provider: str) -> list:
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise ValueError(f"provider {provider!r} is not one of {', '.join(PROVIDERS)}, tensorrt-native")
    wanted = PROVIDERS[provider][0]
    wanted = wanted[0] if isinstance(wanted, tuple) else wanted
    if wanted not in ort.get_available_providers():
        package = "onnxruntime-gpu" if provider in ("cuda", "tensorrt") else "onnxruntime"
        raise ValueError(
            f"provider {provider} requested but onnxruntime has no {wanted}: install {package}"
            + (" (and TensorRT)" if provider == "tensorrt" else "")
        )
    return PROVIDERS[provider]


_GLOBAL_POOL: dict = {}


def session_options(threads: int | None = None):
    """SessionOptions on the process-wide shared thread pool (every session of the process must use it).

    Draft and target run alternately, never at once. With a thread pool per session, the idle
    session's workers keep spinning while the other one runs and the two fight over the cores
    (measured on 2 cores: each pass about 35% slower than alone, which erased the speculative
    gain). One shared pool serves whichever session runs. If the onnxruntime environment was
    created before specdec could set the pool up, sessions get their own pools that sleep
    instead of spinning between runs.
    """
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state

    if not _GLOBAL_POOL:
        try:
            _pybind_state.set_global_thread_pool_sizes(threads or 0, 1)  # 0 = one thread per physical core
            _GLOBAL_POOL["ok"] = True
        except Exception:  # the environment already exists (another library made a session first)
            _GLOBAL_POOL["ok"] = False
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if _GLOBAL_POOL["ok"]:
        options.use_per_session_threads = False
    else:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            options.intra_op_num_threads = threads
    return options


def _session(onnx_path: str, providers: list, threads: int | None):
    import onnxruntime as ort

    return ort.InferenceSession(onnx_path, session_options(threads), providers=providers)


class ModelRunner:
    def __init__(self, onnx_path: str, spec: ModelSpec, provider: str, max_context: int, max_step_tokens: int,
                 threads: int | None = None, session=None):
        if spec.kv_dtype not in _NUMPY_KV:
            raise BundleError(f"{spec.role}: KV dtype {spec.kv_dtype} has no numpy buffer on this runtime (use float32/float16)")
        self.spec = spec
        self.provider = provider
        if session is None:
            session = _session(onnx_path, providers_for(provider), threads)
            self.session = session
            self._check_contract()
        self.session = session
        self.max_context = max_context
        self.max_step_tokens = max_step_tokens
        kv_dtype = _NUMPY_KV[spec.kv_dtype]
        self.kv_dtype = np.dtype(kv_dtype)
        # CUDA / TensorRT execution providers keep the cache on the device; only logits come back
        store = DeviceKV if provider in ("cuda", "tensorrt") else HostKV
        self.kv = store(spec.num_layers, max_context, spec.num_kv_heads, spec.head_dim, kv_dtype)
        self.cache = getattr(self.kv, "array", None)  # the host array (HostKV), for inspection
        self.slot_positions = np.zeros(max_context, dtype=np.int64)
        self.length = 0
        self._ids = np.zeros(max_step_tokens, dtype=np.int64)
        self._positions = np.zeros(max_step_tokens, dtype=np.int64)
        self._mask = np.zeros(max_step_tokens * max_context, dtype=bool)
        self._sliding = np.zeros_like(self._mask) if spec.has_sliding_mask else None
        self._logits = np.zeros(max_step_tokens * spec.vocab_size, dtype=np.float32)
        self._binding = self.session.io_binding()
        self.forward_count = 0

    def _check_contract(self) -> None:
        """The graph's inputs and outputs must be exactly the manifest's (names, ranks, element types, sizes)."""
        from .manifest import check_graph

        check_graph(self.spec, self.session.get_inputs(), self.session.get_outputs())

    def reset(self) -> None:
        self.length = 0

    def fork(self) -> "ModelRunner":
        """A runner on the same onnxruntime session (weights loaded once) with its own KV cache,
        buffers and IO binding: one per concurrent request. onnxruntime's ``run`` is thread-safe."""
        return ModelRunner("", self.spec, self.provider, self.max_context, self.max_step_tokens, session=self.session)

    def forward(self, tokens, positions, parents=None, visible_past=None) -> np.ndarray:
        """Run T new tokens after the valid past; returns a view of the logits [T, V] (valid until the next call).

        tokens, positions: [T] ints. parents: [T] tree parents (-1 = the past); None = a chain.
        visible_past: [T, length] bool, which past slots each new token sees (draft trees); None = all.
        New KV rows land in slots [length, length + T); call ``commit`` to keep some of them.
        """
        spec = self.spec
        count = len(tokens)
        past = self.length
        if count > self.max_step_tokens:
            raise ValueError(f"{count} tokens in one pass exceed this runner's {self.max_step_tokens}")
        if past + count > self.max_context:
            raise ValueError(f"context of {past + count} tokens exceeds max_context {self.max_context}")
        ids, pos = self._ids[:count], self._positions[:count]
        ids[:] = tokens
        pos[:] = positions
        total = past + count
        mask = self._mask[: count * total].reshape(count, total)
        sliding = None if self._sliding is None else self._sliding[: count * total].reshape(count, total)
        visible = ancestor_matrix(np.asarray(parents)) if parents is not None else _chain_visibility(count)
        fill_masks(mask, sliding, past, visible, self.slot_positions[:past], pos, spec.sliding_window, visible_past)
        logits = self._logits[: count * spec.vocab_size].reshape(1, count, spec.vocab_size)

        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        _bind(binding.bind_input, "input_ids", ids.reshape(1, count))
        _bind(binding.bind_input, "position_ids", pos.reshape(1, count))
        _bind(binding.bind_input, "attention_mask", mask.reshape(1, count, total))
        if sliding is not None:
            _bind(binding.bind_input, "sliding_attention_mask", sliding.reshape(1, count, total))
        _bind(binding.bind_output, "logits", logits)
        kv, device, dtype = self.kv, self.kv.device_type, self.kv_dtype
        past_shape = [1, past, spec.num_kv_heads, spec.head_dim]
        new_shape = [1, count, spec.num_kv_heads, spec.head_dim]
        for layer, names in enumerate(spec.kv):
            binding.bind_input(names.past_key, device, 0, dtype, past_shape, kv.pointer(layer, 0, 0))
            binding.bind_input(names.past_value, device, 0, dtype, past_shape, kv.pointer(layer, 1, 0))
            binding.bind_output(names.new_key, device, 0, dtype, new_shape, kv.pointer(layer, 0, past))
            binding.bind_output(names.new_value, device, 0, dtype, new_shape, kv.pointer(layer, 1, past))
        self.session.run_with_iobinding(binding)
        self.slot_positions[past:total] = pos
        self.forward_count += 1
        return logits[0]

    def commit(self, count: int) -> None:
        """Keep the first ``count`` rows written by the last forward."""
        self.length += count

    def move_rows(self, sources: np.ndarray, first_slot: int) -> None:
        """Copy slots ``sources`` (ascending) to ``first_slot``, ``first_slot + 1``, ... (tree compaction)."""
        self.kv.move_rows(sources, first_slot)
        for offset, slot in enumerate(sources):
            self.slot_positions[first_slot + offset] = self.slot_positions[slot]


_CHAIN_CACHE: dict = {}


def _chain_visibility(count: int) -> np.ndarray:
    if count not in _CHAIN_CACHE:
        _CHAIN_CACHE[count] = ancestor_matrix(chain_parents(count))
    return _CHAIN_CACHE[count]


def _bind(bind, name: str, array: np.ndarray) -> None:
    """Bind a contiguous numpy view by pointer: onnxruntime reads or writes it in place."""
    assert array.flags.c_contiguous, name
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
