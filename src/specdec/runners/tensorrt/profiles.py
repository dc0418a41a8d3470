"""TensorRT optimization profiles for a bundle's graphs (pure: no TensorRT needed to compute them).

Three profiles per model, each over past lengths 0..max_context - 1:
  decode   T = 1                       (target-only steps, draft steps)
  verify   T = 1..max_verify           (chain verify gamma + 1, tree verify tree size + 1)
  prefill  T = 1..max_prefill          (prompt chunks)
Each profile gives (min, opt, max) shapes for every dynamic input of the graph contract.
Any pass with past + T <= max_context must fit its profile: a verify pass of a few tokens runs
in the last slots of the context, so no profile may cap the past at max_context - (its max T).
TensorRT checks the graph's shape constraints (total = past + new) at each corner, so the max
corner's total is max_context - 1 + max T: a bound for memory planning, never a shape that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.contract.manifest import ModelSpec


@dataclass(frozen=True)
class ProfileLimits:
    max_context: int = 2048
    max_verify: int = 16
    max_prefill: int = 64

    def __post_init__(self):
        if not (1 <= self.max_verify <= self.max_prefill < self.max_context):
            raise ValueError("profile limits need 1 <= max_verify <= max_prefill < max_context")


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict  # input name -> (min shape, opt shape, max shape)


def _shapes(spec: ModelSpec, new: tuple, past: tuple) -> dict:
    """new/past: (min, opt, max) token counts."""
    shapes = {}
    for tensor in spec.inputs:
        triple = []
        for index in range(3):
            dims = []
            for dim in tensor.shape:
                if dim == "batch":
                    dims.append(1)
                elif dim == "new_tokens":
                    dims.append(new[index])
                elif dim == "past_tokens":
                    dims.append(past[index])
                elif dim == "total_tokens":
                    dims.append(new[index] + past[index])
                else:
                    dims.append(int(dim))
            triple.append(tuple(dims))
        shapes[tensor.name] = tuple(triple)
    return shapes


def build_profiles(spec: ModelSpec, limits: ProfileLimits) -> list:
    context = min(limits.max_context, spec.max_positions)
    opt_past = min(512, context // 2)
    rows = (
        ("decode", (1, 1, 1)),
        ("verify", (1, min(5, limits.max_verify), limits.max_verify)),
        ("prefill", (1, limits.max_prefill, limits.max_prefill)),
    )
    return [
        Profile(name, _shapes(spec, new, (0, opt_past, context - new[0])))
        for name, new in rows
    ]


def profile_for(profiles: list, new_tokens: int) -> int:
    """Index of the smallest profile that accepts ``new_tokens`` new tokens."""
    for index, profile in enumerate(profiles):
        low, _, high = profile.shapes["input_ids"]
        if low[1] <= new_tokens <= high[1]:
            return index
    raise ValueError(f"no engine profile takes {new_tokens} new tokens in one pass")
