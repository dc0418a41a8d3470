"""The source model's own outputs for the parity sequences, computed one decoder layer at a time.

A streamed export never holds the whole float model; neither does its reference. Each layer is the Hugging Face
model's own decoder-layer module (its class from the architecture's modeling code, eager attention), built with
that layer's float weights only, run over the hidden states of every parity sequence, and dropped: the hidden
states, and each layer's key/value rows (the cache the layer writes), carry over to the next. The final norm and
the lm_head give the logits. The result has ``parity.reference_outputs``'s form, so ``parity.check_parity``
compares an exported graph with it exactly as with a whole-model reference, layer by layer on the KV rows.
"""

from __future__ import annotations

import numpy as np


class StreamedReference:
    def __init__(self, config, sequences: list):
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.config = copy.deepcopy(config)
        self.config._attn_implementation = "eager"
        with torch.device("meta"):  # the classes only: nothing is allocated
            shell = AutoModelForCausalLM.from_config(self.config)
        body = shell.model
        self.layer_class = type(body.layers[0])
        self.norm_class = type(body.norm)
        self.rotary = type(body.rotary_emb)(config=self.config)  # on the CPU: its inverse frequencies are real
        del shell, body
        self.sequences = [tuple(ids) for ids in sequences]
        self.results: dict = {}
        self.hidden = {}
        self.rows = {ids: [] for ids in self.sequences}

    def embed(self, table: np.ndarray) -> None:
        torch = self.torch
        weights = torch.from_numpy(table)
        for ids in self.sequences:
            self.hidden[ids] = weights[torch.tensor(ids)][None].clone()  # [1, S, H]

    def layer(self, index: int, tensors: dict, sliding_window: int | None = None) -> None:
        """Run layer ``index`` (``tensors``: its weights by name inside the layer, float32 numpy); a sliding-window
        layer (``sliding_window``) sees keys at positions > q - window, as Hugging Face's masks say."""
        torch = self.torch
        from transformers.cache_utils import DynamicCache

        with torch.device("meta"):
            layer = self.layer_class(self.config, index)
        layer.load_state_dict({name: torch.from_numpy(value) for name, value in tensors.items()}, strict=True,
                              assign=True)
        layer.eval()
        with torch.no_grad():
            for ids, hidden in self.hidden.items():
                count = hidden.shape[1]
                positions = torch.arange(count)[None]
                distance = torch.arange(count)[:, None] - torch.arange(count)[None, :]
                visible = (distance >= 0) & ((distance < sliding_window) if sliding_window else True)
                mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
                cache = DynamicCache(config=self.config)
                out = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                            position_embeddings=self.rotary(hidden, positions))
                self.hidden[ids] = out[0] if isinstance(out, tuple) else out
                stored = cache.layers[index]
                self.rows[ids].append((stored.keys[0].transpose(0, 1).float().numpy().copy(),
                                       stored.values[0].transpose(0, 1).float().numpy().copy()))
        del layer

    def take_rows(self, ids: tuple, index: int) -> tuple:
        """Layer ``index``'s (keys [S, KVH, D], values [S, KVH, D]) over sequence ``ids``, handed over: the reference
        keeps no copy (a calibration needs each layer's rows once; ``finish`` is then not for this sequence)."""
        rows, self.rows[ids][index] = self.rows[ids][index], None
        return rows

    def finish(self, norm_weight: np.ndarray, head: np.ndarray) -> None:
        """The final norm and ``head`` [V, H] (the lm_head rows the bundle keeps): ``results`` is then
        {token ids: (logits [S, V], KV rows per layer)}, as ``parity.reference_outputs`` returns."""
        torch = self.torch
        norm = self.norm_class(norm_weight.shape[0], eps=getattr(self.config, "rms_norm_eps", 1e-6))
        norm.load_state_dict({"weight": torch.from_numpy(norm_weight)})
        weight = torch.from_numpy(head)
        with torch.no_grad():
            self.results = {ids: ((norm(hidden)[0] @ weight.T).float().numpy(), self.rows[ids])
                            for ids, hidden in self.hidden.items()}
