"""One exported model: an onnxruntime session, its preallocated KV cache, and IO binding.

The cache is one array ``[layers, 2 (key, value), batch=1, max_context, kv_heads, head_dim]``
allocated once. Slot j holds the keys/values of one token; ``length`` slots are valid.
A forward pass over T new tokens binds ``cache[l, :, :, :length]`` as the past (read in
place) and ``cache[l, :, :, length:length+T]`` as the output for the new rows, so the
graph writes them straight into the cache: nothing is concatenated or copied on the host.
The bookkeeping (length, slot positions, masks, commit/truncate/keep_path) is the shared
``Runner`` base (runners/runner.py); this module binds and runs.
"""

from __future__ import annotations

import numpy as np

from specdec.runners import mapped_weights
from specdec.runners.backends import backend
from specdec.runners.kv_store import DeviceKV, HostKV
from specdec.contract.manifest import BundleError, ModelSpec, check_graph
from specdec.runners.runner import Runner
from specdec.runners.sessions import SessionHolder, SessionRunner

_NUMPY_KV = {"float32": np.float32, "float16": np.float16}


def providers_for(provider: str) -> list:
    """onnxruntime's execution providers for ``provider`` (runners/backends/), checked against the installed
    onnxruntime: a one-line ValueError for an unknown name, a backend with no onnxruntime session, or a missing
    provider (with what to install)."""
    import onnxruntime as ort

    entry = backend(provider)
    if not entry.providers:
        raise ValueError(f"provider {provider} builds its own runners and makes no onnxruntime session")
    wanted = entry.providers[0]
    wanted = wanted[0] if isinstance(wanted, tuple) else wanted
    if wanted not in ort.get_available_providers():
        raise ValueError(f"provider {provider} requested but onnxruntime has no {wanted}: {_provider_fix(entry)}")
    return list(entry.providers)


def _provider_fix(entry) -> str:
    """What to do about a missing provider. Both onnxruntime wheels write the same ``onnxruntime`` package: with the
    CPU wheel installed beside onnxruntime-gpu (specdec requires onnxruntime, the [gpu] extra adds the other), the
    CPU wheel's files can shadow the GPU one's, and the import has no CUDA provider although onnxruntime-gpu is
    installed."""
    from importlib import metadata

    if not entry.device_memory:
        return entry.missing
    installed = set()
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            metadata.version(name)
            installed.add(name)
        except metadata.PackageNotFoundError:
            pass
    if installed == {"onnxruntime", "onnxruntime-gpu"}:
        return ("both onnxruntime (the CPU wheel) and onnxruntime-gpu are installed and the CPU wheel's files shadow "
                "the GPU one's: pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu "
                "(docs/nvidia.md)")
    return entry.missing


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
        _GLOBAL_POOL["threads"] = threads
    elif _GLOBAL_POOL["ok"] and threads is not None and threads != _GLOBAL_POOL["threads"]:
        # the pool is the process's and is sized once: honouring a new size is impossible, ignoring it silent
        raise ValueError(f"threads={threads}: this process's onnxruntime thread pool was already created with "
                         f"{_GLOBAL_POOL['threads'] or 'one thread per physical core'} threads by the first load; "
                         "load with the same threads (or threads=None), or in a new process")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # No memory pattern: onnxruntime would plan and keep one block per set of input shapes, and every pass has new
    # ones (the cache grows). Measured on the real 1.5B target at 20k cached tokens, 2 threads: 136 MiB less
    # resident after eight 64-token chunks and 30 decode/verify passes, and no slower (21.5-21.8 s against 22.2 s).
    options.enable_mem_pattern = False
    # Weights are prepacked (MatMulNBits', MatMulIntegerToFloat's layouts) by the thread pool, not one thread: the real
    # pair's two sessions and tokenizer loaded in 2.3 s instead of 4.0-4.1 s (2-core Xeon, onnxruntime 1.32); the
    # packed bytes are the same (tests/runners/test_loader.py compares the logits bit for bit)
    options.add_session_config_entry("session.prepack.enable_parallel", "1")
    if _GLOBAL_POOL["ok"]:
        options.use_per_session_threads = False
    else:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            options.intra_op_num_threads = threads
    return options


def _session(onnx_path: str, providers: list, threads: int | None):
    """A session of ``onnx_path``; on the CPU provider over weights specdec maps itself (mapped_weights.py: a load's
    peak memory is the packed weights, not the packed weights and the whole file)."""
    import onnxruntime as ort

    options = session_options(threads)
    if providers != ["CPUExecutionProvider"] or not mapped_weights.enabled():
        return ort.InferenceSession(onnx_path, options, providers=providers)
    weights = mapped_weights.MappedWeights(onnx_path)
    weights.add_to(options)
    return weights.make_session(lambda: ort.InferenceSession(onnx_path, options, providers=providers))


