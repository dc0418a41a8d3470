"""Build TensorRT engines from a bundle's portable ONNX graphs (GPU machine with TensorRT).

Strongly typed networks: precision comes from the ONNX types (TensorRT 11 removed the
builder precision flags; 10.x, which JetPack 6 ships, supports STRONGLY_TYPED too). One engine
per model with three optimization profiles (``profiles.py``). The engine's sha256, TensorRT
version and compute capability go into the manifest, which is rewritten atomically.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from specdec.contract.bundle import sha256_file, open_bundle
from specdec.contract.manifest import MANIFEST_NAME, BundleError, Manifest

from specdec.runners.tensorrt.profiles import ProfileLimits, build_profiles
from specdec.runners.tensorrt.records import DeviceInfo, EngineRecord, require_standard_form


def _tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise ValueError("TensorRT is not installed: pip install tensorrt (on Jetson use JetPack's python3-libnvinfer)") from None
    return tensorrt


def current_device() -> DeviceInfo:
    """TensorRT version and compute capability of GPU 0 (cuda-python)."""
    trt = _tensorrt()
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise ValueError("cuda-python is not installed: pip install cuda-python") from None
    err, props = cudart.cudaGetDeviceProperties(0)
    if int(err) != 0:
        raise ValueError(f"no usable CUDA device (cudaGetDeviceProperties returned {err})")
    return DeviceInfo(tensorrt_version=trt.__version__, compute_capability=f"{props.major}.{props.minor}")


def check_engine_ready(spec) -> None:
    require_standard_form(spec)
    if spec.quant not in ("none", "int4-qdq"):
        raise ValueError(
            f"the {spec.role} graph uses onnxruntime's MatMulNBits ({spec.quant}), which TensorRT cannot parse: "
            "build engines from a --quant int4-qdq bundle (int4 weight-only) or a --quant none one (float16 recommended)"
        )


def build_engines(bundle_dir: str | Path, limits: ProfileLimits = ProfileLimits(), workspace_bytes: int = 2 << 30,
                  progress=print) -> Manifest:
    root = Path(bundle_dir)
    manifest = open_bundle(root)
    for spec in manifest.models().values():  # refuse what TensorRT cannot build before needing TensorRT
        check_engine_ready(spec)
    trt = _tensorrt()
    device = current_device()
    logger = trt.Logger(trt.Logger.WARNING)
    records, files = {}, dict(manifest.files)
    for role, spec in manifest.models().items():
        check_engine_ready(spec)
        progress(f"{role}: parsing {spec.onnx_file}")
        builder = trt.Builder(logger)
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(root / spec.onnx_file)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BundleError(f"TensorRT could not parse {spec.onnx_file}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
        profiles = build_profiles(spec, limits)
        for profile in profiles:
            trt_profile = builder.create_optimization_profile()
            for name, (low, opt, high) in profile.shapes.items():
                trt_profile.set_shape(name, low, opt, high)
            config.add_optimization_profile(trt_profile)
        progress(f"{role}: building the engine ({', '.join(p.name for p in profiles)} profiles)")
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BundleError(f"TensorRT failed to build an engine for the {role}")
        relative = f"engines/{role}.engine"
        path = root / relative
        path.parent.mkdir(exist_ok=True)
        partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
        partial.write_bytes(bytes(serialized))
        os.replace(partial, path)
        digest = sha256_file(path)
        files[relative] = digest
        records[role] = EngineRecord(
            file=relative, sha256=digest, tensorrt_version=device.tensorrt_version,
            compute_capability=device.compute_capability, profiles=tuple(p.name for p in profiles),
            max_context=limits.max_context, max_verify=limits.max_verify, max_prefill=limits.max_prefill,
        ).to_dict()
    updated = dataclasses.replace(manifest, files=files, engines={**manifest.engines, **records})
    write_manifest(root, updated)
    return updated


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Replace manifest.json atomically."""
    partial = root / f".{MANIFEST_NAME}.partial-{os.getpid()}"
    partial.write_text(manifest.to_json())
    os.replace(partial, root / MANIFEST_NAME)
