"""An ONNX graph written as it is built: initializers go to the external-data file the moment they are added.

``GraphWriter`` holds the nodes and, for each initializer, only a ``TensorProto`` that points into
``model.onnx.data`` (offset and length); the array itself is written and dropped at once. A model of any size
is built in the memory of its largest tensor, and ``finish`` writes the small ``model.onnx`` beside the data.
Offsets are aligned to 4 KiB for tensors of 1 MiB and more (onnxruntime memory-maps external data page-aligned).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from specdec.contract.manifest import TensorSpec

ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
ALIGN = 4096
ALIGN_THRESHOLD = 1 << 20
OPSET = 18
_ONNX_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "int32": 6, "int64": 7, "bool": 9, "float16": 10, "bfloat16": 16}


class GraphWriter:
    def __init__(self, folder: Path, name: str = "specdec"):
        import onnx

        self.onnx = onnx
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.graph = onnx.helper.make_graph([], name, [], [])
        self.data = open(self.folder / DATA_NAME, "wb")
        self.offset = 0
        self.names: set = set()
        self.bytes_written = 0
        self._constants: dict = {}

    # ------------------------------------------------------------------ tensors
    def initializer(self, name: str, array: np.ndarray) -> str:
        """Write ``array`` to the data file now; the graph keeps a reference. Returns ``name``."""
        if name in self.names:
            raise ValueError(f"initializer {name} added twice")
        array = np.ascontiguousarray(array)
        tensor = self.onnx.TensorProto()
        tensor.name = name
        tensor.data_type = self.onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        if array.nbytes < 128:  # small constants stay inside the graph
            tensor.raw_data = array.tobytes()
        else:
            if array.nbytes >= ALIGN_THRESHOLD and self.offset % ALIGN:
                pad = ALIGN - self.offset % ALIGN
                self.data.write(b"\0" * pad)
                self.offset += pad
            self.data.write(memoryview(array).cast("B"))
            tensor.data_location = self.onnx.TensorProto.EXTERNAL
            for key, value in (("location", DATA_NAME), ("offset", str(self.offset)), ("length", str(array.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            self.offset += array.nbytes
            self.bytes_written += array.nbytes
        self.graph.initializer.append(tensor)
        self.names.add(name)
        return name

    def constant(self, values, dtype=np.int64) -> str:
        """A small shared constant (shapes, axes, indices), added once per value."""
        array = np.asarray(values, dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.initializer(f"const_{len(self._constants)}", array)
        return self._constants[key]

    # ------------------------------------------------------------------ nodes
    def node(self, op: str, inputs: list, outputs: list | int = 1, name: str | None = None, domain: str = "",
             **attributes) -> list:
        """Add a node; ``outputs``: names, or a count of fresh names. Returns the output names."""
        index = len(self.graph.node)
        base = name or f"{op}_{index}"
        if isinstance(outputs, int):
            outputs = [f"{base}/out{i}" for i in range(outputs)]
        node = self.onnx.helper.make_node(op, list(inputs), list(outputs), name=base, domain=domain or None,
                                          **attributes)
        self.graph.node.append(node)
        return list(outputs)

    def one(self, op: str, inputs: list, name: str | None = None, domain: str = "", **attributes) -> str:
        return self.node(op, inputs, 1, name, domain, **attributes)[0]

    # ------------------------------------------------------------------ the model
    def finish(self, inputs: tuple, outputs: tuple) -> Path:
        """Declare the contract's inputs and outputs (``TensorSpec``s), write model.onnx; returns its path."""
        helper = self.onnx.helper

        def value(spec: TensorSpec):
            dims = [d if isinstance(d, int) else str(d) for d in spec.shape]
            return helper.make_tensor_value_info(spec.name, _ONNX_TYPES[spec.dtype], dims)

        self.graph.input.extend(value(spec) for spec in inputs)
        self.graph.output.extend(value(spec) for spec in outputs)
        self.data.flush()
        os.fsync(self.data.fileno())
        self.data.close()
        model = helper.make_model(self.graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                             helper.make_opsetid("com.microsoft", 1)],
                                  producer_name="specdec")
        model.ir_version = 10
        path = self.folder / ONNX_NAME
        with open(path, "wb") as handle:
            handle.write(model.SerializeToString())
        return path

    def abort(self) -> None:
        if not self.data.closed:
            self.data.close()


class NodeList:
    """``GraphWriter``'s building surface (initializer, constant, node, one) in memory: for the small graphs of
    kernel screens and tests, built into ``onnx.helper.make_graph`` from ``nodes`` and ``initializers``."""

    def __init__(self):
        from onnx import numpy_helper

        self._from_array = numpy_helper.from_array
        self.nodes: list = []
        self.initializers: list = []

    def initializer(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self._from_array(np.ascontiguousarray(array), name))
        return name

    def constant(self, values, dtype=np.int64) -> str:
        return self.initializer(f"const_{len(self.initializers)}", np.asarray(values, dtype))

    def node(self, op: str, inputs: list, outputs: list, name: str | None = None, domain: str = "",
             **attributes) -> list:
        from onnx import helper

        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), name=name or f"{op}_{len(self.nodes)}",
                                           domain=domain or None, **attributes))
        return list(outputs)

    def one(self, op: str, inputs: list, name: str | None = None, domain: str = "", **attributes) -> str:
        name = name or f"{op}_{len(self.nodes)}"
        return self.node(op, inputs, [f"{name}/out"], name, domain, **attributes)[0]
