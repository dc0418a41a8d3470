"""A bundle whose target's 4-bit MatMulNBits weights hold larger blocks with integer zero points: fewer bytes a pass.

    python tools/inputs/reblock.py BUNDLE OUT [--block 64] [--roles gate_up,down,qkv,o_proj] [--importance rms|square]

onnxruntime's CPU MatMulNBits at accuracy level 4 packs a block of ``b`` 4-bit weights with a float32 scale and a
float32 block sum (MLAS ``SQNBitGemm``, int8 compute; a 4-bit zero point folds into the sum): ``b / 2 + 8`` bytes, 6
bits per weight at block 32, 5 at 64, 4.5 at 128. The carried GGUF blocks (``gguf-int4``) are blocks of 32 with
their float minimum as extra input rows (``export/gguf_carry.py``), ~6.5 bits a weight where K is 1,536. A one-token
pass that is bandwidth-bound costs its bytes, so this writes the chosen roles' weights again at ``--block``:

- each weight's effective float values (its codes times scales, plus the correction rows' minimum) are cut into
  blocks of ``--block`` along K;
- every block gets a scale and a 4-bit zero point by a search as llama.cpp's ``make_qkx2_quants`` (21 candidate
  scales ``(max - min) / (15 + 0.1 i - 1)``, each refitted by weighted least squares with its zero point held),
  weights' importance ``rms(block) + |w|`` (``--importance square``: ``w^2``);
- the node reads the activation itself (no block sums), and the graph's unread nodes are dropped.

OUT holds the draft and tokenizer as copied, the target in this one form (the bundle's other weight forms are not
copied), and a manifest with fresh hashes; ``specdec eval OUT --role target`` and ``tools/measure/pass_ab.py``
measure it. A screen, not an export recipe: it rounds the GGUF's values a second time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specdec.contract.manifest import MANIFEST_NAME, Manifest
from specdec.export.bundle import hash_tree
from specdec.export.gguf_blocks import BLOCK, pack_zero_points

STEPS = 20  # candidates 0..STEPS, as make_qkx2_quants' nstep
ROWS = 1 << 15  # blocks searched at a time


def dequantized(model, node) -> tuple[np.ndarray, str]:
    """The node's effective weight [N, K] float32 and the activation it should read (the block sums dropped)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inits = {i.name: i for i in model.graph.initializer}
    n, k_in, block = attrs["N"], attrs["K"], attrs["block_size"]
    data = numpy_helper.to_array(inits[node.input[1]]).reshape(n, -1)
    codes = np.empty((n, data.shape[1] * 2), np.float32)
    codes[:, 0::2], codes[:, 1::2] = data & 15, data >> 4
    codes = codes[:, :k_in]
    scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1)
    if len(node.input) > 3 and node.input[3]:
        packed = numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1)
        zero = np.empty((n, packed.shape[1] * 2), np.float32)
        zero[:, 0::2], zero[:, 1::2] = packed & 15, packed >> 4
        zero = zero[:, :scales.shape[1]]
    else:
        zero = np.full(scales.shape, 8, np.float32)
    weight = (codes.reshape(n, -1, block) - zero[..., None]) * scales[..., None]
    weight = weight.reshape(n, -1)[:, :k_in]
    producer = {out: p for p in model.graph.node for out in p.output}.get(node.input[0])
    if producer is None or producer.op_type != "Concat" or len(producer.input) != 3:
        return weight, node.input[0]
    # the augmented input is [x (K), sums (Cp), sums (Cp)] with Cp = K/32 padded to whole blocks of 32
    k = next(k for k in range(k_in - BLOCK, 0, -BLOCK) if k + 2 * (-(-(k // BLOCK) // BLOCK) * BLOCK) == k_in)
    padded = (k_in - k) // 2
    per_block = weight[:, k:k + padded] + weight[:, k + padded:k + 2 * padded]  # [N, Cp]
    effective = weight[:, :k] + np.repeat(per_block[:, :k // BLOCK], BLOCK, axis=1)
    return effective.astype(np.float32), producer.input[0]


def requantized(weight: np.ndarray, block: int, importance: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [N, K] -> (codes [N, K] uint8 0..15, scales [N, K/block] float32, zero points [N, K/block] uint8)."""
    import torch

    n, k = weight.shape
    flat = torch.from_numpy(np.ascontiguousarray(weight)).reshape(-1, block)
    codes = torch.empty(flat.shape, dtype=torch.uint8)
    scales, zeros = torch.empty(flat.shape[0]), torch.empty(flat.shape[0])
    with torch.no_grad():
        for start in range(0, flat.shape[0], ROWS):
            x = flat[start:start + ROWS]
            w = x * x if importance == "square" else torch.sqrt((x * x).mean(-1, keepdim=True)) + x.abs()
            low, high = x.amin(-1), x.amax(-1)
            span = torch.where(high > low, high - low, torch.ones_like(high))
            best_err = torch.full_like(low, float("inf"))
            best_s, best_z, best_q = torch.zeros_like(low), torch.zeros_like(low), torch.zeros_like(x)
            for step in range(STEPS + 1):
                s = span / (15.0 - 1.0 + 0.1 * step)
                z = torch.clamp(torch.round(-low / s), 0, 15)
                q = torch.clamp(torch.round(x / s[:, None]) + z[:, None], 0, 15)
                centred = q - z[:, None]
                denominator = (w * centred * centred).sum(-1)
                fitted = torch.where(denominator > 0, (w * x * centred).sum(-1) / denominator.clamp_min(1e-30), s)
                err = (w * (fitted[:, None] * centred - x) ** 2).sum(-1)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s, best_z = torch.where(better, fitted, best_s), torch.where(better, z, best_z)
                best_q = torch.where(better[:, None], q, best_q)
            constant = high <= low  # every weight the same: zero point 8, the value at code 8 +- 7
            best_s = torch.where(constant, torch.where(low != 0, low.abs() / 7, torch.ones_like(low)), best_s)
            best_z = torch.where(constant, torch.full_like(low, 8), best_z)
            best_q[constant] = (8 + 7 * torch.sign(low[constant]))[:, None]
            codes[start:start + ROWS], scales[start:start + ROWS], zeros[start:start + ROWS] = best_q, best_s, best_z
    return (codes.numpy().reshape(n, k), scales.numpy().reshape(n, k // block).astype(np.float32),
            zeros.numpy().reshape(n, k // block).astype(np.uint8))


def rewrite(model, roles: set, block: int, importance: str) -> list:
    """Rewrites the target's 4-bit MatMulNBits of ``roles`` in place; returns (name, K, N) of each."""
    done = []
    for index, node in enumerate(list(model.graph.node)):
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        role = node.name.split("/")[1].split(".")[0] if "/" in node.name else node.name
        if attrs["bits"] != 4 or role not in roles:
            continue
        weight, x = dequantized(model, node)
        n, k = weight.shape
        codes, scales, zeros = requantized(weight, block, importance)
        data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, k // block, block // 2)
        prefix = node.name.rsplit("/", 1)[0] + f".b{block}"
        model.graph.initializer.extend([numpy_helper.from_array(data, f"{prefix}.weight_q4"),
                                        numpy_helper.from_array(scales, f"{prefix}.scales"),
                                        numpy_helper.from_array(pack_zero_points(zeros, 4), f"{prefix}.zero_points")])
        new = helper.make_node("MatMulNBits", [x, f"{prefix}.weight_q4", f"{prefix}.scales", f"{prefix}.zero_points"],
                               list(node.output), name=node.name, domain="com.microsoft", K=k, N=n, bits=4,
                               block_size=block, accuracy_level=attrs.get("accuracy_level", 4))
        model.graph.node.remove(node)
        model.graph.node.insert(index, new)
        done.append((node.name, k, n))
    return done


def names_read(nodes) -> set:
    """Every tensor name the nodes read, those read inside their subgraphs (If, Scan, Loop bodies) included."""
    read = set()
    for node in nodes:
        read.update(node.input)
        for attribute in node.attribute:
            for graph in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
                read |= names_read(graph.node)
    return read


def prune(model) -> None:
    """Drops nodes nothing reads (the block sums no node needs now) and initializers no node reads."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = outputs | names_read(model.graph.node)
        dead = [node for node in model.graph.node if not any(o in read for o in node.output)]
        if not dead:
            break
        for node in dead:
            model.graph.node.remove(node)
    read = names_read(model.graph.node)
    for init in [i for i in model.graph.initializer if i.name not in read]:
        model.graph.initializer.remove(init)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--block", type=int, default=64, choices=[32, 64, 128, 256])
    parser.add_argument("--roles", default="gate_up,down,qkv,o_proj",
                        help="node roles to write again (the word after 'layers.N/' in a node's name; 'lm_head')")
    parser.add_argument("--importance", choices=["rms", "square"], default="rms")
    args = parser.parse_args()
    if args.out.exists():
        print(f"reblock: error: {args.out} exists", file=sys.stderr)
        return 2
    manifest = Manifest.read(args.bundle)
    spec = manifest.target
    if spec.quant != "int4" or spec.graph != "fused":
        print("reblock: error: give an int4 bundle in the fused form", file=sys.stderr)
        return 2
    started = time.monotonic()
    onnx_path = args.bundle / spec.onnx_file
    model = onnx.load(str(onnx_path))
    done = rewrite(model, set(args.roles.split(",")), args.block, args.importance)
    prune(model)
    staging = args.out.with_name(f".{args.out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    folders = {Path(spec.onnx_file).parts[0], *(Path(path).parts[0] for _, path in spec.weight_forms)}
    shutil.copytree(args.bundle, staging, ignore=lambda folder, names: folders if Path(folder) == args.bundle else [])
    (staging / spec.onnx_file).parent.mkdir(parents=True)
    onnx.save(model, str(staging / spec.onnx_file), save_as_external_data=True, all_tensors_to_one_file=True,
              location=Path(spec.onnx_file).name + ".data")
    new = replace(manifest, target=replace(spec, weight_forms=()), files=hash_tree(staging),
                  extra={**manifest.extra, "reblock": {"block": args.block, "roles": args.roles,
                                                       "importance": args.importance, "nodes": len(done)}})
    (staging / MANIFEST_NAME).write_text(new.to_json())
    staging.rename(args.out)
    print(f"reblock: {len(done)} products at block {args.block} ({args.roles}) in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
