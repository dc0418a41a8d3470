"""OpenVINO GenAI as a bench peer: target-only, its speculative decoding with the draft GGUF, and its
prompt lookup, on the same GGUF files llama-server reads and on specdec's token ids.

Each mode is an ``LLMPipeline`` in its own worker process (``openvino_worker.py``, run by the
interpreter ``--openvino-python`` names, default this one), started once and kept for the bench, so
OpenVINO's threads never share a process with onnxruntime's and its library need not be installed
beside specdec's. The pipelines read the GGUFs directly (OpenVINO GenAI's GGUF reader);
``openvino_genai.draft_model`` reads no GGUF, so the draft is first converted once into a scratch
folder (``enable_save_ov_model``) and that folder is removed at ``close``.

Modes:

- ``ov:target``: no speculation;
- ``ov:draft``: ``draft_model`` = the draft, ``num_assistant_tokens`` = ``--openvino-draft-tokens``;
- ``ov:lookup``: ``prompt_lookup=True``, ``num_assistant_tokens`` draft tokens from n-grams of up to
  ``max_ngram_size`` = 3 tokens of the prompt and the text so far.

Timing: OpenVINO's own time to first token (``perf_metrics.get_ttft``) is the prefill, with the first
token; the rest of the ``generate`` call decodes the other tokens (as the genai peer counts them).
Acceptance and pass counts are not reported (None, printed "-"). ``properties`` go to every pipeline
(e.g. ``{"INFERENCE_PRECISION_HINT": "f32"}``: on a CPU with AMX, OpenVINO computes in bf16 by default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specdec.bench.llama_server import check_binary

MODES = ("ov:target", "ov:draft", "ov:lookup")
DEFAULT_DRAFT_TOKENS = 4
LOOKUP_NGRAM = 3
WORKER = Path(__file__).with_name("openvino_worker.py")
LOAD_TIMEOUT = 600.0


def check_python(python: str) -> str:
    """``python`` if that interpreter imports openvino_genai, else one ValueError line."""
    found = check_binary(python, "--openvino-python")
    probe = subprocess.run([found, "-c", "import openvino_genai, numpy"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ValueError(f"--peer-openvino needs openvino-genai (and numpy) in {python}: "
                         f"{python} -m pip install openvino-genai")
    return found


def parse_modes(text: str) -> list:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--openvino-modes takes a comma list of {', '.join(MODES)}, got {text!r}")
    return modes


def parse_properties(text: str | None) -> dict:
    """``--openvino-config``: a JSON object of OpenVINO properties for every pipeline."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--openvino-config must be a JSON object: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ValueError("--openvino-config must be a JSON object, e.g. '{\"INFERENCE_PRECISION_HINT\": \"f32\"}'")
    return value


