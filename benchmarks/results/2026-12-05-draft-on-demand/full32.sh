#!/bin/bash
# usage: full32.sh specdec|llama  -> one 32k-token chat, 16 new tokens, peak RSS of the server
# run from the project's root with WORK (bp-int8/, traces/, msg32k.txt), LLAMA_BUILD and GGUF_DIR set;
# msg32k.txt (32,368 prompt tokens with the chat template) was written from the traces of tools/make_traces.py:
#   python -c 'import json; t = lambda n: json.load(open(f"traces/repo-agent-{n}.json"))["requests"][0]["user"];
#              open("msg32k.txt", "w").write(t("8k")[:27000] + "\n\n" + t("30k"))'
source .venv/bin/activate  # the project's environment
cd "$WORK"  # holds bp-int8/ and msg32k.txt
port=$((8400 + RANDOM % 500))
if [ "$1" = specdec ]; then
  specdec serve bp-int8 --threads 2 --port $port > full32-specdec-$port.log 2>&1 &
  pat="specdec serve bp-int8 --threads 2 --port $port"
else
  $LLAMA_BUILD/bin/llama-server -m $GGUF_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 -c 32768 --parallel 1 --port $port --host 127.0.0.1 > full32-llama-$port.log 2>&1 &
  pat="llama-server -m .* --port $port"
fi
spid=$!
for i in $(seq 1 300); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health | grep -q 200 && break; sleep 1; done
pid=$(pgrep -f "$pat" | head -1)
echo "$1 idle: $(grep -E 'VmRSS|VmHWM' /proc/$pid/status | awk '{printf "%s %d MiB ", $1, $2/1024}')"
python - $port <<'PY'
import json, sys, urllib.request, time
port = sys.argv[1]
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": open("msg32k.txt").read()}], "max_tokens": 16, "temperature": 0, "stream": True}).encode()
t = time.time(); first = None
with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}), timeout=4000) as r:
    for line in r:
        line = line.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            d = json.loads(line[5:])
            if first is None and d.get("choices") and d["choices"][0].get("delta", {}).get("content"):
                first = time.time() - t
            if d.get("usage"): print("usage", d["usage"])
print(f"TTFT {first:.1f} s, total {time.time()-t:.1f} s")
PY
echo "$1 after: $(grep -E 'VmRSS|VmHWM' /proc/$pid/status | awk '{printf "%s %d MiB ", $1, $2/1024}')"
kill $spid; wait $spid 2>/dev/null
