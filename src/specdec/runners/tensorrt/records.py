"""Engine records in the manifest, and the checks made before any engine is deserialized.

A TensorRT engine is executable code for one GPU architecture and one TensorRT version. It is
loaded only when the manifest records it, its sha256 matches, and the TensorRT version and
compute capability of this machine are the ones it was built for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specdec.contract.bundle import sha256_file, inside
from specdec.contract.manifest import BundleError, Manifest


@dataclass(frozen=True)
class EngineRecord:
    file: str  # relative to the bundle
    sha256: str
    tensorrt_version: str
    compute_capability: str  # e.g. "8.7" (Jetson Orin), "9.0" (H100/H200)
    profiles: tuple  # profile names in engine order
    max_context: int
    max_verify: int
    max_prefill: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "EngineRecord":
        try:
            return EngineRecord(**{**data, "profiles": tuple(data["profiles"])})
        except (TypeError, KeyError) as exc:
            raise BundleError(f"manifest engine record is malformed: {exc}") from None


def require_standard_form(spec) -> None:
    """TensorRT builds only the portable standard-form graph; a fused (onnxruntime contrib ops) one is refused."""
    if spec.graph != "standard":
        raise BundleError(f"the {spec.role} graph is the fused onnxruntime form (GroupQueryAttention), which TensorRT "
                          "cannot build: export the bundle with --graph standard for TensorRT")


@dataclass(frozen=True)
class DeviceInfo:
    tensorrt_version: str
    compute_capability: str


def verified_engine(bundle_dir: str | Path, manifest: Manifest, role: str, device: DeviceInfo) -> tuple[Path, EngineRecord]:
    """Path of the role's engine after every check; raises BundleError otherwise. Never deserializes."""
    root = Path(bundle_dir)
    require_standard_form(manifest.models()[role])
    if role not in manifest.engines:
        raise BundleError(f"the bundle has no TensorRT engine for the {role}: build one with specdec-export build-engine")
    record = EngineRecord.from_dict(manifest.engines[role])
    path = inside(root, record.file)
    if manifest.files.get(record.file) != record.sha256:
        raise BundleError(f"engine {record.file} is not hashed consistently in manifest.json: refused")
    if not path.is_file():
        raise BundleError(f"engine {record.file} is missing: rebuild it with specdec-export build-engine")
    if sha256_file(path) != record.sha256:
        raise BundleError(f"engine {record.file} does not match its sha256 in manifest.json: refused (never deserialized)")
    if record.tensorrt_version != device.tensorrt_version:
        raise BundleError(
            f"engine {record.file} was built with TensorRT {record.tensorrt_version}, this machine has "
            f"{device.tensorrt_version}: rebuild it here with specdec-export build-engine"
        )
    if record.compute_capability != device.compute_capability:
        raise BundleError(
            f"engine {record.file} was built for compute capability {record.compute_capability}, this GPU is "
            f"{device.compute_capability}: rebuild it here with specdec-export build-engine"
        )
    return path, record