class Worker:
    """One worker process: ``job`` as its argument, JSON lines in and out."""

    def __init__(self, python: str, job: dict, log_path: str | None = None):
        self.job = job
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen([python, str(WORKER), json.dumps(job)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(timeout=LOAD_TIMEOUT)
            raise ValueError(f"OpenVINO GenAI ({self.job['mode']}) ended with exit code {code} and no answer"
                             + (f": see {self.log.name}" if hasattr(self.log, "name") else ""))
        message = json.loads(line)
        if "error" in message:
            self.process.wait(timeout=30)
            raise ValueError(f"OpenVINO GenAI ({self.job['mode']}): {message['error']}")
        return message

    def generate(self, ids: list, max_new_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"ids": list(ids), "max_new_tokens": max_new_tokens}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if hasattr(self.log, "close"):
            self.log.close()


def record(item: dict, mode: str, answer: dict) -> dict:
    """A run in the bench's record format; what OpenVINO does not report is None (printed "-")."""
    tokens = answer["tokens"]
    prefill = min(answer["ttft_seconds"], answer["generate_seconds"])
    return {"prompt": item["id"], "kind": item["kind"], "mode": mode, "repeat": 0, "tokens": tokens,
            "new_tokens": len(tokens), "decode_tokens": max(len(tokens) - 1, 0), "prefill_seconds": prefill,
            "decode_seconds": max(answer["generate_seconds"] - prefill, 1e-9), "proposed": None, "accepted": None,
            "rounds": None, "target_forwards": None, "draft_seconds": None, "verify_seconds": None,
            "host_seconds": None, "rss_mib": answer.get("rss_mib")}


class OpenvinoPeer:
    """Per prompt: one timed ``generate`` per OpenVINO GenAI mode (workers started once, kept for the bench).

    ``repeats = True``: called in every pass of the bench, as llama-server is."""

    repeats = True

    def __init__(self, python: str, target: str, draft: str | None, encode, max_new_tokens: int, progress,
                 threads: int | None = None, modes=MODES, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 properties: dict | None = None, log_dir: str | None = None):
        self.encode, self.max_new_tokens, self.progress = encode, max_new_tokens, progress
        self.workers, self.notes, self.scratch = {}, [], None
        base = {"target": str(Path(target).resolve()), "threads": threads or os.cpu_count() or 1,
                "draft_tokens": draft_tokens, "ngram": LOOKUP_NGRAM, "properties": dict(properties or {})}
        try:
            for mode in modes:
                job = {**base, "mode": mode}
                if mode == "ov:draft":
                    if not draft:
                        self.notes.append("ov:draft skipped: no draft GGUF (give --peer-gguf TARGET DRAFT)")
                        progress(f"peers: {self.notes[-1]}")
                        continue
                    job["draft"] = self._convert(python, draft, base, log_dir)
                    job["draft_gguf"] = Path(draft).name
                progress(f"peers: starting OpenVINO GenAI ({mode})")
                log = str(Path(log_dir) / f"openvino-{mode[3:]}.log") if log_dir else None
                self.workers[mode] = Worker(python, job, log)
                progress(f"peers: OpenVINO GenAI ({mode}) loaded in {self.workers[mode].ready['load_seconds']:.1f} s")
        except BaseException:
            self.close()
            raise

    def _convert(self, python: str, draft: str, base: dict, log_dir: str | None) -> str:
        """The draft GGUF as an OpenVINO IR folder (a scratch folder, removed at close)."""
        self.scratch = tempfile.mkdtemp(prefix="specdec-openvino-draft-")
        linked = Path(self.scratch) / Path(draft).name
        linked.symlink_to(Path(draft).resolve())
        self.progress("peers: converting the draft GGUF for OpenVINO GenAI's draft_model")
        log = str(Path(log_dir) / "openvino-convert.log") if log_dir else None
        try:
            worker = Worker(python, {**base, "mode": "convert", "target": str(linked)}, log)
        except ValueError as exc:
            raise ValueError(f"OpenVINO GenAI could not read the draft {Path(draft).name} ({exc}); its GGUF reader "
                             "does not take every tensor type (e.g. Q5_0): give --openvino-draft a copy made by "
                             "`llama-quantize --allow-requantize DRAFT OUT Q8_0`") from None
        worker.stop()
        if not (Path(self.scratch) / "openvino_model.xml").is_file():
            raise ValueError("OpenVINO GenAI wrote no openvino_model.xml for the draft GGUF")
        return self.scratch

    def warm_up(self, prompt: str, max_new_tokens: int) -> None:
        ids = self.encode(prompt)
        for worker in self.workers.values():
            worker.generate(ids, max_new_tokens)

    def __call__(self, item: dict) -> list:
        ids = self.encode(item["prompt"])
        runs = []
        for mode, worker in self.workers.items():
            run = record(item, mode, worker.generate(ids, self.max_new_tokens))
            self.progress(f"peers: {item['id']} {mode}: {run['decode_tokens'] / run['decode_seconds']:.2f} tok/s")
            runs.append(run)
        return runs

    def describe(self) -> dict:
        def public(job: dict) -> dict:  # file names, not this machine's paths; the scratch folder left out
            return {k: (Path(v).name if k == "target" else v) for k, v in job.items() if k != "draft"}

        described = {mode: {"job": public(w.job), "load_seconds": w.ready.get("load_seconds"),
                            "rss_mib_at_load": w.ready.get("rss_mib"),
                            "version": w.ready.get("version")}
                     for mode, w in self.workers.items()}
        return described | ({"notes": self.notes} if self.notes else {})

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
