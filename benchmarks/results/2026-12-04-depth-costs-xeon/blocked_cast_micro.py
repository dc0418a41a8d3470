"""Screening: the scores product over a float16 cache as Cast + Gemm, as Gemm over float32 rows, and as a Scan over
blocks of cache rows (Cast + Gemm per block), 56 heads of separate rows per measurement (a 1.5B target pass).
Run: python blocked_cast_micro.py (2 threads)."""
import time, numpy as np, onnx, onnxruntime as ort
from onnx import helper as h, TensorProto as TP
D, GT = 128, 6
def sess(model):
    so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.enable_mem_pattern = False
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
def graph_cast(R):
    n = [h.make_node("Cast", ["k"], ["kf"], to=TP.FLOAT), h.make_node("Gemm", ["q", "kf"], ["s"], transB=1)]
    g = h.make_graph(n, "a", [h.make_tensor_value_info("q", TP.FLOAT, [GT, D]), h.make_tensor_value_info("k", TP.FLOAT16, [R, D])],
                     [h.make_tensor_value_info("s", TP.FLOAT, [GT, R])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
def graph_f32(R):
    n = [h.make_node("Gemm", ["q", "k"], ["s"], transB=1)]
    g = h.make_graph(n, "c", [h.make_tensor_value_info("q", TP.FLOAT, [GT, D]), h.make_tensor_value_info("k", TP.FLOAT, [R, D])],
                     [h.make_tensor_value_info("s", TP.FLOAT, [GT, R])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
def graph_scan(R, blk):
    nb = R // blk
    body = h.make_graph([h.make_node("Cast", ["kb"], ["kbf"], to=TP.FLOAT), h.make_node("Gemm", ["qs", "kbf"], ["sb"], transB=1),
                         h.make_node("Identity", ["qs"], ["qs_out"])], "body",
                        [h.make_tensor_value_info("qs", TP.FLOAT, [GT, D]), h.make_tensor_value_info("kb", TP.FLOAT16, [blk, D])],
                        [h.make_tensor_value_info("qs_out", TP.FLOAT, [GT, D]), h.make_tensor_value_info("sb", TP.FLOAT, [GT, blk])])
    shape = h.make_tensor("shape", TP.INT64, [3], [nb, blk, D])
    n = [h.make_node("Reshape", ["k", "shape"], ["kr"]),
         h.make_node("Scan", ["q", "kr"], ["qfinal", "sr"], num_scan_inputs=1, body=body),
         h.make_node("Transpose", ["sr"], ["st"], perm=[1, 0, 2]),
         h.make_node("Reshape", ["st", "oshape"], ["s"])]
    oshape = h.make_tensor("oshape", TP.INT64, [2], [GT, R])
    g = h.make_graph(n, "b", [h.make_tensor_value_info("q", TP.FLOAT, [GT, D]), h.make_tensor_value_info("k", TP.FLOAT16, [R, D])],
                     [h.make_tensor_value_info("s", TP.FLOAT, [GT, R])], initializer=[shape, oshape])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
rng = np.random.default_rng(0)
for R in (512, 8192, 32768):
    q = rng.standard_normal((GT, D)).astype(np.float32)
    # many heads' worth of separate caches so the data is not cache-resident: 56 buffers (28 layers x 2 heads)
    ks16 = [rng.standard_normal((R, D)).astype(np.float16) for _ in range(56)]
    ks32 = [k.astype(np.float32) for k in ks16]
    arms = {"cast+gemm": (sess(graph_cast(R)), ks16), "f32 gemm": (sess(graph_f32(R)), ks32)}
    for blk in (1024, 4096):
        if R % blk == 0 and R > blk: arms[f"scan {blk}"] = (sess(graph_scan(R, blk)), ks16)
    res = {a: [] for a in arms}
    ref = arms["f32 gemm"][0].run(None, {"q": q, "k": ks32[0]})[0]
    for a, (s, ks) in arms.items():
        assert np.allclose(s.run(None, {"q": q, "k": ks[0]})[0], ref, atol=1e-3), a
    for rep in range(7):
        for a in rng.permutation(list(arms)):
            s, ks = arms[a]; t = time.perf_counter()
            for k in ks: s.run(None, {"q": q, "k": k})
            res[a].append((time.perf_counter() - t) * 1000)
    print(R, {a: round(float(np.median(v)), 2) for a, v in res.items()}, "ms per 56 heads", flush=True)
