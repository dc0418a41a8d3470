"""How each weight of a streamed export is stored: the ``WeightPlan`` (from the export options) and the
``WeightQuantizer`` that turns one weight into the ``Packed`` parts of a MatMulNBits.

Methods (``--quant int4 --quant-method``):

- ``rtn``: onnxruntime's own symmetric round-to-nearest (MLAS; the bytes its MatMulNBitsQuantizer writes), blocks of
  ``block`` weights; ``rtn-asym`` the same with a 4-bit zero point per block.
- ``k-quant``: llama.cpp's Q4_K (``kquant.py``: the scale/minimum search, 6-bit super-block scales), kept with its
  float minimum (correction rows); rows that are not whole super-blocks of 256 keep the search's float scales
  (``kquant.float_k_grid``; a draft's, ``float_scales`` False, are rounded symmetric instead); the block roles in ``wide_roles`` (attn_v) and, in llama.cpp's ``use_more_bits``
  layers, those in ``more_bits_roles``, at 8 bits (symmetric, blocks of 32) where Q4_K_M stores Q6_K.
- ``gguf`` / ``gguf-int4``: a GGUF source's own blocks carried over (``gguf_carry.py``); ``gguf-int4`` puts the
  tensors the GGUF holds wider than 4 bits on 4-bit grids (``kquant.narrowed``), but the ``wide_roles`` and (``--lm-head-bits 8``) the lm_head.
  A tensor the GGUF holds in a type not carried falls back to ``rtn``.

``--lm-head-bits 8`` stores the lm_head at 8 bits whatever the method. ``--quant int8``: every weight 8-bit (MLAS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from specdec.export.gguf_blocks import join_runs
from specdec.export.nbits import Packed, pack_float, pack_grid, pack_table

STREAMED_METHODS = ("rtn", "rtn-asym", "k-quant", "gguf", "gguf-int4")
_ROLE = re.compile(r"(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
_ROLES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
          "down": "ffn_down"}


def block_role(name: str) -> str:
    """llama.cpp's block role of a Hugging Face weight name (``attn_v``, ``ffn_down`` ...; ``output`` otherwise)."""
    match = _ROLE.search(name)
    return _ROLES[match.group(1)] if match else "output"


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v / ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclass(frozen=True)
class WeightPlan:
    quant: str  # "none" | "int4" | "int8"
    method: str = "rtn"  # int4: one of STREAMED_METHODS
    block: int = 32  # the MLAS methods' weights per scale (grids are always blocks of 32)
    lm_head_bits: int = 4
    accuracy_level: int | None = 4
    wide_roles: frozenset = frozenset({"attn_v"})  # k-quant / gguf-int4: always at 8 bits
    more_bits_roles: frozenset = frozenset()  # k-quant: at 8 bits in llama.cpp's use_more_bits layers
    float_scales: bool = True  # QuantRecipe.float_scales: the target's; a draft's rounds symmetric instead
    layer_products: str = "nbits"  # QuantRecipe.layer_products: "int8" = the layers' projections as int8_rows.py

    def __post_init__(self):
        if self.quant == "int4" and self.method not in STREAMED_METHODS:
            raise ValueError(f"the streamed exporter stores int4 as one of {', '.join(STREAMED_METHODS)}, "
                             f"not {self.method!r}")


