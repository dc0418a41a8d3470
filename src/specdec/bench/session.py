"""Session benchmark: replay a trace (``specdec.bench.traces``) through servers' own HTTP code paths.

Each request of a trace is sent in order, streaming, to every server of the session, interleaved per
request (server A then server B for request 1, then request 2, ...), so machine drift hits them
alike while each server keeps its own cache and its own conversation (a chat turn carries, as
assistant turns, the replies *that* server gave before).

Servers: ``specdec serve BUNDLE`` started as a subprocess on a free 127.0.0.1 port (or a running
one given by URL), and optionally ``llama-server`` on the bundle's source GGUF
(``cache_prompt: true`` on its requests). Routes: ``/v1/chat/completions``, ``/v1/completions``
and llama.cpp's native ``/infill``. A server answering an error (e.g. a route it lacks) is recorded
per request with its HTTP status and the replay continues.

Per request: time to first token (first non-empty text piece), total time, prompt tokens, of
them cached / computed (``usage.prompt_tokens_details.cached_tokens``; llama.cpp's native
``/infill`` reports it as ``timings.cache_n`` / ``tokens_cached``; blank when the server reports none), new tokens,
decode tokens/s (the server's own figure when it reports one: llama.cpp ``timings.predicted_per_second``,
specdec's ``specdec.tokens_per_second``; else (new tokens - 1) / (total - first token)).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.parse
import urllib.request

from specdec.decoding.proposers import proposer_names
from specdec.bench.llama_server import ServerProcess, free_port

SPECDEC_HEALTH_TIMEOUT = 600.0
# what servers report about a request, kept as sent: OpenAI usage, llama.cpp timings and native counts, specdec's own
REPORTED = ("usage", "timings", "specdec", "tokens_cached", "tokens_evaluated")


class SessionServer:
    """One server of a session: where it is, which flavor of request it takes, its process (if ours)."""

    def __init__(self, name: str, url: str, flavor: str, process: ServerProcess | None = None, extra=None):
        if flavor not in ("specdec", "llama"):
            raise ValueError(f"unknown server flavor {flavor!r}")
        self.name, self.url, self.flavor, self.process = name, url.rstrip("/"), flavor, process
        self.extra = dict(extra or {})  # fields added to every request body (a specdec mode's options)
        self.model = None

    def model_id(self) -> str:
        if self.model is None:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as response:
                    self.model = json.loads(response.read())["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError):
                self.model = "default"
        return self.model

    def rss_mib(self):
        return self.process.rss_mib() if self.process else None

    def stop(self) -> None:
        if self.process:
            self.process.stop()


# specdec modes of a session: a server each (its own caches), the mode's options sent with every request: the default,
# target-only, and each proposer of the registry alone (the default is "hybrid")
SPECDEC_MODES = {"default": {}, "target": {"num_draft_tokens": 0},
                 **{name: {"proposer": name} for name in proposer_names() if name != "hybrid"}}


def start_specdec_server(bundle: str, threads: int | None = None, max_context: int | None = None,
                         log_path: str | None = None, no_verify: bool = False, mode: str = "default",
                         provider: str = "cpu", exact_rows: bool | None = None,
                         weight_form: str | None = None) -> SessionServer:
    """``python -m specdec.cli.main serve BUNDLE`` on a free 127.0.0.1 port, one worker; waits for /health.
    ``mode``: one of ``SPECDEC_MODES``, whose options every request of this server carries."""
    port = free_port()
    argv = [sys.executable, "-m", "specdec.cli.main", "serve", str(bundle), "--host", "127.0.0.1", "--port",
            str(port), "--workers", "1"]
    argv += ["--threads", str(threads)] if threads else []
    argv += ["--max-context", str(max_context)] if max_context else []
    argv += ["--no-verify"] if no_verify else []
    argv += ["--provider", provider] if provider != "cpu" else []
    argv += {True: ["--exact-rows"], False: ["--no-exact-rows"], None: []}[exact_rows]
    argv += ["--weight-form", weight_form] if weight_form else []
    process = ServerProcess(argv, port, "specdec serve", log_path).start(SPECDEC_HEALTH_TIMEOUT)
    name = "specdec" if mode == "default" else f"specdec:{mode}"
    return SessionServer(name, process.url, "specdec", process, SPECDEC_MODES[mode])


def request_body(server: SessionServer, request: dict, messages: list | None, max_tokens_cap: int | None) -> tuple:
    """(path, JSON body) of one trace request for this server."""
    llama = server.flavor == "llama"
    route = request["route"]
    if route == "infill":
        n_predict = request.get("n_predict", 24)
        if max_tokens_cap is not None:
            n_predict = min(n_predict, max_tokens_cap)
        body = {key: request[key] for key in ("input_prefix", "input_suffix", "input_extra", "prompt") if key in request}
        body.update({"n_predict": n_predict, "cache_prompt": True, "temperature": 0, "stream": True})
        return "/infill", body
    max_tokens = request.get("max_tokens", 128)
    if max_tokens_cap is not None:
        max_tokens = min(max_tokens, max_tokens_cap)
    body = {"model": server.model_id(), "max_tokens": max_tokens, "temperature": 0, "seed": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if route == "chat":
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", request["prompt"]
    if llama:
        body["cache_prompt"] = True
    body.update(server.extra)
    return path, body


def _events(response):
    """The JSON payloads of a server-sent-event stream (``data: {...}`` lines), until ``[DONE]`` or EOF."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            continue


