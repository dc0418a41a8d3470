"""The one table of request and pass limits, shared by the API, the CLI, the bench, the server and every runner.

A runner sizes its buffers and optimization profiles from these; ``decoding.request.make_request``
checks a request against them; the server's wire model takes its bounds from here too.
"""

MAX_DRAFT_TOKENS = 16  # longest fixed draft chain a request may ask for
AUTO_MAX_DRAFT_TOKENS = 8  # longest chain the "auto" planner proposes
PREFILL_CHUNK = 64  # tokens per prefill pass: bounds the logits buffer at chunk x vocab floats
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
