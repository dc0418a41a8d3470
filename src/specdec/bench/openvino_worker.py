"""One OpenVINO GenAI pipeline in its own process, for ``specdec bench --peer-openvino``.

Run as a script by the interpreter that has ``openvino-genai`` (``OpenvinoPeer`` starts it): it imports
only the standard library and OpenVINO, never specdec, so that interpreter needs nothing else. Its
protocol is JSON lines:

- argv[1] is the job: ``{"mode": "ov:target" | "ov:draft" | "ov:lookup" | "convert", "target": GGUF,
  "draft": IR folder (ov:draft), "threads": N, "draft_tokens": N, "ngram": N, "properties": {...}}``.
  ``convert`` loads ``target`` (a GGUF) once with ``enable_save_ov_model`` (OpenVINO writes the IR beside
  the file: the peer links the GGUF into a scratch folder first) and exits: the draft pipeline of
  ``ov:draft`` reads that folder, as ``openvino_genai.draft_model`` takes no GGUF.
- Once loaded it writes ``{"ready": true, "load_seconds": s, "rss_mib": m, "version": v}``; then for every line
  ``{"ids": [...], "max_new_tokens": n}`` read from stdin it writes ``{"tokens": [...], "ttft_seconds": s,
  "generate_seconds": s, "rss_mib": m}`` (greedy; the prompt as token ids, so every runtime sees the same
  prompt). An error is one ``{"error": "..."}`` line, then exit 1.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _pipeline(job: dict):
    import openvino_genai as og

    properties = {"INFERENCE_NUM_THREADS": int(job["threads"]), **job.get("properties", {})}
    mode = job["mode"]
    if mode == "convert":
        return og.LLMPipeline(job["target"], "CPU", enable_save_ov_model=True, **properties)
    extra = {}
    if mode == "ov:draft":
        extra["draft_model"] = og.draft_model(job["draft"], "CPU", **properties)
    elif mode == "ov:lookup":
        extra["prompt_lookup"] = True
    return og.LLMPipeline(job["target"], "CPU", **properties, **extra)


def _config(pipeline, job: dict, max_new_tokens: int):
    config = pipeline.get_generation_config()
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    if job["mode"] == "ov:draft":
        config.num_assistant_tokens = int(job["draft_tokens"])
    elif job["mode"] == "ov:lookup":
        config.num_assistant_tokens = int(job["draft_tokens"])
        config.max_ngram_size = int(job["ngram"])
    return config


def _generate(pipeline, job: dict, ids: list, max_new_tokens: int) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    inputs = og.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)),
                                ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
    begin = time.perf_counter()
    result = pipeline.generate(inputs, _config(pipeline, job, max_new_tokens))
    seconds = time.perf_counter() - begin
    ttft = float(result.perf_metrics.get_ttft().mean) / 1000  # OpenVINO reports milliseconds
    return {"tokens": [int(t) for t in result.tokens[0]], "ttft_seconds": ttft, "generate_seconds": seconds,
            "rss_mib": _rss_mib()}


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list) -> int:
    try:
        job = json.loads(argv[1])
        begin = time.perf_counter()
        pipeline = _pipeline(job)
        import openvino_genai

        _say({"ready": True, "load_seconds": time.perf_counter() - begin, "rss_mib": _rss_mib(),
              "version": getattr(openvino_genai, "__version__", None)})
        if job["mode"] == "convert":
            return 0
        for line in sys.stdin:
            if line.strip():
                request = json.loads(line)
                _say(_generate(pipeline, job, [int(i) for i in request["ids"]], int(request["max_new_tokens"])))
    except Exception as exc:  # the peer reads this line and raises it as one ValueError line
        _say({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
