"""The one table of request and pass limits, shared by the API, the CLI, the bench, the server and every runner.

A runner sizes its buffers and optimization profiles from these; ``decoding.request.make_request``
checks a request against them; the server's wire model takes its bounds from here too.
"""

MAX_DRAFT_TOKENS = 16  # longest fixed draft chain a request may ask for
AUTO_MAX_DRAFT_TOKENS = 8  # longest chain the "auto" planner proposes
PREFILL_CHUNK = 64  # tokens per prefill pass: bounds the logits buffer at chunk x vocab floats
# a prefill chunk's tokens x the cache columns its attention reads, at most: past 16k cached tokens chunks halve, so
# that their per-pass attention buffers (bias, scores) stay a 64-token chunk's at 16k. Measured on the 1.5B target at
# 26.6k cached tokens: 32-token chunks leave 43 MiB less resident than 64-token ones, at 1.06x the time per token
PREFILL_CELLS = 2**20
PREFILL_WIDTHS = (PREFILL_CHUNK, 32, 16)  # widths the load's row check (runners/row_parity.WIDTHS) covers
REFEED_ROWS = 8  # a verify pass feeds up to this many committed tokens its target lacks (rows a tree gave back)
MAX_TREE_NODES = 62  # one verify pass carries at most 64 tokens: the tree plus pending/catch-up
MAX_PASS_TOKENS = max(PREFILL_CHUNK, MAX_TREE_NODES + 2)  # the widest pass any runner must accept
MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


def refeed_room(candidates: int) -> int:
    """How many committed tokens the target lacks a verify pass of ``candidates`` proposals may feed: up to
    REFEED_ROWS (rows a tree gave back, and the pending token), within the widest pass a runner takes."""
    return max(1, min(REFEED_ROWS, MAX_PASS_TOKENS - candidates))


def prefill_width(depth: int) -> int:
    """Tokens in a prefill chunk after ``depth`` cached tokens: the widest of PREFILL_WIDTHS whose tokens x columns
    stay within PREFILL_CELLS (64 up to 16k cached tokens, 32 up to 32k), never below the narrowest. Rows are exact
    in every pass width the load checked, so the width changes memory and time, never a token."""
    fits = [width for width in PREFILL_WIDTHS if width * (max(depth, 0) + width) <= PREFILL_CELLS]
    return max(fits, default=PREFILL_WIDTHS[-1])
