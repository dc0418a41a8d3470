"""Argument groups shared by the runtime's commands (generate, chat, infill, serve, bench), and the one place
their generation flags become a ``GenerationOptions``."""

from __future__ import annotations

import argparse

from specdec.runners.backends import backend_names


def _draft_tokens(value: str):
    return value if value == "auto" else int(value)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--acceptance", default="coupled", choices=["coupled", "rejection"],
                        help="sampled proposals: coupled (seeded output = target-only's, the default) or rejection "
                             "(modified rejection sampling)")


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags and where proposals come from: what ``generation_options`` reads."""
    from specdec.decoding.proposers import proposer_entries

    add_sampling_args(parser)
    parser.add_argument("--draft-tokens", type=_draft_tokens, default="auto",
                        help="proposals per round: auto (default), a number, or 0 = target only")
    entries = proposer_entries()
    parser.add_argument("--proposer", default=None, choices=list(entries),
                        help="; ".join(f"{name}: {entry.help}" for name, entry in entries.items())
                        + " (default: hybrid; suffix for a bundle without a draft)")
    parser.add_argument("--tree", default=None, help="draft tree shape, e.g. 2,2,1, or auto")


def generation_options(args, **changes):
    """The ``GenerationOptions`` of the flags ``add_generation_args`` added (``changes`` on top)."""
    from specdec.decoding.options import GenerationOptions
    from specdec.sampling.processors import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty)
    return GenerationOptions(max_new_tokens=args.max_new_tokens, sampling=sampling,
                             num_draft_tokens=args.draft_tokens, seed=args.seed, proposer=args.proposer,
                             tree=args.tree, acceptance=args.acceptance).replace(**changes)


def add_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", default="cpu", choices=backend_names(),
                        help="where the bundle runs (runners/backends/; default: cpu)")
    parser.add_argument("--max-context", type=int, default=None, help="KV cache size in tokens (default: the model's trained context, capped by free memory; "
                             "the choice is logged)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle files")
    parser.add_argument("--weight-form", default=None, choices=["nbits", "int8"],
                        help="which of the target's weight forms to run when the bundle carries several (default: the "
                             "one this machine measured faster on its first load; the choice is logged)")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--exact-rows", dest="exact_rows", action="store_const", const=True, default=None,
                      help="always run the target's one-token passes as two rows (default: only on a CPU whose "
                           "one-row int4 kernel rounds unlike the multi-row one, found at load, so greedy "
                           "speculation stays token-identical to target-only)")
    rows.add_argument("--no-exact-rows", dest="exact_rows", action="store_const", const=False,
                      help="never: one-token passes as one row even where they round otherwise (faster there; greedy "
                           "speculation may then part from target-only on near-ties)")
