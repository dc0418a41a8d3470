"""runners/mapped_weights.py: onnxruntime reads the weights from specdec's own mapping, the same bytes, and the pages
it has read are dropped while the session is still being made (a load's peak is the packed weights, not the packed
weights and the whole file).

A model written by ``onnx`` with its tensors in an external-data file (a MatMul over a 6 MiB weight, a Gather over a
4 MiB table): the session over the mapping answers bit for bit as onnxruntime's own loading does; pages read during
``make_session`` are gone before it returns (a planted version that drops them only at the end fails); the arrays
read the file's bytes after every drop; resident.py leaves the mapped file to its owner.
"""

import os
import time

import numpy as np
import pytest

from specdec.contract.onnx_paths import external_tensors
from specdec.runners import mapped_weights
from specdec.runners.mapped_weights import DROP_SECONDS, MappedWeights
from specdec.runners.proc_maps import read_smaps

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")

ROWS, K, N, VOCAB = 3, 1536, 1024, 1024


def _model(folder):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((K, N)).astype(np.float32)
    table = rng.standard_normal((VOCAB, K)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("MatMul", ["rows", "weight"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [ROWS])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [ROWS, N])],
                              [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path, weight, table


def _resident_kb(path) -> int:
    target = str(path.resolve())
    return sum(m.rss_kb for m in read_smaps() if m.path == target)


def test_the_table_of_external_tensors_is_what_onnx_wrote(tmp_path):
    onnx = pytest.importorskip("onnx")
    path, weight, table = _model(tmp_path)
    tensors, gathered = external_tensors(path.read_bytes())
    written = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
    assert {t.name for t in tensors} == {"weight", "table"} and gathered >= {"table"} and "weight" not in gathered
    for tensor in tensors:
        entries = {e.key: e.value for e in written[tensor.name].external_data}
        dims = tuple(written[tensor.name].dims)
        assert (tensor.dims, tensor.data_type, tensor.location) == (dims, 1, "model.onnx.data")
        assert (tensor.offset, tensor.length) == (int(entries.get("offset", 0)), int(entries["length"]))


def test_a_session_over_the_mapping_answers_as_onnxruntimes_own_loading(tmp_path, monkeypatch):
    from specdec.runners import standard

    path, weight, table = _model(tmp_path)
    ids = np.array([5, 700, 1023], dtype=np.int64)
    mapped = standard._session(str(path), ["CPUExecutionProvider"], None)
    assert isinstance(getattr(mapped, "specdec_mapped_weights", None), MappedWeights)
    monkeypatch.setenv("SPECDEC_MAP_WEIGHTS", "0")
    own = standard._session(str(path), ["CPUExecutionProvider"], None)
    assert not hasattr(own, "specdec_mapped_weights")
    got, expected = mapped.run(None, {"ids": ids})[0], own.run(None, {"ids": ids})[0]
    assert np.array_equal(got, expected)
    np.testing.assert_allclose(got, table[ids] @ weight, rtol=1e-4, atol=1e-3)


def _read_everything_then_wait(weights, path, seen):
    def make():
        for array in weights.arrays.values():
            float(np.asarray(array).sum())  # every page read, as packing does
        seen["after_read"] = _resident_kb(path)
        time.sleep(DROP_SECONDS * 10)
        seen["while_making"] = _resident_kb(path)
        return type("Session", (), {})()
    return make


def test_pages_read_while_the_session_is_made_are_dropped_before_it_is_made_and_read_the_same(tmp_path, monkeypatch):
    path, weight, table = _model(tmp_path)
    data = tmp_path / "model.onnx.data"
    weights = MappedWeights(path)
    seen: dict = {}
    session = weights.make_session(_read_everything_then_wait(weights, data, seen))
    if weights.drop_pages() == 0:
        pytest.skip("no madvise here")
    assert seen["after_read"] * 1024 >= (weight.nbytes + table.nbytes) // 2
    assert seen["while_making"] * 1024 < weight.nbytes // 4  # dropped by the thread, not only at the end
    assert _resident_kb(data) * 1024 < weight.nbytes // 4
    assert session.specdec_mapped_weights is weights
    assert np.array_equal(weights.arrays["weight"], weight) and np.array_equal(weights.arrays["table"], table)

    # planted: a version that drops pages only once the session is made leaves them resident while it is made
    planted, seen_planted = MappedWeights(path), {}
    monkeypatch.setattr(mapped_weights, "DROP_SECONDS", 3600.0)
    planted.make_session(_read_everything_then_wait(planted, data, seen_planted))
    assert not seen_planted["while_making"] * 1024 < weight.nbytes // 4


def test_resident_leaves_the_files_specdec_maps_to_their_owner(tmp_path):
    from specdec.runners.resident import _bundle_mappings

    path, _, _ = _model(tmp_path)
    weights = MappedWeights(path)
    float(np.asarray(weights.arrays["weight"]).sum())
    found = _bundle_mappings(tmp_path)
    if found is None:
        pytest.skip("no madvise here")
    assert not [m for m in found[1] if m.path.endswith("model.onnx.data")]
    dropped, tables = mapped_weights.release_mapped(tmp_path)
    assert dropped >= 1 and tables == 1  # the Gather's table reads single pages; the MatMul's weight does not
    assert _resident_kb(tmp_path / "model.onnx.data") * 1024 < 2**20
