"""A short chat, an 8k agent turn at max_context 8,192 (too long for the draft to pay: its session closes), the short
chat again (the draft's session opens again): time to first token, resident memory, same tokens.

usage (from a folder holding traces/ of tools/make_traces.py): python reopen.py BUNDLE
"""
import sys, re, time, logging, json
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import specdec.decoding.decoder as dm
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) >> 10
d = dm.SpeculativeDecoder.load(sys.argv[1], threads=2, max_context=8192, verify=False)
print("loaded", rss(), "MiB")
long_msg = json.load(open("traces/repo-agent-8k.json"))["requests"][0]["user"]
short = [{"role": "user", "content": "Write a Python function that merges two sorted lists into one sorted list, with a docstring and doctests."}]
def turn(tag, messages, n):
    t = time.time(); s = d.stream_chat(messages, max_new_tokens=n); first = None
    for piece in s:
        if first is None: first = time.time() - t
    st = s.stats
    print(f"{tag}: prompt {st.prompt_tokens}, TTFT {first:.2f} s, total {time.time()-t:.2f} s, {st.new_tokens} tokens, "
          f"sources {st.rounds_by_source}, skipped {st.draft_skipped}, draft open {d.draft_sessions.is_open}, RSS {rss()} MiB", flush=True)
    return list(s.token_ids)
a = turn("short (reference)", short, 256)
turn("8k agent turn", [{"role": "user", "content": long_msg}], 64)
b = turn("short again", short, 256)
print("same tokens:", a == b, "opens", d.draft_sessions.opens)
