"""List the external-data files an ONNX model refers to, without the ``onnx`` package.

A tampered ``model.onnx`` could point its weights at any file (an absolute path, ``..``,
a symlink). The runtime reads the locations straight from the protobuf wire format and
checks them before onnxruntime opens anything. Only the messages that can hold tensors
are walked: ModelProto.graph -> GraphProto.{initializer, sparse_initializer, node} ->
NodeProto.attribute -> AttributeProto.{t, tensors, g, graphs}.
"""

from __future__ import annotations

# field numbers from onnx.proto
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
_NODE_ATTRIBUTE = 5
_ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE_TENSOR, _ATTR_SPARSE_TENSORS = 5, 6, 10, 11, 22, 23
_TENSOR_EXTERNAL_DATA = 13
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_ENTRY_KEY, _ENTRY_VALUE = 1, 2


class ProtobufError(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtobufError("varint too long")


def _fields(data: bytes):
    """Yield (field number, value) for length-delimited fields; other wire types are skipped."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ProtobufError("truncated field")
            yield field, data[pos : pos + length]
            pos += length
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ProtobufError("truncated message")


def _tensor_locations(tensor: bytes, found: set) -> None:
    for field, value in _fields(tensor):
        if field == _TENSOR_EXTERNAL_DATA:
            entry = dict(_fields(value))
            if entry.get(_ENTRY_KEY) == b"location":
                found.add(entry.get(_ENTRY_VALUE, b"").decode("utf-8", "replace"))


def _sparse_locations(sparse: bytes, found: set) -> None:
    for field, value in _fields(sparse):
        if field in (_SPARSE_VALUES, _SPARSE_INDICES):
            _tensor_locations(value, found)


def _graph_locations(graph: bytes, found: set) -> None:
    for field, value in _fields(graph):
        if field == _GRAPH_INITIALIZER:
            _tensor_locations(value, found)
        elif field == _GRAPH_SPARSE_INITIALIZER:
            _sparse_locations(value, found)
        elif field == _GRAPH_NODE:
            for node_field, attribute in _fields(value):
                if node_field != _NODE_ATTRIBUTE:
                    continue
                for attr_field, item in _fields(attribute):
                    if attr_field in (_ATTR_T, _ATTR_TENSORS):
                        _tensor_locations(item, found)
                    elif attr_field in (_ATTR_SPARSE_TENSOR, _ATTR_SPARSE_TENSORS):
                        _sparse_locations(item, found)
                    elif attr_field in (_ATTR_G, _ATTR_GRAPHS):
                        _graph_locations(item, found)


def external_data_locations(model: bytes) -> set:
    """The ``location`` of every external-data tensor in a serialized ModelProto."""
    found: set = set()
    for field, value in _fields(model):
        if field == _MODEL_GRAPH:
            _graph_locations(value, found)
    return found
