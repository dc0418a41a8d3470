"""List the external-data files an ONNX model refers to, without the ``onnx`` package.

A tampered ``model.onnx`` could point its weights at any file (an absolute path, ``..``,
a symlink). The runtime reads the locations straight from the protobuf wire format and
checks them before onnxruntime opens anything. Only the messages that can hold tensors
are walked: ModelProto.graph -> GraphProto.{initializer, sparse_initializer, node} ->
NodeProto.attribute -> AttributeProto.{t, tensors, g, graphs}.

``external_tensors`` reads where each of the top graph's external initializers lies (name, type, shape, file,
offset, length), for ``runners/mapped_weights.py`` to map the weights itself.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    for field, wire, value in _scalars(data):
        if wire == 2:
            yield field, value


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


# ---------------------------------------------------------------- the top graph's external tensors, for mapping
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW_DATA, _TENSOR_DATA_LOCATION = 1, 2, 8, 9, 14
_NODE_INPUT, _NODE_OP_TYPE = 1, 4
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


@dataclass(frozen=True)
class ExternalTensor:
    """One initializer of the top graph held in an external-data file: where its bytes are and how to read them."""

    name: str
    data_type: int  # TensorProto.DataType
    dims: tuple
    location: str  # relative to the model's folder (checked by contract/bundle.py before any load)
    offset: int
    length: int


def _scalars(data: bytes):
    """Yield (field number, wire type, value) of every field: an int for varints, bytes for length-delimited."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ProtobufError("truncated field")
            value, pos = data[pos : pos + length], pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ProtobufError("truncated message")
        yield field, wire, value


def _packed_varints(data: bytes) -> list:
    values, pos = [], 0
    while pos < len(data):
        value, pos = _varint(data, pos)
        values.append(value)
    return values


@dataclass(frozen=True)
class _TensorHeader:
    """A TensorProto's fields but its data: what the readers below need."""

    name: str
    data_type: int
    dims: tuple
    location: int  # TensorProto.DataLocation
    external: dict  # external_data's key -> value
    raw_length: int | None  # bytes of raw_data, when the tensor holds them


def _header(tensor: bytes) -> _TensorHeader:
    dims, data_type, name, location, entries, raw = [], 0, "", 0, {}, None
    for field, wire, value in _scalars(tensor):
        if field == _TENSOR_DIMS:
            dims += _packed_varints(value) if wire == 2 else [value]
        elif field == _TENSOR_DATA_TYPE and wire == 0:
            data_type = value
        elif field == _TENSOR_NAME and wire == 2:
            name = value.decode("utf-8")
        elif field == _TENSOR_DATA_LOCATION and wire == 0:
            location = value
        elif field == _TENSOR_RAW_DATA and wire == 2:
            raw = len(value)
        elif field == _TENSOR_EXTERNAL_DATA and wire == 2:
            entry = dict(_fields(value))
            entries[entry.get(_ENTRY_KEY, b"").decode("utf-8", "replace")] = entry.get(_ENTRY_VALUE, b"").decode(
                "utf-8", "replace")
    return _TensorHeader(name, data_type, tuple(dims), location, entries, raw)


def _external_tensor(tensor: bytes) -> ExternalTensor | None:
    return _external_of(_header(tensor))


def _external_of(head: _TensorHeader) -> ExternalTensor | None:
    entries = head.external
    if head.location != _EXTERNAL or "location" not in entries or "length" not in entries:
        return None
    try:
        return ExternalTensor(head.name, head.data_type, head.dims, entries["location"],
                              int(entries.get("offset", "0")), int(entries["length"]))
    except ValueError:
        raise ProtobufError(f"initializer {head.name}: offset/length are not integers") from None


def external_tensors(model: bytes) -> tuple[list, set]:
    """(the top graph's external-data initializers as ``ExternalTensor`` records, the names of initializers a
    Gather or GatherBlockQuantized node reads rows of) from a serialized ModelProto."""
    tensors, gathered = [], set()
    for field, value in _fields(model):
        if field != _MODEL_GRAPH:
            continue
        for graph_field, item in _fields(value):
            if graph_field == _GRAPH_INITIALIZER:
                tensor = _external_tensor(item)
                if tensor is not None:
                    tensors.append(tensor)
            elif graph_field == _GRAPH_NODE:
                parts = list(_fields(item))
                op_type = next((v for f, v in parts if f == _NODE_OP_TYPE), b"")
                if op_type in (b"Gather", b"GatherBlockQuantized"):
                    gathered.update(v.decode("utf-8") for f, v in parts if f == _NODE_INPUT)
    return tensors, gathered


# ---------------------------------------------------------------- the weight bytes a one-token pass reads
MLAS_BLOCK_EXTRA = 8  # bytes MLAS packs beside each MatMulNBits block (accuracy level 4): float32 scale, block sum


def one_token_bytes(model: bytes) -> dict:
    """Bytes of weights one pass of a serialized ModelProto reads whole, as onnxruntime's CPU kernels hold them once
    packed: ``{"streamed": ..., "gathered": ...}``. MatMulNBits (B ``[N, blocks, block * bits / 8]``) packs per block
    the codes and ``MLAS_BLOCK_EXTRA`` bytes (MLAS' int8-compute layout; zero points fold into the block sum); every
    other initializer of the top graph counts its stored bytes; the tables a Gather or GatherBlockQuantized reads
    rows of are ``gathered`` (a token reads one row)."""
    sizes, dims, nbits, gathered_names = {}, {}, [], set()
    for field, value in _fields(model):
        if field != _MODEL_GRAPH:
            continue
        for graph_field, item in _fields(value):
            if graph_field == _GRAPH_INITIALIZER:
                name, size, shape = _stored_tensor(item)
                sizes[name], dims[name] = size, shape
            elif graph_field == _GRAPH_NODE:
                parts = list(_fields(item))
                op_type = next((v for f, v in parts if f == _NODE_OP_TYPE), b"")
                inputs = [v.decode("utf-8") for f, v in parts if f == _NODE_INPUT]
                if op_type == b"MatMulNBits":
                    nbits.append(inputs)
                elif op_type in (b"Gather", b"GatherBlockQuantized"):
                    gathered_names.update(inputs)
    streamed, counted = 0, set()
    for inputs in nbits:
        weights = dims.get(inputs[1]) if len(inputs) > 1 else None
        if weights is None or len(weights) != 3:
            continue  # a weight computed in the graph: not a stored one
        rows, blocks, blob = weights
        streamed += rows * blocks * (blob + MLAS_BLOCK_EXTRA)
        counted.update(name for name in inputs[1:] if name in sizes)
    gathered = sum(sizes[name] for name in gathered_names if name in sizes and name not in counted)
    counted |= gathered_names
    streamed += sum(size for name, size in sizes.items() if name not in counted)
    return {"streamed": streamed, "gathered": gathered}


_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}  # TensorProto types


def _stored_tensor(tensor: bytes) -> tuple[str, int, tuple]:
    """(name, stored bytes, dims) of a TensorProto: external data's length, else raw data's, else dims x item size."""
    head = _header(tensor)
    external = _external_of(head)
    count = 1
    for dim in head.dims:
        count *= dim
    size = (external.length if external is not None else head.raw_length if head.raw_length is not None
            else count * _ITEM_BYTES.get(head.data_type, 4))
    return head.name, size, head.dims
