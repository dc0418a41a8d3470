"""Test doubles for the two native NVIDIA modules specdec imports: cuda-python's ``cudart`` and ``tensorrt``.

Scope: exactly the calls specdec makes (runners/cuda_memory.py, runners/kv_store.py,
runners/tensorrt/build.py, runners/tensorrt/runner.py), so the REAL runner, device cache and
engine builder run on a CPU. What a GPU and TensorRT would enforce is checked here and raised as
``ContractViolation``:
  device memory    every copy and every bound tensor lies inside one live allocation; copies
                   name the right direction (a host pointer is never passed as a device one);
                   device-to-device ranges do not overlap; fresh allocations hold garbage (0xFF)
  streams          every copy and execution is on a stream that was created (logged, so tests can
                   check that one runner uses one stream)
  building         strongly typed network, a graph TensorRT's parser can read (standard ONNX
                   domain only), each profile covers every graph input with min <= opt <= max and
                   the graph's static dims, and the graph runs at every profile corner (TensorRT
                   refuses profiles whose corners violate the graph's shape constraints)
  execution        one profile per live context; every input has a shape within the context's
                   profile and an address; outputs are exactly the graph's output shapes and
                   overlap neither each other nor any input
Device memory is host memory (numpy byte arrays kept alive here, keyed by address). A "plan" is
JSON naming the ONNX graph and the profiles set at build time; an engine runs it with onnxruntime
on the CPU, reading inputs from and writing outputs to the bound addresses.
Boundary: nothing here says a real TensorRT parses or builds the graph, that CUDA kernels compute
the same numbers, or how device memory behaves under real asynchrony.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import sys
import types
from dataclasses import dataclass, field

import numpy as np

TENSORRT_VERSION = "10.3.0"
COMPUTE_CAPABILITY = (8, 7)
_PLAN_MAGIC = "specdec-fake-tensorrt-plan"
_ONNX_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
               "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


class ContractViolation(AssertionError):
    """What a real GPU or TensorRT would refuse (or silently get wrong)."""


# ----------------------------------------------------------------------------------------------- cudart
class cudaError_t(enum.IntEnum):
    cudaSuccess = 0


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


@dataclass
class Copy:
    kind: str  # "H2D" | "D2H" | "D2D"
    dst: int
    src: int
    nbytes: int
    stream: int


class FakeCudart:
    """cuda-python's runtime module: functions return ``(err, value...)`` tuples as cuda-python does."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind

    def __init__(self, free: int = 8 << 30, total: int = 16 << 30):
        self.allocations: dict[int, np.ndarray] = {}  # base address -> the bytes behind it (kept alive)
        self.streams: set[int] = set()
        self.copies: list[Copy] = []
        self.free_bytes, self.total_bytes = free, total
        self._handles = itertools.count(0x5000)

    # -- memory
    def cudaMalloc(self, nbytes: int):
        block = np.full(int(nbytes), 0xFF, dtype=np.uint8)  # garbage, as cudaMalloc gives: reads before writes show
        self.allocations[block.ctypes.data] = block
        return cudaError_t.cudaSuccess, block.ctypes.data

    def cudaFree(self, ptr: int):
        if self.allocations.pop(int(ptr), None) is None:
            raise ContractViolation(f"cudaFree of {ptr:#x}, which is not a live allocation")
        return (cudaError_t.cudaSuccess,)

    def device_range(self, ptr: int, nbytes: int, what: str) -> None:
        """Raise unless [ptr, ptr + nbytes) lies inside one live allocation."""
        if self.allocation_of(ptr, nbytes) is None:
            raise ContractViolation(f"{what}: [{ptr:#x}, +{nbytes}) is not inside one live device allocation")

    def allocation_of(self, ptr: int, nbytes: int = 0):
        for base, block in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + block.size and ptr < base + max(block.size, 1):
                return base
        return None

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        dst, src, nbytes, stream = int(dst), int(src), int(nbytes), int(stream)
        self._stream(stream, "cudaMemcpyAsync")
        kind = cudaMemcpyKind(kind)
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
            self.device_range(dst, nbytes, "host-to-device destination")
            self._host(src, "host-to-device source")
            label = "H2D"
        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToHost:
            self.device_range(src, nbytes, "device-to-host source")
            self._host(dst, "device-to-host destination")
            label = "D2H"
        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToDevice:
            self.device_range(dst, nbytes, "device-to-device destination")
            self.device_range(src, nbytes, "device-to-device source")
            if src < dst + nbytes and dst < src + nbytes and nbytes:
                raise ContractViolation(f"device-to-device copy of {nbytes} bytes between overlapping ranges")
            label = "D2D"
        else:
            raise ContractViolation(f"specdec never copies host to host through CUDA ({kind!r})")
        ctypes.memmove(dst, src, nbytes)  # stream order = call order: one stream, executed at once
        self.copies.append(Copy(label, dst, src, nbytes, stream))
        return (cudaError_t.cudaSuccess,)

    def _host(self, ptr: int, what: str) -> None:
        if self.allocation_of(ptr) is not None:
            raise ContractViolation(f"{what} {ptr:#x} is device memory")

    # -- streams and device
    def cudaStreamCreate(self):
        handle = next(self._handles)
        self.streams.add(handle)
        return cudaError_t.cudaSuccess, handle

    def cudaStreamSynchronize(self, stream):
        self._stream(int(stream), "cudaStreamSynchronize")
        return (cudaError_t.cudaSuccess,)

    def _stream(self, stream: int, what: str) -> None:
        if stream != 0 and stream not in self.streams:
            raise ContractViolation(f"{what} on stream {stream:#x}, which was never created")

    def cudaMemGetInfo(self):
        return cudaError_t.cudaSuccess, self.free_bytes, self.total_bytes

    def cudaGetDeviceProperties(self, device: int):
        if device != 0:
            return cudaError_t(0), None
        major, minor = COMPUTE_CAPABILITY
        return cudaError_t.cudaSuccess, types.SimpleNamespace(major=major, minor=minor, name="fake GPU")


