"""Peer columns for ``specdec bench``, on the same prompts and token ids (when installed).

- Hugging Face transformers: target-only ``generate`` and assisted generation
  (``assistant_model``, transformers' own speculative decoding) in PyTorch, greedy. Imports
  torch lazily: the runtime itself never needs it.
- onnxruntime-genai: target-only decoding and its n-gram speculation on a model folder its
  model builder made from the same Hugging Face weights (int4: the same MatMulNBits kernels,
  plus its fused attention/norm ops), greedy. Runs in this process, so both use the same
  onnxruntime (genai loads the ``onnxruntime`` package's library).

Each peer gets the bench's warm-up (``warm_up``) before its first timed run, as specdec does.
Counts a peer cannot report (acceptance, rounds / target passes) are None in its records, so
the bench prints "-" rather than a made-up value. Prefill is timed apart from decoding where
the library allows it (genai: ``append_tokens`` and the first token, which its logits give without a
pass: ``GenaiPeer._generate``); transformers' ``generate`` does both in one
call, so its prefill is taken as the time of a one-token ``generate`` (prefill + first token)
and its decode rate counts the remaining tokens over the remaining time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class TransformersPeer:
    """Per prompt: runs in the bench's record format, modes "hf:target" and "hf:assisted"."""

    def __init__(self, target_path: str, draft_path: str, encode, max_new_tokens: int, progress):
        progress("peers: loading the pair in transformers (float32)")
        self.target, self.draft = _load(target_path), _load(draft_path)
        self.encode, self.max_new_tokens, self.progress = encode, max_new_tokens, progress

    def _generate(self, ids, max_new_tokens: int, extra: dict) -> tuple[list, float]:
        import torch

        begin = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - begin

    def _modes(self) -> tuple:
        return (("hf:target", {}), ("hf:assisted", {"assistant_model": self.draft}))

    def warm_up(self, prompt: str, max_new_tokens: int) -> None:
        import torch

        ids = torch.tensor([self.encode(prompt)])
        for _, extra in self._modes():
            self._generate(ids, max_new_tokens, extra)

    def __call__(self, item: dict) -> list:
        import torch

        ids = torch.tensor([self.encode(item["prompt"])])
        runs = []
        for mode, extra in self._modes():
            _, first = self._generate(ids, 1, extra)  # prefill + the first token
            tokens, seconds = self._generate(ids, self.max_new_tokens, extra)
            runs.append(_record(item, mode, tokens, first, max(seconds - first, 1e-9), self.progress,
                                decode_tokens=max(len(tokens) - 1, 0)))
        return runs


def _load(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    source = Path(path)
    kwargs = {"gguf_file": source.name} if source.suffix == ".gguf" else {}
    folder = source.parent if source.suffix == ".gguf" else source
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **kwargs)
    return model.eval()


def _record(item: dict, mode: str, tokens: list, prefill_seconds: float, decode_seconds: float, progress,
            decode_tokens: int | None = None) -> dict:
    """A run in the bench's format; what the library does not report is None (printed "-")."""
    decode_tokens = len(tokens) if decode_tokens is None else decode_tokens
    progress(f"peers: {item['id']} {mode}: {decode_tokens / decode_seconds:.2f} tok/s")
    return {"prompt": item["id"], "kind": item["kind"], "mode": mode, "repeat": 0, "tokens": tokens,
            "new_tokens": len(tokens), "decode_tokens": decode_tokens, "prefill_seconds": prefill_seconds,
            "decode_seconds": decode_seconds, "proposed": None, "accepted": None, "rounds": None,
            "target_forwards": None, "draft_seconds": None, "verify_seconds": None, "host_seconds": None}


GENAI_MODES = {"genai:target": {}, "genai:ngram": {"ngram_size": 3, "max_draft_tokens": 4}}


class GenaiPeer:
    """Per prompt: modes "genai:target" and "genai:ngram" (3-gram lookup, k=4 draft tokens)."""

    def __init__(self, model_dir: str, encode, max_new_tokens: int, progress, threads: int | None = None):
        try:
            import onnxruntime  # noqa: F401  (genai loads onnxruntime's library from this package)
            import onnxruntime_genai as og
        except ImportError:
            raise ValueError("--peer-genai needs onnxruntime-genai: pip install onnxruntime-genai") from None
        if not (Path(model_dir) / "genai_config.json").is_file():
            raise ValueError(f"{model_dir} has no genai_config.json: give a folder made by onnxruntime-genai's "
                             "model builder")
        progress(f"peers: loading {model_dir} in onnxruntime-genai {getattr(og, '__version__', '?')}")
        config = og.Config(model_dir)
        # the thread count specdec uses (genai's default left a core idle here: ~9 vs ~16 tok/s)
        threads = threads or os.cpu_count() or 1
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.og, self.model = og, og.Model(config)
        self.encode, self.max_new_tokens, self.progress = encode, max_new_tokens, progress

    def _generate(self, ids: list, speculative: dict, max_new_tokens: int) -> tuple[list, float, float, int]:
        """(new tokens, prefill seconds, decode seconds, tokens decoded in the decode seconds).

        ``append_tokens`` runs the prompt and leaves its logits, so genai's first ``generate_next_token``
        only samples (measured: 0.2-0.4 ms, against ~70 ms for a later one). That token belongs to the
        prefill: the decode rate counts the remaining tokens over their passes. (specdec's decode loop
        runs one pass per token from the first, so counting genai's first token as decoded gave genai
        N tokens for N - 1 passes: +0.8% at 128 tokens.)"""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        if speculative:
            params.set_speculative_options(**speculative)
        generator = self.og.Generator(self.model, params)
        begin = time.perf_counter()
        generator.append_tokens(ids)  # the prompt (prefill) is not decode time, as for specdec
        tokens = []
        if not generator.is_done() and max_new_tokens > 0:
            generator.generate_next_token()  # sampled from the prompt's logits: no model pass
            tokens.extend(int(t) for t in generator.get_next_tokens())
        prefill = time.perf_counter() - begin
        first = len(tokens)
        begin = time.perf_counter()
        while not generator.is_done() and len(tokens) < max_new_tokens:
            generator.generate_next_token()
            tokens.extend(int(t) for t in generator.get_next_tokens())
        decoded = min(len(tokens), max_new_tokens) - first
        return tokens[:max_new_tokens], prefill, time.perf_counter() - begin, max(decoded, 0)

    def warm_up(self, prompt: str, max_new_tokens: int) -> None:
        for speculative in GENAI_MODES.values():
            self._generate(self.encode(prompt), speculative, max_new_tokens)

    def __call__(self, item: dict) -> list:
        ids = self.encode(item["prompt"])
        runs = []
        for mode, speculative in GENAI_MODES.items():
            tokens, prefill, decode, decoded = self._generate(ids, speculative, self.max_new_tokens)
            runs.append(_record(item, mode, tokens, prefill, max(decode, 1e-9), self.progress, decode_tokens=decoded))
        return runs