@dataclass
class WeightQuantizer:
    plan: WeightPlan
    weights: object  # tensors.Weights: a GGUF's grids for the carrying methods
    layers: int
    report: dict = field(default_factory=lambda: {"stored": {}})

    def _count(self, what: str, count: int = 1) -> None:
        self.report["stored"][what] = self.report["stored"].get(what, 0) + count

    def count_int8_rows(self, weights: int) -> None:
        self._count("7-bit per output channel, 8-bit rows (MatMulIntegerToFloat)", weights)

    def shares_embedding(self) -> bool:
        """A tied table can be stored once: the 4-bit symmetric lm_head's data read by the embedding's Gather."""
        return self.plan.quant == "int4" and self.plan.method == "rtn" and self.plan.lm_head_bits == 4

    def parts(self, tensors: list, names: list, kind: str, layer: int = -1) -> list:
        """The Packed parts of the weights ``tensors`` ([N, K] float32, Hugging Face ``names``) side by side."""
        plan = self.plan
        head = kind == "output"
        bits = 8 if plan.quant == "int8" or (head and plan.lm_head_bits == 8) else 4
        gridded = plan.quant == "int4" and all(tensor.shape[1] % 32 == 0 for tensor in tensors)
        if plan.method in ("gguf", "gguf-int4") and gridded:
            carried = [self._carried(name, layer, head, tensor.shape[0]) for tensor, name in zip(tensors, names)]
            if all(item is not None for item in carried):
                return self._runs(carried)
        if plan.method == "k-quant" and gridded:
            return self._runs([self._k_quant(tensor, name, layer, bits) for tensor, name in zip(tensors, names)])
        weight = np.concatenate(tensors, axis=0) if len(tensors) > 1 else tensors[0]
        symmetric = plan.method != "rtn-asym" or bits == 8
        self._count(f"{'symmetric' if symmetric else 'asymmetric'} {bits}-bit, block {plan.block}", len(names))
        return [pack_float(weight, bits, plan.block, symmetric)]

    def embedding(self, table: np.ndarray, name: str = "model.embed_tokens.weight"):
        """The token embedding's stored form (int4): a Grid (k-quant's Q4_K, a GGUF's carried blocks) or a symmetric
        4-bit Packed of MLAS in blocks of ``block`` (the MLAS methods, and what no grid holds)."""
        from specdec.export.kquant import q4_k_fits, q4_k_grid, float_k_grid

        if self.plan.method in ("rtn", "rtn-asym") or table.shape[1] % 32:
            self._count(f"symmetric 4-bit, block {self.plan.block}")
            return pack_table(table, self.plan.block)
        if self.plan.method in ("gguf", "gguf-int4"):
            found = self.weights.grid(name)
            if found is not None:
                from specdec.export.kquant import narrowed

                kind, grid = found
                self._count(f"carried {kind}")
                return narrowed(_first_rows(grid, table.shape[0]), self.plan.float_scales)
        if q4_k_fits(table.shape):
            self._count("Q4_K")
            return q4_k_grid(table)
        if not self.plan.float_scales:
            self._count(f"symmetric 4-bit, block {self.plan.block}")
            return pack_table(table, self.plan.block)
        self._count("k-quant with float scales (rows not whole Q4_K super-blocks)")
        return float_k_grid(table)

    def _wide(self, role: str, layer: int) -> bool:
        plan = self.plan
        return role in plan.wide_roles or (role in plan.more_bits_roles and layer >= 0 and
                                           use_more_bits(layer, self.layers))

    def _k_quant(self, tensor: np.ndarray, name: str, layer: int, bits: int) -> tuple:
        from specdec.export.kquant import float_k_grid, q4_k_fits, q4_k_grid, symmetric_grid

        if bits == 8 or self._wide(block_role(name), layer):
            self._count("symmetric 8-bit, block 32")
            return symmetric_grid(tensor, 8), "sym8"
        if not q4_k_fits(tensor.shape):
            if not self.plan.float_scales:
                self._count("symmetric 4-bit, block 32 (rows not whole Q4_K super-blocks)")
                return symmetric_grid(tensor, 4), "sym4"
            self._count("k-quant with float scales (rows not whole Q4_K super-blocks)")
            return float_k_grid(tensor), "Q4_K"
        self._count("Q4_K")
        return q4_k_grid(tensor), "Q4_K"

    def _carried(self, name: str, layer: int, head: bool, rows: int) -> tuple | None:
        """(the GGUF's Grid of ``name``, its type), rounded to 4 bits for gguf-int4 unless wide; None: not carried.
        ``rows``: the rows the graph keeps (a table padded beyond the tokenizer keeps the tokenizer's)."""
        from specdec.export.kquant import narrowed

        found = self.weights.grid(name)
        if found is None:
            return None
        kind, grid = found
        grid = _first_rows(grid, rows)
        keep = self.plan.method == "gguf" or self._wide(block_role(name), layer) or (
            head and self.plan.lm_head_bits == 8)
        if grid.bits == 8 and not keep:
            grid = narrowed(grid, self.plan.float_scales)
            self._count(f"carried {kind}, rounded to 4 bits")
        else:
            self._count(f"carried {kind}")
        return grid, kind

    @staticmethod
    def _runs(grids: list) -> list:
        """Grids side by side: one Packed per run of equal width (gguf_blocks.join_runs)."""
        return [pack_grid(grid) for grid, _ in join_runs([(kind, grid) for grid, kind in grids])]


def _first_rows(grid, rows: int):
    """``grid`` (a gguf_blocks.Grid) cut to its first ``rows`` rows."""
    from dataclasses import replace

    if grid.q.shape[0] == rows:
        return grid
    return replace(grid, q=grid.q[:rows], scale=grid.scale[:rows], zero=grid.zero[:rows],
                   correction=None if grid.correction is None else grid.correction[:rows])


__all__ = ["Packed", "WeightPlan", "WeightQuantizer", "block_role", "use_more_bits"]
