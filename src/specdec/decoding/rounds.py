"""One target pass verifies a round's proposal: a plain function of explicit inputs, returning a ``RoundResult``.

Legend (chain):
  tokens     the committed sequence (prompt + output); its last token is *pending*: the target
             has not yet seen it, so its logits are unknown
  proposals  gamma tokens proposed after ``tokens`` (by any proposer: decoding/proposers)
  rows       target logits for [pending, p_1 .. p_gamma]: row i scores the token after p_1..p_i,
             row i checks p_{i+1}, row gamma gives the bonus token
The target's feed is ``tokens[target.length:]`` (the pending token, plus rows a tree gave back) followed by
the proposals. After acceptance the target's cache keeps only rows of committed tokens (``commit`` /
``keep_path``): rollback is moving a length. A round emits the accepted proposals plus one target token
(recovered or bonus). A proposal that is a tree is verified in one pass with a tree mask. What the proposer's
own caches keep is the proposer's business (its ``observe``).

The runners passed in are already timed (runners/timing.py): no timing happens here.
"""

from __future__ import annotations

from specdec.contract.limits import PREFILL_CHUNK, prefill_width, refeed_room
from specdec.decoding.proposers.base import Proposal, RoundResult
from specdec.decoding.tree import ROOT, DraftTree


def catch_up(runner, tokens: list, leave: int = 2, after_chunk=None) -> None:
    """Feed, in chunks, the tokens the runner's cache lacks, leaving at most the last ``leave`` for the next pass
    (chunks narrow deep in a long prompt: ``prefill_width``). ``after_chunk(length)``: called after each chunk
    with the tokens the cache then holds."""
    while runner.length < len(tokens) - leave:
        width = min(prefill_width(runner.length), runner.exact_width or PREFILL_CHUNK)
        chunk = tokens[runner.length : min(len(tokens) - leave, runner.length + width)]
        runner.forward(chunk, range(runner.length, runner.length + len(chunk)), last_logits_only=True)
        runner.commit(len(chunk))
        if after_chunk is not None:
            after_chunk(runner.length)


def _leave(target, candidates: int) -> int:
    """Committed tokens the target lacks that a verify pass of ``candidates`` proposals carries (the rest go in
    catch-up chunks first): ``refeed_room``, kept so the pass stays within the target's exact width when it can."""
    room = refeed_room(candidates)
    return room if target.exact_width is None else max(1, min(room, target.exact_width - candidates))


def verify(target, state, rule, proposal: Proposal | None) -> RoundResult:
    """Verify ``proposal`` (None: propose nothing, a plain target step) in ONE target pass and accept."""
    if proposal is None or proposal.shape == "chain":
        return verify_chain(target, state, rule, proposal)
    base = len(state.tokens)
    path, next_token = verify_tree(target, state, rule, proposal.tree)
    tree = proposal.tree
    accepted = [tree.tokens[n] for n in path]
    return RoundResult(proposal.source, accepted + [next_token], max(tree.depths, default=0), len(path),
                       tuple(path), base, len(tree.tokens))


def verify_chain(target, state, rule, proposal: Proposal | None) -> RoundResult:
    tokens = state.tokens
    proposals = list(proposal.tree.tokens) if proposal is not None else []
    if proposal is None or proposal.tree.deterministic:
        draft_dists = rule.sampled_rows(proposals, state.vocab_size)
    else:
        draws = proposal.tree.draw_dists
        draft_dists = [draws[i] for i in range(len(proposals)) if i in draws]
    catch_up(target, tokens, leave=_leave(target, len(proposals)))
    feed = tokens[target.length :] + proposals
    logits = target.forward(feed, range(target.length, target.length + len(feed)))
    rows = logits[len(feed) - len(proposals) - 1 :]  # [gamma + 1, V]
    contexts = [state.context(proposals[:i]) for i in range(len(proposals) + 1)]
    accepted, next_token = rule.verify_chain(rows, contexts, proposals, draft_dists, len(tokens))
    target.commit(len(feed) - len(proposals) + accepted)
    source = proposal.source if proposal is not None else "none"
    return RoundResult(source, proposals[:accepted] + [next_token], len(proposals), accepted,
                       tuple(range(accepted)), len(tokens))


def verify_tree(target, state, rule, tree: DraftTree) -> tuple[list, int]:
    """Verify ``tree`` (children of the pending token and their descendants) in ONE target pass, accept one
    path, and compact the target's cache to it. Returns (accepted node indices, recovered or bonus token)."""
    tokens = state.tokens
    catch_up(target, tokens, leave=_leave(target, len(tree.tokens)))
    prefix = tokens[target.length :]
    start = target.length
    root_row = len(prefix) - 1
    feed = prefix + tree.tokens
    parents = list(range(-1, len(prefix) - 1)) + [root_row if p == ROOT else len(prefix) + p for p in tree.parents]
    positions = list(range(start, start + len(prefix))) + [start + root_row + d for d in tree.depths]
    logits = target.forward(feed, positions, parents=parents)

    def path_tokens(expansion):
        return [] if expansion == 0 else [tree.tokens[n] for n in tree.path_to(expansion - 1)]

    path, next_token = rule.verify_tree(
        tree,
        row=lambda e: logits[root_row + e],
        context_at=lambda e: state.context(path_tokens(e)),
        position_at=lambda e: len(tokens) + (0 if e == 0 else tree.depths[e - 1]),
    )
    # KV compaction: the accepted path's rows move next to the committed ones; nothing else moves
    target_first = start + len(prefix)
    target.keep_path([target_first + n for n in path], target_first)
    redo = target.first_inexact(target_first)
    if redo is not None:
        # a node that skipped an earlier sibling saw a mask other than a chain's: its row is never offered to a
        # later request (Runner.held_prefix), so a chat's next turn would compute everything from it again.
        # Give such rows back: the next pass recomputes them as chain rows, beside its own proposals
        target.truncate(redo)
    return path, next_token
