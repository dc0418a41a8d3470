"""``specdec info``: what a bundle holds, and what loads of it measured and chose on this machine (the weight form
and why, the row checks, the pass costs), read from the manifest and the cache folder's stores; nothing is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.contract.bundle import cache_dir, inside
from specdec.contract.manifest import Manifest
from specdec.contract.onnx_paths import one_token_bytes
from specdec.decoding.calibration_store import bundle_identity, cpu_model, stored_here


def add_info_parser(commands) -> None:
    parser = commands.add_parser("info", help="what a bundle holds and what this machine measured and chose for it")
    parser.add_argument("bundle")
    parser.add_argument("--json", action="store_true", help="print it as JSON")


def _size(root: Path, onnx_file: str) -> int:
    """Bytes on disk of a model's graph and its external data (the files beside it that it names)."""
    graph = inside(root, onnx_file)
    return sum(path.stat().st_size for path in graph.parent.iterdir() if path.name.startswith(graph.name))


def describe_models(root: Path, manifest: Manifest) -> dict:
    models = {}
    for role, spec in manifest.models().items():
        forms = dict(spec.weight_forms) or {"one form": spec.onnx_file}
        models[role] = {"architecture": spec.architecture, "layers": spec.num_layers, "hidden": spec.hidden_size,
                        "vocab": spec.vocab_size, "quant": spec.quant, "graph": spec.graph,
                        "attention": spec.attention, "kv_dtype": spec.kv_dtype, "max_positions": spec.max_positions,
                        "weight_forms": {form: {"file": path, "bytes": _size(root, path),
                                                "one_token_bytes": one_token_bytes(inside(root, path).read_bytes())[
                                                    "streamed"]} for form, path in forms.items()}}
    return models


def _ms(seconds) -> str:
    return f"{1000 * seconds:.1f} ms"


def describe_entry(kind: str, key: dict, entry: dict) -> str:
    """One line for a stored finding."""
    threads = f"{key.get('threads')} threads"
    beside = entry.get("other_cores") or 0
    noisy = f", measured beside {beside:.2f} other cores (measured again when the machine is quiet)" if beside > 0.1 else ""
    if kind == "checks" and key.get("checks") == "weight_form":
        forms = "; ".join(f"{form} {entry['turn_seconds'][form]:.2f} s (" + ", ".join(
            f"{width}: {_ms(cost)}" for width, cost in sorted(costs.items(), key=lambda item: int(item[0]))) + ")"
            for form, costs in entry.get("costs", {}).items() if form in entry.get("turn_seconds", {}))
        return f"weight form ({threads}): runs {entry.get('form')}; reference turn {forms}{noisy}"
    if kind == "checks" and key.get("checks") == "rows":
        form = f" of {key['form']}" if key.get("form") else ""
        one = entry.get("one_row")
        exact = ("a one-token pass gives a verify row bit for bit" if one == 0 else
                 f"a one-token pass differs from a verify row by up to {one:g}: padded to two rows unless --no-exact-rows")
        scope = f", passes up to {key['step_tokens']} tokens" if key.get("step_tokens") else ""
        return (f"row checks{form} ({threads}{scope}{', deep cache' if key.get('deep') else ''}): {exact}; "
                f"passes up to {entry.get('exact_width')} tokens write the rows decoding writes")
    if kind == "costs":
        verify = entry.get("verify") or []
        ratios = ", ".join(f"T={t + 1}: {cost / verify[0]:.2f}x" for t, cost in enumerate(verify[:5])) if verify else "-"
        form = f" of {key['form']}" if key.get("form") else ""
        return (f"pass costs{form} ({threads}, {key.get('context')} cached tokens): target one token "
                f"{_ms(verify[0]) if verify else '-'}, {ratios}; draft step {_ms(entry.get('draft_step', 0))}{noisy}")
    return f"{kind} {json.dumps(key, sort_keys=True)}: {json.dumps(entry)[:200]}"


def cmd_info(args) -> int:
    root = Path(args.bundle)
    manifest = Manifest.read(root)
    identity = bundle_identity(manifest)  # the key loads store their findings under
    models = describe_models(root, manifest)
    found = stored_here(identity)
    if args.json:
        print(json.dumps({"bundle": str(root), "identity": identity, "models": models, "cpu": cpu_model(),
                          "cache": str(cache_dir()),
                          "stored": [{"kind": kind, "key": key, "entry": entry} for kind, key, entry in found]},
                         indent=1))
        return 0
    print(f"{root}: bundle format {manifest.format_version}, identity {identity[:16]}")
    for role, model in models.items():
        forms = ", ".join(f"{form} ({item['file']}, {item['bytes'] / 2**30:.2f} GiB; a one-token pass reads "
                          f"{item['one_token_bytes'] / 2**20:,.0f} MiB)"
                          for form, item in model["weight_forms"].items())
        print(f"  {role}: {model['architecture']}, {model['layers']} layers, hidden {model['hidden']}, vocab "
              f"{model['vocab']}, {model['quant']}, {model['graph']} graph, {model['attention']} attention, "
              f"{model['kv_dtype']} KV, {model['max_positions']} positions; weight forms: {forms}")
    print(f"on this machine ({cpu_model()}; stores in {cache_dir()}):")
    if not found:
        print("  nothing measured yet: the first load times the weight forms, checks the rows and measures pass costs")
    for kind, key, entry in sorted(found, key=lambda item: (item[0] != "checks", json.dumps(item[1], sort_keys=True))):
        print("  " + describe_entry(kind, key, entry))
    return 0
