"""Streaming code completion: type a code prefix, watch the completion arrive as rounds are accepted.

usage: python examples/stream_complete.py BUNDLE [--temperature T] [--max-new-tokens N]
Reads prompts from stdin (end each with an empty line); Ctrl-D quits.
"""

import argparse
import sys

from specdec import GenerationStats, SamplingConfig, SpeculativeDecoder


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    decoder = SpeculativeDecoder.load(args.bundle)
    sampling = SamplingConfig(temperature=args.temperature)
    lines = []
    for line in sys.stdin:
        if line.strip():
            lines.append(line)
            continue
        if not lines:
            continue
        prompt, lines = "".join(lines), []
        stats = GenerationStats()
        sys.stdout.write(prompt)
        for piece in decoder.stream(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                    num_draft_tokens=args.draft_tokens, stop=["\n\n\n"], stats=stats):
            sys.stdout.write(piece)
            sys.stdout.flush()
        print(f"\n--- {stats.summary()}\n", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
