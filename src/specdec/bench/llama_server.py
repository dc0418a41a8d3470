"""llama.cpp's ``llama-server`` as a bench peer and as a session-bench server.

Each llama.cpp mode is its own server process (``LlamaServer``) on 127.0.0.1, on a free port, started
once with ``-m TARGET -t THREADS -c CTX --parallel 1`` (plus the mode's speculative flags), and polled
on ``/health`` until it has loaded. Nothing is downloaded: the model files are arguments.

Modes (the flag names of llama.cpp's current ``--help``; ``--draft-max`` and ``--spec-ngram-size-n`` are
removed there):

- ``llama:target``: no speculation;
- ``llama:draft``: ``--spec-type draft-simple --model-draft DRAFT --spec-draft-n-max N`` (needs the draft GGUF);
- ``llama:ngram-simple``: ``--spec-type ngram-simple``;
- ``llama:ngram-mod``: ``--spec-type ngram-mod`` (one n-gram pool shared by all requests);
- ``llama:ngram-cache``: ``--spec-type ngram-cache`` (an n-gram cache of the context and earlier generations).

A mode whose flags the binary's ``--help`` does not list is skipped with a one-line note. Extra server
arguments (``--llama-args``) go to every server: e.g. ``--no-repack`` where ggml's AMX kernels crash
(seen on a 2-core Xeon VM that lists amx_int8 but segfaulted in ``ggml_backend_amx_mul_mat``).

``LlamaServerPeer`` times one prompt per mode through the native ``/completion`` endpoint (the prompt
as specdec's token ids, ``n_predict``, ``temperature: 0``, ``cache_prompt: false``) and takes the
server's own ``timings``: ``prompt_n`` / ``prompt_ms`` (prefill) and ``predicted_n`` /
``predicted_ms`` (decode). llama.cpp's ``predicted_ms`` runs from the end of the prompt pass, so its
first token, sampled from the prompt's logits, is counted in the decode rate (as llama.cpp reports
it). The resident memory recorded per run is the server process's peak (``VmHWM``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

MODES = ("llama:target", "llama:draft", "llama:ngram-simple", "llama:ngram-mod", "llama:ngram-cache")
DEFAULT_DRAFT_MAX = 4
DEFAULT_CONTEXT = 4096
HEALTH_TIMEOUT = 180.0


def check_binary(path: str, flag: str = "--peer-llama-server") -> str:
    """``path`` if it is an executable file (or a name on PATH), else one ValueError line."""
    found = shutil.which(path) if os.sep not in path else (path if os.path.isfile(path) else None)
    if not found or not os.access(found, os.X_OK):
        raise ValueError(f"{flag}: {path} is not an executable file")
    return found


def check_gguf(path: str, role: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"--peer-gguf: the {role} GGUF {path} does not exist")
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"--peer-gguf: {path} is not a GGUF file")
    return path


def gguf_from_manifest(bundle: str, verify: bool = True, flag: str = "--peer-llama-server") -> tuple:
    """(target, draft) source GGUF paths the bundle's manifest records (``Manifest.sources``), else None each.

    A recorded file must still be there with the sha256 recorded at export (checked through specdec's
    verified-hash cache, so a second run does not hash the GGUFs again): otherwise one ValueError line."""
    from specdec.contract.bundle import HashCache, default_hash_cache
    from specdec.contract.manifest import Manifest

    manifest = Manifest.read(bundle)
    hashes = HashCache(default_hash_cache()) if verify else None
    found = []
    for role in ("target", "draft"):
        record = manifest.sources.get(role)
        if record is None or not record.file_name.lower().endswith(".gguf"):
            found.append(None)
            continue
        if not os.path.isfile(record.path):
            raise ValueError(f"{flag}: the {role} GGUF the bundle was exported from, {record.path}, is "
                             "not there: give --peer-gguf TARGET [DRAFT]")
        if hashes is not None:
            digest = hashes.sha256(Path(record.path))
            if digest != record.sha256:
                raise ValueError(f"{flag}: {record.path} has sha256 {digest[:12]}..., not the "
                                 f"{record.sha256[:12]}... the {role} was exported from: give --peer-gguf TARGET "
                                 "[DRAFT] to compare against other files")
        found.append(record.path)
    if hashes is not None:
        hashes.save()
    return tuple(found)


def resolve_ggufs(bundle: str, peer_gguf, flag: str = "--peer-llama-server") -> tuple:
    """(target, draft or None) from ``--peer-gguf TARGET [DRAFT]``, else the manifest's sources; checked now."""
    if peer_gguf and len(peer_gguf) > 2:
        raise ValueError("--peer-gguf takes TARGET [DRAFT]")
    target, draft = (list(peer_gguf) + [None])[:2] if peer_gguf else gguf_from_manifest(bundle, flag=flag)
    if not target:
        raise ValueError(f"{flag} needs the source GGUF: give --peer-gguf TARGET [DRAFT] (the bundle's "
                         "manifest records none: bundles exported from GGUF files record them)")
    return check_gguf(target, "target"), (check_gguf(draft, "draft") if draft else None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def help_text(binary: str) -> str:
    try:
        result = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--peer-llama-server: {binary} --help failed: {exc}") from None
    return result.stdout + result.stderr


def mode_flags(mode: str, draft: str | None, draft_max: int = DEFAULT_DRAFT_MAX) -> list:
    """The speculative flags of one mode (empty for target-only)."""
    if mode == "llama:target":
        return []
    if mode == "llama:draft":
        return ["--spec-type", "draft-simple", "--model-draft", draft, "--spec-draft-n-max", str(draft_max)]
    if mode in ("llama:ngram-simple", "llama:ngram-mod", "llama:ngram-cache"):
        return ["--spec-type", mode.split(":", 1)[1]]
    raise ValueError(f"unknown llama.cpp mode {mode!r}: one of {', '.join(MODES)}")


def server_args(binary: str, target: str, port: int, threads: int, context: int, mode: str = "llama:target",
                draft: str | None = None, draft_max: int = DEFAULT_DRAFT_MAX, extra: tuple = ()) -> list:
    return [binary, "-m", target, "-t", str(threads), "-c", str(context), "--parallel", "1", "--port", str(port),
            "--host", "127.0.0.1", *mode_flags(mode, draft, draft_max), *extra]


def usable_modes(modes, help_output: str, draft: str | None) -> tuple:
    """(modes this binary and these files can run, one-line notes for the others)."""
    keep, notes = [], []
    for mode in modes:
        if mode == "llama:draft" and not draft:
            notes.append("llama:draft skipped: no draft GGUF (--peer-gguf TARGET DRAFT)")
            continue
        flags = [f for f in mode_flags(mode, draft or "x") if f.startswith("--")]
        missing = [f for f in flags if f not in help_output]
        kind = mode_flags(mode, draft or "x")[1] if mode != "llama:target" else None
        if missing or (kind and kind not in help_output):
            notes.append(f"{mode} skipped: this llama-server's --help lacks {' '.join(missing or [kind])}")
            continue
        keep.append(mode)
    return tuple(keep), notes


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak resident memory (VmHWM) in MiB, from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(url: str, process=None, timeout: float = HEALTH_TIMEOUT, what: str = "server") -> None:
    """Poll ``url`` (a /health route) until it answers 200; fail early when ``process`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} not healthy at {url} after {timeout:.0f} s")


class ServerProcess:
    """A server subprocess on 127.0.0.1: started, waited for on /health, stopped (by its own pid)."""

    def __init__(self, argv: list, port: int, name: str, log_path: str | None = None):
        self.argv, self.port, self.name = argv, port, name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.process = None

    def start(self, timeout: float = HEALTH_TIMEOUT) -> "ServerProcess":
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(self.url + "/health", self.process, timeout, self.name)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{exc}{self._log_tail()}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def _log_tail(self) -> str:
        """'; log: its last line' (the usual reason a server died), or nothing without a log."""
        try:
            lines = Path(self.log_path).read_text(errors="replace").strip().splitlines() if self.log_path else []
        except OSError:
            lines = []
        return f" (log {self.log_path}: {' '.join(lines[-1].split())[:200]})" if lines else ""

    def rss_mib(self) -> float | None:
        return peak_rss_mib(self.process.pid) if self.process else None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
            self.log = subprocess.DEVNULL


class LlamaServer(ServerProcess):
    def __init__(self, binary: str, target: str, mode: str = "llama:target", draft: str | None = None,
                 threads: int | None = None, context: int = DEFAULT_CONTEXT, draft_max: int = DEFAULT_DRAFT_MAX,
                 port: int | None = None, log_path: str | None = None, extra: tuple = ()):
        port = port or free_port()
        self.mode = mode
        argv = server_args(binary, target, port, threads or os.cpu_count() or 1, context, mode, draft, draft_max,
                           tuple(extra))
        super().__init__(argv, port, f"llama-server ({mode})", log_path)


def completion_body(prompt, n_predict: int, cache_prompt: bool = False) -> dict:
    """The native /completion request of a plain timed run: greedy, the prompt as ids (or text)."""
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1, "seed": 0,
            "cache_prompt": cache_prompt, "return_tokens": True, "stream": False}


def parse_timings(response: dict) -> dict:
    """The bench's numbers from a /completion response's ``timings`` (KeyError when it has none)."""
    timings = response["timings"]
    prompt_n, predicted_n = int(timings["prompt_n"]), int(timings["predicted_n"])
    prompt_ms, predicted_ms = float(timings["prompt_ms"]), float(timings["predicted_ms"])
    return {"prompt_n": prompt_n, "predicted_n": predicted_n, "prefill_seconds": prompt_ms / 1000,
            "decode_seconds": max(predicted_ms / 1000, 1e-9),
            "prompt_per_second": timings.get("prompt_per_second"),
            "predicted_per_second": timings.get("predicted_per_second"),
            "cached_n": timings.get("cache_n", response.get("tokens_cached")),
            "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted")}


def record(item: dict, mode: str, response: dict, rss_mib: float | None) -> dict:
    """A run in the bench's record format; what llama.cpp does not report is None (printed "-")."""
    t = parse_timings(response)
    tokens = [int(x) for x in response.get("tokens") or []]
    proposed, accepted = t["draft_n"], t["draft_n_accepted"]
    return {"prompt": item["id"], "kind": item["kind"], "mode": mode, "repeat": 0, "tokens": tokens,
            "prompt_tokens": t["prompt_n"], "new_tokens": t["predicted_n"], "decode_tokens": t["predicted_n"],
            "prefill_seconds": t["prefill_seconds"], "decode_seconds": t["decode_seconds"],
            "prompt_per_second": t["prompt_per_second"], "predicted_per_second": t["predicted_per_second"],
            "proposed": proposed if mode != "llama:target" else None,
            "accepted": accepted if mode != "llama:target" else None, "rounds": None, "target_forwards": None,
            "draft_seconds": None, "verify_seconds": None, "host_seconds": None, "rss_mib": rss_mib}


class LlamaServerPeer:
    """Per prompt: one timed /completion per llama.cpp mode (servers started once, kept up for the bench).

    ``repeats = True``: the bench calls it in every pass, so its modes get the same spread as specdec's."""

    repeats = True

    def __init__(self, binary: str, target: str, draft: str | None, encode, max_new_tokens: int, progress,
                 threads: int | None = None, context: int = DEFAULT_CONTEXT, modes=MODES,
                 draft_max: int = DEFAULT_DRAFT_MAX, log_dir: str | None = None, servers: dict | None = None,
                 extra: tuple = ()):
        self.encode, self.max_new_tokens, self.progress = encode, max_new_tokens, progress
        self.notes = []
        if servers is not None:  # tests: {mode: object with .url and .rss_mib()}
            self.servers = dict(servers)
            return
        modes, self.notes = usable_modes(modes, help_text(binary), draft)
        for note in self.notes:
            progress(f"peers: {note}")
        self.servers = {}
        try:
            for mode in modes:
                log = str(Path(log_dir) / f"llama-server-{mode.split(':')[1]}.log") if log_dir else None
                progress(f"peers: starting llama-server ({mode})")
                self.servers[mode] = LlamaServer(binary, target, mode, draft, threads, context, draft_max,
                                                 log_path=log, extra=extra).start()
        except BaseException:
            self.close()
            raise

    def _complete(self, mode: str, ids: list, n_predict: int) -> dict:
        return post_json(self.servers[mode].url + "/completion", completion_body(ids, n_predict))

    def warm_up(self, prompt: str, max_new_tokens: int) -> None:
        ids = self.encode(prompt)
        for mode in self.servers:
            self._complete(mode, ids, max_new_tokens)

    def __call__(self, item: dict) -> list:
        ids = self.encode(item["prompt"])
        runs = []
        for mode, server in self.servers.items():
            run = record(item, mode, self._complete(mode, ids, self.max_new_tokens), server.rss_mib())
            self.progress(f"peers: {item['id']} {mode}: {run['decode_tokens'] / run['decode_seconds']:.2f} tok/s "
                          f"(prefill {run['prompt_tokens']} tokens at {run['prompt_per_second'] or 0:.1f} tok/s)")
            runs.append(run)
        return runs

    def describe(self) -> dict:
        return {mode: {"argv": _public_argv(getattr(s, "argv", [])), "rss_mib": s.rss_mib()}
                for mode, s in self.servers.items()} | ({"notes": self.notes} if self.notes else {})

    def close(self) -> None:
        for server in self.servers.values():
            if hasattr(server, "stop"):
                server.stop()


def _public_argv(argv: list) -> list:
    """A server's argv for a report: file names only, never this machine's paths."""
    return [os.path.basename(a) if os.sep in a else a for a in argv]
