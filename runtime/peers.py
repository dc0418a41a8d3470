"""Peer columns for ``specdec bench``: Hugging Face transformers on the same pair (when installed).

Target-only ``generate`` and assisted generation (``assistant_model``, transformers' own
speculative decoding) in PyTorch, greedy, on the same prompts. Imports torch lazily: the
runtime itself never needs it.
"""

from __future__ import annotations

import time
from pathlib import Path


def _load(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    source = Path(path)
    kwargs = {"gguf_file": source.name} if source.suffix == ".gguf" else {}
    folder = source.parent if source.suffix == ".gguf" else source
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **kwargs)
    return model.eval()


def transformers_runs(target_path: str, draft_path: str, prompts: list, encode, max_new_tokens: int, progress) -> list:
    """Runs in the bench's record format, modes "hf:target" and "hf:assisted"."""
    import torch

    progress("peers: loading the pair in transformers (float32)")
    target, draft = _load(target_path), _load(draft_path)
    runs = []
    for item in prompts:
        ids = torch.tensor([encode(item["prompt"])])
        for mode, extra in (("hf:target", {}), ("hf:assisted", {"assistant_model": draft})):
            begin = time.perf_counter()
            with torch.no_grad():
                out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
            seconds = time.perf_counter() - begin
            tokens = out[0, ids.shape[1]:].tolist()
            runs.append({"prompt": item["id"], "kind": item["kind"], "mode": mode, "repeat": 0, "tokens": tokens,
                         "new_tokens": len(tokens), "decode_seconds": seconds, "proposed": 0, "accepted": 0,
                         "rounds": len(tokens), "target_forwards": 0, "draft_seconds": 0.0, "verify_seconds": seconds,
                         "host_seconds": 0.0})
            progress(f"peers: {item['id']} {mode}: {len(tokens) / seconds:.2f} tok/s")
    return runs