# --------------------------------------------------------------------------------------------- tensorrt
def _graph_io(onnx_path: str):
    """(session, {input: (dtype, dims)}, {output: (dtype, dims)}) of an ONNX graph, via onnxruntime."""
    import onnxruntime as ort

    from specdec.runners.standard import session_options  # the process-wide thread pool the runtime set up

    session = ort.InferenceSession(onnx_path, session_options(), providers=["CPUExecutionProvider"])
    inputs = {t.name: (np.dtype(_ONNX_TYPES[t.type]), tuple(t.shape)) for t in session.get_inputs()}
    outputs = {t.name: (np.dtype(_ONNX_TYPES[t.type]), tuple(t.shape)) for t in session.get_outputs()}
    return session, inputs, outputs


def _fits(shape, low, high) -> bool:
    return len(shape) == len(low) and all(lo <= s <= hi for s, lo, hi in zip(shape, low, high))


def _corner_feeds(inputs: dict, shapes: dict) -> dict:
    feeds = {}
    for name, (dtype, _) in inputs.items():
        feeds[name] = (np.ones if dtype == np.bool_ else np.zeros)(shapes[name], dtype=dtype)
    return feeds


class Logger:
    VERBOSE, INFO, WARNING, ERROR, INTERNAL_ERROR = 4, 3, 2, 1, 0

    def __init__(self, severity: int = 2):
        self.severity = severity


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 5


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class _Network:
    def __init__(self, flags: int):
        self.flags = flags
        self.onnx_path = None


class OnnxParser:
    def __init__(self, network: _Network, logger: Logger):
        self.network = network
        self.errors: list[str] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]

    def parse_from_file(self, path: str) -> bool:
        import onnx

        try:
            model = onnx.load(path, load_external_data=False)
        except Exception as exc:  # what TensorRT reports: a parse failure, not an exception
            self.errors.append(f"not an ONNX model: {exc}")
            return False
        foreign = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in ("", "ai.onnx")})
        if foreign:
            self.errors.append(f"no importer for {', '.join(foreign)}")
            return False
        self.network.onnx_path = str(path)
        return True