def _text_of(event: dict) -> str:
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        return (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return event.get("content") or ""


# seconds a read may wait: a cold 30k-token prompt on 2 cores prefills for 14-17 minutes before the first byte
READ_TIMEOUT_S = 3600.0


def send(url: str, path: str, body: dict, timeout: float = READ_TIMEOUT_S) -> dict:
    """One streamed request, timed: text, first-token and total seconds, and what the server reported."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    result = {"status": None, "error": None, "text": "", "ttft_s": None, "total_s": None, "usage": None,
              "timings": None, "specdec": None, "tokens_cached": None, "tokens_evaluated": None, "pieces": 0}
    pieces = []
    begin = time.perf_counter()
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        result["status"] = response.status
        if response.status != 200:
            raw = response.read().decode(errors="replace")
            try:
                error = json.loads(raw).get("error", raw)
                error = error.get("message", error) if isinstance(error, dict) else error
            except ValueError:
                error = raw
            result["error"] = f"HTTP {response.status}: {' '.join(str(error).split())[:160]}"
            return result
        streamed = "event-stream" in (response.getheader("Content-Type") or "")
        events = _events(response) if streamed else [json.loads(response.read() or b"{}")]
        for event in events:
            if "error" in event:
                error = event["error"]
                result["error"] = str(error.get("message", error) if isinstance(error, dict) else error)
                continue
            text = _text_of(event)
            if text:
                if result["ttft_s"] is None:
                    result["ttft_s"] = time.perf_counter() - begin
                pieces.append(text)
            for key in REPORTED:
                if event.get(key) is not None:
                    result[key] = event[key]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["total_s"] = time.perf_counter() - begin
        connection.close()
    result["text"], result["pieces"] = "".join(pieces), len(pieces)
    return result


def measures(result: dict) -> dict:
    """Prompt tokens (cached / computed), new tokens, decode tok/s from one ``send`` result."""
    usage, timings, extra = result.get("usage") or {}, result.get("timings") or {}, result.get("specdec") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    cached_source = "usage" if cached is not None else None
    for native in (timings.get("cache_n"), result.get("tokens_cached")):  # llama.cpp's native routes
        if cached is None and native is not None:
            cached, cached_source = native, "native"
    prompt = usage.get("prompt_tokens", result.get("tokens_evaluated"))
    if prompt is None and timings.get("prompt_n") is not None:
        prompt = timings["prompt_n"] + (cached or 0)
    new = usage.get("completion_tokens", timings.get("predicted_n"))
    if new is None and result.get("pieces"):
        new = result["pieces"]  # a streamed piece per token at least on llama.cpp's native routes
    rate, source = None, None
    if timings.get("predicted_per_second") and (timings.get("predicted_n") or 0) > 0:
        rate, source = timings["predicted_per_second"], "server"
    elif extra.get("tokens_per_second"):
        rate, source = extra["tokens_per_second"], "server"
    elif new and new > 1 and result.get("ttft_s") is not None and result["total_s"] > result["ttft_s"]:
        rate, source = (new - 1) / (result["total_s"] - result["ttft_s"]), "client"
    return {"prompt_tokens": prompt, "cached_tokens": cached, "cached_source": cached_source,
            "computed_tokens": prompt - cached if prompt is not None and cached is not None else None,
            "new_tokens": new, "decode_tok_s": rate, "decode_source": source}


def replay(traces: list, servers: list, max_tokens_cap: int | None = None, progress=None) -> list:
    """Every request of every trace on every server, interleaved per request; one record each."""
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    records = []
    for trace in traces:
        conversations = {server.name: {} for server in servers}
        for index, request in enumerate(trace["requests"]):
            for server in servers:
                messages = None
                if request["route"] == "chat":
                    history = conversations[server.name].setdefault(request["conversation"], [])
                    if not history and request.get("system"):
                        history.append({"role": "system", "content": request["system"]})
                    history.append({"role": "user", "content": request["user"]})
                    messages = list(history)
                path, body = request_body(server, request, messages, max_tokens_cap)
                result = send(server.url, path, body)
                if request["route"] == "chat":  # the next turn carries the reply this server actually gave
                    history.append({"role": "assistant", "content": result["text"]})
                record = {"trace": trace["name"], "index": index, "route": request["route"], "path": path,
                          "server": server.name, "status": result["status"], "error": result["error"],
                          "ttft_s": result["ttft_s"], "total_s": result["total_s"], **measures(result),
                          "max_tokens": body.get("max_tokens", body.get("n_predict")),
                          "reply_chars": len(result["text"]), "rss_mib": server.rss_mib(),
                          "reported": {key: result[key] for key in REPORTED if result[key] is not None}}
                records.append(record)
                progress(f"[{trace['name']} {index + 1}/{len(trace['requests'])}] {server.name} {path}: "
                         + (record["error"] or f"ttft {_fmt(record['ttft_s'], '.3f')} s, total "
                            f"{record['total_s']:.2f} s, cached {_fmt(record['cached_tokens'], 'd')}/"
                            f"{_fmt(record['prompt_tokens'], 'd')}, {_fmt(record['decode_tok_s'], '.1f')} tok/s"))
    return records


def summarize_session(records: list) -> list:
    """Per (trace, server): requests, errors, summed total seconds, mean TTFT, cached share, decode rate."""
    rows = []
    for trace in dict.fromkeys(r["trace"] for r in records):
        for server in dict.fromkeys(r["server"] for r in records):
            chosen = [r for r in records if r["trace"] == trace and r["server"] == server]
            ok = [r for r in chosen if not r["error"]]
            ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
            prompt = [r for r in ok if r["prompt_tokens"] is not None and r["cached_tokens"] is not None]
            rates = [r["decode_tok_s"] for r in ok if r["decode_tok_s"] is not None]
            rows.append({"trace": trace, "server": server, "requests": len(chosen), "errors": len(chosen) - len(ok),
                         "total_s": sum(r["total_s"] for r in ok) if ok else None,
                         "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
                         "cached_share": (sum(r["cached_tokens"] for r in prompt) /
                                          max(sum(r["prompt_tokens"] for r in prompt), 1)) if prompt else None,
                         "mean_decode_tok_s": sum(rates) / len(rates) if rates else None})
    return rows


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def session_markdown(report: dict) -> str:
    lines = ["| trace | server | requests | errors | total s | mean TTFT s | cached share | mean decode tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["summary"]:
        lines.append(f"| {row['trace']} | {row['server']} | {row['requests']} | {row['errors']} | "
                     f"{_fmt(row['total_s'], '.2f')} | {_fmt(row['mean_ttft_s'], '.3f')} | "
                     f"{_fmt(row['cached_share'], '.0%')} | {_fmt(row['mean_decode_tok_s'], '.1f')} |")
    lines += ["", "| trace | # | route | server | TTFT s | total s | prompt tok | cached | computed | new tok | "
              "decode tok/s | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["requests"]:
        note = r["error"] or ("" if r["decode_source"] != "client" else "tok/s client-side")
        lines.append(f"| {r['trace']} | {r['index']} | {r['route']} | {r['server']} | {_fmt(r['ttft_s'], '.3f')} | "
                     f"{_fmt(r['total_s'], '.2f')} | {_fmt(r['prompt_tokens'], 'd')} | {_fmt(r['cached_tokens'], 'd')} | "
                     f"{_fmt(r['computed_tokens'], 'd')} | {_fmt(r['new_tokens'], 'd')} | "
                     f"{_fmt(r['decode_tok_s'], '.1f')} | {note.replace('|', '/')} |")
    lines += ["", "Requests interleaved per request across servers, each server with its own cache and conversation "
              "(chat turns carry that server's own earlier replies). TTFT: first non-empty streamed text. Cached: "
              "usage.prompt_tokens_details.cached_tokens (native /infill: timings.cache_n or tokens_cached); blank when "
              "not reported. Decode tok/s: the server's own figure, else client-side (new - 1) / (total - TTFT)."]
    rss = {name: value for name, value in (report.get("server_rss_mib") or {}).items() if value is not None}
    if rss:
        lines.append("Server peak RSS (VmHWM): " + ", ".join(f"{k} {v:.0f} MiB" for k, v in rss.items()) + ".")
    return "\n".join(lines) + "\n"


def run_session(traces: list, servers: list, max_tokens_cap: int | None = None, progress=None) -> dict:
    records = replay(traces, servers, max_tokens_cap, progress)
    return {"traces": [{"name": t["name"], "description": t.get("description"), "python": t.get("python"),
                        "requests": len(t["requests"])} for t in traces],
            "servers": {s.name: {"flavor": s.flavor, "url": s.url, "model": s.model} for s in servers},
            "max_tokens_cap": max_tokens_cap, "requests": records, "summary": summarize_session(records),
            "server_rss_mib": {s.name: s.rss_mib() for s in servers}}