class ModelRunner(SessionRunner, Runner):
    """The standard-form graph on an onnxruntime provider, IO-bound into a preallocated cache."""

    def __init__(self, onnx_path: str, spec: ModelSpec, provider: str, max_context: int, max_step_tokens: int,
                 threads: int | None = None, session=None, kept_ids=None):
        if spec.kv_dtype not in _NUMPY_KV:
            raise BundleError(f"{spec.role}: KV dtype {spec.kv_dtype} has no numpy buffer on this runtime (use float32/float16)")
        self._init_book(spec, max_context, max_step_tokens, kept_ids)
        attach_session(self, onnx_path, provider, threads, session)
        kv_dtype = _NUMPY_KV[spec.kv_dtype]
        self.kv_dtype = np.dtype(kv_dtype)
        # CUDA / TensorRT execution providers keep the cache on the device; only logits come back
        store = DeviceKV if backend(provider).device_memory else HostKV
        self.kv = store(spec.num_layers, max_context, spec.num_kv_heads, spec.head_dim, kv_dtype)
        self.cache = getattr(self.kv, "array", None)  # the host array (HostKV), for inspection
        self._slot_bytes = None if self.cache is None else self.cache.nbytes // max_context
        self._ids = np.zeros(max_step_tokens, dtype=np.int64)
        self._positions = np.zeros(max_step_tokens, dtype=np.int64)
        self._logits = np.zeros(max_step_tokens * self.logits_width, dtype=np.float32)

    def _new_binding(self, session):
        return session.io_binding()  # every pass binds all it reads and writes

    def _fork(self) -> "ModelRunner":
        """A runner on the same onnxruntime session (weights loaded once) with its own KV cache,
        buffers and IO binding: one per concurrent request. onnxruntime's ``run`` is thread-safe."""
        return ModelRunner("", self.spec, self.provider, self.max_context, self.max_step_tokens, session=self.sessions,
                           kept_ids=self.kept_ids)

    def _run(self, ids, positions, mask, sliding, past) -> np.ndarray:
        spec = self.spec
        count = len(ids)
        total = past + count
        self._ids[:count] = ids
        self._positions[:count] = positions
        logits = self._logits[: count * self.logits_width].reshape(1, count, self.logits_width)
        binding = self._live_binding()
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        bind_array(binding.bind_input, "input_ids", self._ids[:count].reshape(1, count))
        bind_array(binding.bind_input, "position_ids", self._positions[:count].reshape(1, count))
        bind_array(binding.bind_input, "attention_mask", mask.reshape(1, count, total))
        if sliding is not None:
            bind_array(binding.bind_input, "sliding_attention_mask", sliding.reshape(1, count, total))
        bind_array(binding.bind_output, "logits", logits)
        kv, device, dtype = self.kv, self.kv.device_type, self.kv_dtype
        past_shape = [1, past, spec.num_kv_heads, spec.head_dim]
        new_shape = [1, count, spec.num_kv_heads, spec.head_dim]
        for layer, names in enumerate(spec.kv):
            binding.bind_input(names.past_key, device, 0, dtype, past_shape, kv.pointer(layer, 0, 0))
            binding.bind_input(names.past_value, device, 0, dtype, past_shape, kv.pointer(layer, 1, 0))
            binding.bind_output(names.new_key, device, 0, dtype, new_shape, kv.pointer(layer, 0, past))
            binding.bind_output(names.new_value, device, 0, dtype, new_shape, kv.pointer(layer, 1, past))
        self.session.run_with_iobinding(binding)
        return logits[0]

    def _move_kv(self, sources, first_slot: int) -> None:
        self.kv.move_rows(sources, first_slot)

    def _kv_rows(self, count: int) -> np.ndarray:
        if self.cache is None:
            raise NotImplementedError("device KV caches are not snapshotted to host memory")
        return self.cache[:, :, :, :count].copy()

    def _set_kv_rows(self, rows: np.ndarray, count: int) -> None:
        if self.cache is None:
            raise NotImplementedError("device KV caches are not restored from host memory")
        self.cache[:, :, :, :count] = rows[:, :, :, :count]


DEFERRED = object()  # a runner's ``session`` argument: make its holder without opening it (SessionHolder defer)


def attach_session(runner, onnx_path: str, provider: str, threads: int | None, session) -> None:
    """Give ``runner`` its onnxruntime session through a ``SessionHolder``: ``session`` when forking (the holder:
    weights loaded once; an open session: one that cannot be closed), else a new holder whose session's
    inputs/outputs are checked against the manifest when it opens (now, or later for ``DEFERRED``)."""
    runner.provider = provider
    runner._binding = None
    if isinstance(session, SessionHolder):
        runner.sessions = session
    elif session is not None and session is not DEFERRED:
        runner.sessions = SessionHolder(None, session, runner.spec.role)
    else:  # DEFERRED: the holder opens when asked (SessionHolder.open_in_background or a first pass)
        spec = runner.spec
        runner.sessions = SessionHolder(lambda: _session(onnx_path, providers_for(provider), threads),
                                        name=spec.role, defer=session is DEFERRED,
                                        check=lambda opened: check_graph(spec, opened.get_inputs(),
                                                                         opened.get_outputs()))
    runner.sessions.attach(runner)


def bind_array(bind, name: str, array: np.ndarray) -> None:
    """Bind a contiguous numpy view by pointer: onnxruntime reads or writes it in place.

    An explicit check, not an ``assert`` (``python -O`` strips those): a strided view bound by pointer
    would be read and written as if it were contiguous, silently corrupting the cache."""
    if not array.flags.c_contiguous:
        raise RuntimeError(f"{name}: refusing to bind a non-contiguous array by pointer")
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