class _OptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name: str, low, opt, high) -> None:
        low, opt, high = tuple(map(int, low)), tuple(map(int, opt)), tuple(map(int, high))
        if not (len(low) == len(opt) == len(high) and all(a <= b <= c for a, b, c in zip(low, opt, high))):
            raise ContractViolation(f"profile shape of {name} needs min <= opt <= max, got {low} {opt} {high}")
        self.shapes[name] = (low, opt, high)


class _BuilderConfig:
    def __init__(self):
        self.profiles: list[_OptimizationProfile] = []
        self.pools: dict = {}

    def set_memory_pool_limit(self, pool, nbytes: int) -> None:
        self.pools[MemoryPoolType(pool)] = int(nbytes)

    def add_optimization_profile(self, profile: _OptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Logger):
        self.logger = logger

    def create_network(self, flags: int = 0) -> _Network:
        return _Network(int(flags))

    def create_builder_config(self) -> _BuilderConfig:
        return _BuilderConfig()

    def create_optimization_profile(self) -> _OptimizationProfile:
        return _OptimizationProfile()

    def build_serialized_network(self, network: _Network, config: _BuilderConfig) -> bytes:
        if not network.flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED):
            raise ContractViolation("specdec builds strongly typed networks (precision from the ONNX types)")
        if network.onnx_path is None:
            raise ContractViolation("build_serialized_network on a network no parser filled")
        if not config.profiles:
            raise ContractViolation("a graph with dynamic shapes needs at least one optimization profile")
        session, inputs, _ = _graph_io(network.onnx_path)
        for index, profile in enumerate(config.profiles):
            if set(profile.shapes) != set(inputs):
                raise ContractViolation(f"profile {index} sets {sorted(profile.shapes)}, the graph's inputs are {sorted(inputs)}")
            for name, (_, dims) in inputs.items():
                for shape in profile.shapes[name]:
                    if len(shape) != len(dims) or any(isinstance(d, int) and d != s for d, s in zip(dims, shape)):
                        raise ContractViolation(f"profile {index}: {name} shape {shape} does not fit the graph's {dims}")
            for corner, label in enumerate(("min", "opt", "max")):
                shapes = {name: triple[corner] for name, triple in profile.shapes.items()}
                try:
                    session.run(None, _corner_feeds(inputs, shapes))
                except Exception as exc:
                    raise ContractViolation(f"profile {index} {label} shapes violate the graph's shape constraints: "
                                            f"{str(exc).splitlines()[0]}") from None
        plan = {"magic": _PLAN_MAGIC, "tensorrt_version": TENSORRT_VERSION, "onnx": network.onnx_path,
                "profiles": [{name: [list(s) for s in triple] for name, triple in p.shapes.items()}
                             for p in config.profiles]}
        return json.dumps(plan).encode()


class Runtime:
    def __init__(self, logger: Logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes):
        """An engine, or None (TensorRT's answer to a plan it cannot load: other version, garbage)."""
        try:
            plan = json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError):
            return None
        if plan.get("magic") != _PLAN_MAGIC or plan.get("tensorrt_version") != TENSORRT_VERSION:
            return None
        return FakeEngine(plan)


@dataclass
class Execution:
    """One ``execute_async_v3``: what was bound, for tests to inspect."""

    profile: int
    shapes: dict  # input name -> shape
    addresses: dict  # tensor name -> address
    output_shapes: dict = field(default_factory=dict)
    stream: int = 0


class FakeEngine:
    def __init__(self, plan: dict):
        self.onnx_path = plan["onnx"]
        self.profiles = [{name: tuple(tuple(s) for s in triple) for name, triple in p.items()} for p in plan["profiles"]]
        self.session, self.inputs, self.outputs = _graph_io(self.onnx_path)
        self.cudart = _cudart()  # the device this engine was deserialized on
        self.contexts: list[FakeContext] = []
        self.executions: list[Execution] = []

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_execution_context(self) -> "FakeContext":
        context = FakeContext(self)
        self.contexts.append(context)
        return context


