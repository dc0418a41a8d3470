"""Will a bundle fit? Weights + KV cache at max context + buffers + workspace, against free memory.

On Jetson the GPU and CPU share one memory: the same budget applies to both, and it is the
usual reason a load fails half-way. The check runs before anything is allocated and says what
would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.contract.manifest import Manifest

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class MemoryBudgetError(ValueError):
    pass


@dataclass(frozen=True)
class Budget:
    weights: int
    kv_cache: int
    buffers: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.buffers + self.workspace


def kv_bytes_per_token(manifest: Manifest) -> int:
    return sum(2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * _ITEMSIZE[spec.kv_dtype]
               for spec in manifest.models().values())


def budget(bundle_dir: str | Path, manifest: Manifest, max_context: int, step_tokens: int = 64,
           workspace: int = 0) -> Budget:
    root = Path(bundle_dir)
    weights = sum((root / rel).stat().st_size for rel in manifest.files
                  if rel.startswith(("target/", "draft/")) and (root / rel).is_file())
    buffers = sum(step_tokens * spec.vocab_size * 4 + step_tokens * max_context for spec in manifest.models().values())
    return Budget(weights=weights, kv_cache=kv_bytes_per_token(manifest) * max_context, buffers=buffers,
                  workspace=workspace)


def check_fits(plan: Budget, manifest: Manifest, available: int, max_context: int, headroom: float = 0.9) -> None:
    """Raise MemoryBudgetError with a suggestion when ``plan`` exceeds ``headroom`` of ``available`` bytes."""
    limit = int(available * headroom)
    if plan.total <= limit:
        return
    gib = 1 << 30
    spare = limit - plan.weights - plan.buffers - plan.workspace
    per_token = kv_bytes_per_token(manifest)
    if spare > per_token * 256:
        hint = f"load with max_context={spare // per_token // 256 * 256} (fits), or export with --quant int4"
    else:
        hint = "the weights alone do not fit: export with --quant int4 (or a smaller draft/target)"
    raise MemoryBudgetError(
        f"bundle needs {plan.total / gib:.2f} GiB (weights {plan.weights / gib:.2f}, KV cache at {max_context} tokens "
        f"{plan.kv_cache / gib:.2f}, buffers {plan.buffers / gib:.2f}, workspace {plan.workspace / gib:.2f}) but only "
        f"{available / gib:.2f} GiB is free: {hint}"
    )


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux, including Jetson's unified memory); None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
