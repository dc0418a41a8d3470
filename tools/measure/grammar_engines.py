"""Mask time per token: llguidance vs xgrammar, the same JSON schema and token sequence on a bundle's tokenizer.

usage: python tools/measure/grammar_engines.py BUNDLE   (xgrammar optional: it needs torch; put it on sys.path to compare)

Times the engine's tokenizer setup, the schema's compilation and one token mask per position of a fixed JSON
answer (3 passes), each engine with the same separators (", " and ": ", no free whitespace).
"""
import json, time, sys
import numpy as np
B = sys.argv[1]
from tokenizers import Tokenizer
s = open(B + "/tokenizer/tokenizer.json").read()
hf = Tokenizer.from_str(s)
V = 151936
schema = {"type": "object", "properties": {"name": {"type": "string"}, "language": {"type": "string"},
          "license": {"type": "string"}, "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
          "year": {"type": "integer"}}, "required": ["name", "language", "license", "keywords", "year"],
          "additionalProperties": False}
text = '{"name": "numpy", "language": "Python", "license": "BSD-3-Clause", "keywords": ["array", "math", "science", "linear algebra"], "year": 2006}'
ids = hf.encode(text, add_special_tokens=False).ids
out = {}
import llguidance as llg, llguidance.numpy as lnp
t = time.perf_counter(); tok = llg.LLTokenizer(s, n_vocab=V, eos_token=[151645]); tok_s = time.perf_counter() - t
opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
t = time.perf_counter(); g = llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts); m = llg.LLMatcher(tok, g); comp = time.perf_counter() - t
bm = lnp.allocate_token_bitmask(1, V); times = []
for reps in range(3):
    m.reset()
    for i in ids:
        t = time.perf_counter(); lnp.fill_next_token_bitmask(m, bm); times.append(time.perf_counter() - t)
        assert m.consume_token(i), m.get_error()
out["llguidance"] = (tok_s, comp, times)
try:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=B + "/tokenizer/tokenizer.json"), vocab_size=V, stop_token_ids=[151645])
    compiler = xgr.GrammarCompiler(info); tok_s = time.perf_counter() - t
    t = time.perf_counter(); cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": ")); comp = time.perf_counter() - t
    matcher = xgr.GrammarMatcher(cg); mask = xgr.allocate_token_bitmask(1, V); times = []
    for reps in range(3):
        matcher.reset()
        for i in ids:
            t = time.perf_counter(); matcher.fill_next_token_bitmask(mask); times.append(time.perf_counter() - t)
            assert matcher.accept_token(i), i
    out["xgrammar"] = (tok_s, comp, times)
except Exception as exc:
    print("xgrammar failed:", type(exc).__name__, exc)
print(f"{len(ids)} tokens x 3 passes")
print("| engine | tokenizer setup | schema compile | mask median | mask p90 | mask max |")
print("|---|---:|---:|---:|---:|---:|")
for name, (tok_s, comp, times) in out.items():
    q = np.percentile(np.array(times) * 1e3, [50, 90, 100])
    print(f"| {name} | {tok_s:.2f} s | {comp * 1e3:.1f} ms | {q[0]:.3f} ms | {q[1]:.3f} ms | {q[2]:.2f} ms |")