def _cudart() -> FakeCudart:
    return sys.modules["cuda.bindings.runtime"]


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.profile: int | None = None
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, index: int, stream) -> bool:
        self.engine.cudart._stream(int(stream), "set_optimization_profile_async")
        if not 0 <= index < self.engine.num_optimization_profiles:
            raise ContractViolation(f"profile {index} does not exist ({self.engine.num_optimization_profiles} profiles)")
        if any(other is not self and other.profile == index for other in self.engine.contexts):
            raise ContractViolation(f"profile {index} has been chosen by another execution context")
        self.profile = index
        self.shapes.clear()
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        if name not in self.engine.inputs:
            raise ContractViolation(f"set_input_shape: {name} is not an input of the engine")
        if self.profile is None:
            raise ContractViolation("set_input_shape before an optimization profile was chosen")
        shape = tuple(int(s) for s in shape)
        low, _, high = self.engine.profiles[self.profile][name]
        if not _fits(shape, low, high):
            raise ContractViolation(f"{name} shape {shape} is outside profile {self.profile} "
                                    f"(min {low}, max {high})")
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.inputs and name not in self.engine.outputs:
            raise ContractViolation(f"set_tensor_address: {name} is not a tensor of the engine")
        if self.engine.cudart.allocation_of(int(address)) is None:
            raise ContractViolation(f"{name} bound to {int(address):#x}, which is not device memory")
        self.addresses[name] = int(address)
        return True

    def execute_async_v3(self, stream) -> bool:
        cudart, engine = self.engine.cudart, self.engine
        stream = int(stream)
        if stream not in cudart.streams:
            raise ContractViolation("execute_async_v3 on a stream that was never created")
        missing = [n for n in engine.inputs if n not in self.shapes] + [
            n for n in [*engine.inputs, *engine.outputs] if n not in self.addresses]
        if missing:
            raise ContractViolation(f"execute_async_v3 with unset shapes or addresses: {missing}")
        feeds, spans = {}, []
        for name, (dtype, _) in engine.inputs.items():
            shape = self.shapes[name]
            nbytes = int(np.prod(shape)) * dtype.itemsize
            cudart.device_range(self.addresses[name], nbytes, f"input {name}")
            raw = (ctypes.c_uint8 * nbytes).from_address(self.addresses[name])
            feeds[name] = np.frombuffer(bytes(raw), dtype=dtype).reshape(shape)
            spans.append((name, self.addresses[name], nbytes))
        results = engine.session.run(list(engine.outputs), feeds)
        record = Execution(self.profile, dict(self.shapes), dict(self.addresses), stream=stream)
        for name, value in zip(engine.outputs, results):
            value = np.ascontiguousarray(value, dtype=engine.outputs[name][0])
            address = self.addresses[name]
            cudart.device_range(address, value.nbytes, f"output {name} of shape {value.shape}")
            for other, start, nbytes in spans:
                if address < start + nbytes and start < address + value.nbytes:
                    raise ContractViolation(f"output {name} overlaps {other}")
            spans.append((name, address, value.nbytes))
            record.output_shapes[name] = value.shape
        for name, value in zip(engine.outputs, results):
            value = np.ascontiguousarray(value, dtype=engine.outputs[name][0])
            ctypes.memmove(self.addresses[name], value.ctypes.data, value.nbytes)
        engine.executions.append(record)
        return True


def tensorrt_module() -> types.ModuleType:
    module = types.ModuleType("tensorrt")
    module.__version__ = TENSORRT_VERSION
    for item in (Logger, Runtime, Builder, OnnxParser, NetworkDefinitionCreationFlag, MemoryPoolType):
        setattr(module, item.__name__, item)
    return module


def install(monkeypatch) -> FakeCudart:
    """Put the fakes where specdec imports them from (``cuda.bindings.runtime``, ``tensorrt``); returns the cudart."""
    cudart = FakeCudart()
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda.bindings, bindings.runtime = bindings, cudart
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cudart)
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt_module())
    return cudart
