"""Will a bundle fit? Weights + KV caches at max context + buffers + workspace, against free memory; and the
default max context: the model's trained context, capped by what fits.

On Jetson the GPU and CPU share one memory: the same budget applies to both, and it is the
usual reason a load fails half-way. The check runs before anything is allocated and says what
would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.contract.manifest import Manifest, forms_of

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


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


CONTEXT_STEP = 256  # a default context is a multiple of this


def kv_bytes_per_token(manifest: Manifest) -> int:
    """Keys and values of one token in both models' caches (an int8 row adds its float32 scale)."""
    return sum(2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim * _ITEMSIZE[spec.kv_dtype] +
                                                          (4 if spec.kv_dtype == "int8" else 0))
               for spec in manifest.models().values())


def pass_bytes_per_token(manifest: Manifest, step_tokens: int) -> int:
    """Per token of context, what one pass of ``step_tokens`` rows holds besides the cache: the runner's mask and
    additive bias (1 + 4 bytes a row) and the attention's scores and probabilities (float32, every query head's
    rows) of both models."""
    total = 0
    for spec in manifest.models().values():
        heads = spec.num_kv_heads * max(2, spec.hidden_size // (spec.num_kv_heads * spec.head_dim))
        total += step_tokens * 5 + 2 * heads * step_tokens * 4
    return total


def model_weight_bytes(root: Path, manifest: Manifest, spec, onnx_file: str | None = None) -> int:
    """The bytes of a model's files (its ONNX folder's): of the weight form whose graph is ``onnx_file``, else of its
    largest form when it has several (a load runs one, which the budget may not know yet)."""
    sizes = []
    for path in [onnx_file] if onnx_file is not None else spec.files():
        folder = Path(path).parent.as_posix() + "/"
        sizes.append(sum((root / rel).stat().st_size for rel in manifest.files
                         if rel.startswith(folder) and (root / rel).is_file()))
    return max(sizes)


def smallest_form(bundle_dir: str | Path, manifest: Manifest) -> str:
    """The graph file of the target's weight form with the fewest bytes."""
    return min(forms_of(manifest.target).values(), key=lambda path: model_weight_bytes(Path(bundle_dir), manifest,
                                                                                     manifest.target, path))


def budget(bundle_dir: str | Path, manifest: Manifest, max_context: int, step_tokens: int = 64,
           workspace: int = 0, caches: int = 1, target_file: str | None = None) -> Budget:
    """``caches``: KV caches held at once (a server's workers each fork one); ``target_file``: the target's weight
    form (its graph file), else its largest."""
    root = Path(bundle_dir)
    weights = sum(model_weight_bytes(root, manifest, spec, target_file if role == "target" else None)
                  for role, spec in manifest.models().items())
    buffers = sum(step_tokens * spec.vocab_size * 4 for spec in manifest.models().values())
    buffers += caches * pass_bytes_per_token(manifest, step_tokens) * max_context
    return Budget(weights=weights, kv_cache=caches * kv_bytes_per_token(manifest) * max_context, buffers=buffers,
                  workspace=workspace)


def default_context(bundle_dir: str | Path, manifest: Manifest, available: int | None, step_tokens: int = 64,
                    reserved: int = 0, caches: int = 1, headroom: float = 0.9,
                    target_file: str | None = None) -> tuple[int, str]:
    """(max context, why): the trained context of the pair (the smaller max positions) when weights, ``caches`` KV
    caches at that context, pass buffers and ``reserved`` bytes (RAM prompt cache, suffix store) fit in
    ``headroom`` of ``available`` bytes; else the largest multiple of CONTEXT_STEP that does (at least one step:
    a load that cannot fit even that is refused by ``check_fits`` with what to do). Weights: the target's form
    ``target_file`` (a named one), else its smallest (a larger one runs only where it fits: ``fitting_forms``)."""
    trained = min(spec.max_positions for spec in manifest.models().values())
    gib = 1 << 30
    if available is None:
        return trained, f"the model's trained context {trained} (free memory unknown on this system)"
    form = target_file or smallest_form(bundle_dir, manifest)
    fixed = budget(bundle_dir, manifest, 0, step_tokens, target_file=form).total + reserved
    per_token = caches * (kv_bytes_per_token(manifest) + pass_bytes_per_token(manifest, step_tokens))
    fits = max(0, int(available * headroom) - fixed) // per_token // CONTEXT_STEP * CONTEXT_STEP
    kv = f"{kv_bytes_per_token(manifest) / 1024:.0f} KiB of KV per token x {caches} cache{'s' * (caches > 1)}"
    if fits >= trained:
        return trained, (f"the model's trained context {trained}: fits ({(fixed + per_token * trained) / gib:.2f} "
                         f"GiB with {kv}) in {available / gib:.2f} GiB free")
    chosen = max(fits, min(CONTEXT_STEP, trained))
    return chosen, (f"capped below the trained {trained} by memory: {available / gib:.2f} GiB free, weights and "
                    f"buffers {fixed / gib:.2f} GiB, {kv}; --max-context overrides")


def fitting_forms(bundle_dir: str | Path, manifest: Manifest, available: int | None, max_context: int,
                  step_tokens: int = 64, caches: int = 1, reserved: int = 0, headroom: float = 0.9) -> dict:
    """The target's weight forms ``{name: onnx file}`` whose budget at ``max_context`` (and ``reserved`` bytes: RAM
    caches) fits ``headroom`` of ``available`` bytes (every form when free memory is unknown), in the bundle's
    order."""
    forms = forms_of(manifest.target)
    if available is None:
        return forms
    return {name: path for name, path in forms.items()
            if budget(bundle_dir, manifest, max_context, step_tokens, reserved, caches, target_file=path).total
            <= int(available * headroom)}


def check_fits(plan: Budget, manifest: Manifest, available: int, max_context: int, headroom: float = 0.9,
               caches: int = 1) -> None:
    """Raise MemoryBudgetError with a suggestion when ``plan`` exceeds ``headroom`` of ``available`` bytes."""
    limit = int(available * headroom)
    if plan.total <= limit:
        return
    gib = 1 << 30
    spare = limit - plan.weights - plan.buffers - plan.workspace
    per_token = caches * kv_bytes_per_token(manifest)
    smaller = ("export with --quant int4" if any(spec.quant != "int4" for spec in manifest.models().values())
               else "a smaller draft/target")
    if spare > per_token * 256:
        hint = f"load with max_context={spare // per_token // 256 * 256} (fits), or {smaller}"
    else:
        hint = f"the weights alone do not fit: {smaller}"
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
