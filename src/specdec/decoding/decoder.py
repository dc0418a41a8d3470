"""The decoder: load a bundle, serve ``generate`` / ``stream`` requests through the speculative loop.

This module owns what outlives a request (the runners and their caches, the tokenizer, the
measured pass costs) and the loop that drives one request:

    options  = GenerationOptions(...)                  validated once (decoding/options.py)
    request  = make_request(codec, limits, prompt, options)   checked against the bundle (decoding/request.py)
    state    = RequestState(request, ...)              the sequence, randomness, text, stats
    proposer = make_proposer(request, resources)       where proposals come from (decoding/proposers/)
    rule     = TokenRule(sampling, acceptance, ...)    how rows become tokens (decoding/rules.py)
    prefill; then per round:
        proposal = proposer.propose(round)             a token tree (a chain is one), or None
        result   = verify(target, state, rule, proposal)   ONE target pass (decoding/rounds.py)
        proposer.observe(proposal, result)             its caches and estimates learn
        piece    = state.commit(result.tokens)         EOS / stop ids / stop strings / budget

Every pass goes through a ``TimedRunner`` (runners/timing.py) that feeds the stats and the proposer.
``generate`` is ``stream`` collected: the same tokens and the same text by construction.
``num_draft_tokens=0`` runs plain target-only decoding through the same code: the baseline.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from specdec.contract.bundle import default_hash_cache, inside, open_bundle
from specdec.contract.manifest import forms_of
from specdec.decoding.calibration_store import (OTHER_CORES_LIMIT, OtherLoad, bundle_identity, calibration_key,
                                                load_costs_entry, load_row_checks, machine_key, save_costs,
                                                save_row_checks)
from specdec.decoding.forms import check_wanted, choose_form, noisy_choice, quiet_since
from specdec.decoding.cost_model import CALIBRATION_CONTEXT, CalibrationStopped, Costs, ProbeBudget, calibrate
from specdec.runners.backends import backend
from specdec.runners.factory import backend_for, make_runner
from specdec.runners.standard import DEFERRED
from specdec.decoding.prompt_cache import PromptCache
from specdec.contract.limits import MAX_DRAFT_TOKENS, MAX_TREE_NODES, PREFILL_CHUNK
from specdec.decoding.options import GenerationError, GenerationOptions
from specdec.decoding.proposers import ProposerResources, RoundInput, make_proposer, proposer_entries
from specdec.decoding.request import (GenerationResult, GenerationStats, Limits, PrefillProgress, Request, RequestState,
                                      make_request)
from specdec.decoding.rounds import catch_up, verify
from specdec.decoding.suffix_store import DEFAULT_CACHE_MIB, MAX_SUFFIX_NODES, SuffixCache
from specdec.decoding.rules import TokenRule
from specdec.decoding.text.codec import TextCodec
from specdec.runners.memory import (available_host_memory, budget, check_fits, default_context, fitting_forms,
                                    smallest_form)
from specdec.runners.huge_pages import collapse_in_background, requests_running, settle
from specdec.runners.huge_pages import enabled as huge_pages_enabled
from specdec.runners.resident import release_after_load, trim_heap
from specdec.runners.row_parity import DEEP, WIDTHS, exact_width, row_gaps
from specdec.runners.timing import TimedRunner
from specdec.runners.vocab_map import load_kept_ids

log = logging.getLogger(__name__)

CALIBRATED_WIDTH = MAX_SUFFIX_NODES + 1  # the widest verify pass "auto" plans: a suffix tree plus the pending token
# costs(provisional=True)'s measurement: one timed round after the warm-up, the growth with the context not
# measured (a server answers sooner on a machine that never measured them; the full costs follow when idle)
COARSE_CALIBRATION = {"repeats": 1, "deep_context": 0}


def _after_load(root) -> None:
    """What a load leaves in memory, once its sessions are made: the weight files' read-once pages and the free heap
    released (runners/resident.py), then the packed weights moved to 2 MiB pages on a thread (huge_pages.py)."""
    release_after_load(root)
    collapse_in_background()


class SpeculativeDecoder:
    """Load a bundle once; ``generate`` / ``stream`` many requests (one at a time per decoder; ``fork`` for more)."""

    def __init__(self, bundle_dir: Path, manifest, target, draft, codec: TextCodec, costs: Costs | None = None,
                 prompt_cache: PromptCache | None = None, calibration_key: str | None = None,
                 suffix_cache: SuffixCache | None = None, probe_budget: ProbeBudget | None = None,
                 identity: str | None = None):
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        # the sha256 of the manifest's JSON: what the prompt cache and saved slot files are keyed by
        if identity is None and hasattr(manifest, "to_json"):
            identity = bundle_identity(manifest)
        self.identity = identity
        self.chat_template = None  # a chat template given instead of the bundle's (decoding/text/chat.py)
        self.target = target
        self.draft = draft
        self.codec = codec
        self.eos_ids = frozenset(manifest.target.eos_token_ids)
        self.max_context = target.max_context
        self.limits = Limits(manifest.target.vocab_size, self.max_context, draft is not None, self.eos_ids)
        self._busy = threading.Lock()
        self._costs = costs
        self._costs_other_cores = 0.0  # the CPU other processes used while self._costs were measured
        self._costs_provisional = False  # self._costs are costs(provisional=True)'s coarse ones, never stored
        self.prompt_cache = prompt_cache  # shared by every fork (None: off)
        self.suffix_cache = suffix_cache  # earlier requests' outputs for suffix proposals, shared by every fork
        # what auto's draft probes may spend, earned by requests that may run the draft (shared by every fork)
        self.probe_budget = probe_budget if probe_budget is not None else ProbeBudget()
        self._prefill_per_token: float | None = None  # the target's measured prefill seconds per token
        self._calibration_key = calibration_key  # where measured costs are stored on disk (None: not stored)
        self.context_reason = ""  # why max_context is what it is (load's default: the trained context or memory)
        self.weight_form: str | None = None  # the target's weight form, when its bundle carries several
        self.rows_exact: bool | None = None  # a one-token pass equals a verify row bit for bit (None: not checked:
        # a GPU provider, or a cache too small to compare)
        # (role, tokens, seconds) of every pass with every row's logits, as the proposer sees them (for tools)
        self.pass_observers: list = []
        # the draft's session, shared by every fork, closed while a context is too long for the draft to pay and
        # opened again by the next request that runs it (runners/sessions.py); None: a backend that cannot close it
        self.draft_sessions = getattr(draft, "sessions", None)
        self.closes_draft = False  # close it on such contexts (load: on the CPU provider, where it was measured)
        self.draft_opening = None  # the thread load left opening the draft's session (then releasing pages), if any

    @classmethod
    def load(cls, bundle_dir, provider: str = "cpu", max_context: int | None = None, threads: int | None = None,
             verify: bool = True, cache_ram_mib: float = 0,
             suffix_cache_mib: float = DEFAULT_CACHE_MIB, exact_rows: bool | None = None,
             kv_caches: int = 1, weight_form: str | None = None,
             session_started: threading.Event | None = None) -> "SpeculativeDecoder":
        """Open ``bundle_dir`` (checking every file's sha256 unless ``verify=False``) on an ORT provider.

        ``max_context`` sizes the KV caches. Default: the model's trained context (its max positions), capped by
        free memory (weights, ``kv_caches`` caches at that context, pass buffers, the RAM caches below, 10%
        headroom: runners/memory.py ``default_context``); the choice and its reason are logged and kept as
        ``context_reason``. ``kv_caches``: the caches the caller will hold at once (a server forks one per worker).
        ``cache_ram_mib``: a prompt cache in host RAM of that many MiB, shared by every fork (0: none): KV
        snapshots of recent prefixes of both models that a later request sharing a prefix restores by one copy.
        ``suffix_cache_mib``: the store of recent requests' outputs that suffix proposals search, shared by every
        fork (4 bytes a token; oldest outputs dropped first; 0: each request matches only its own text).
        ``exact_rows``: whether the target's one-token passes run as two rows, so that greedy speculation stays
        token-identical to target-only decoding on CPUs whose one-row int4 kernel rounds unlike the multi-row one
        (a one-token pass then costs a two-token one: 1.2-1.3x on a 2-core AVX2 CPU). None (the default): where
        the load's check finds this CPU's one-token pass rounding unlike a verify row (checked once per machine
        and stored: decoding/calibration_store.py); True: always; False: never (outputs are then greedy
        decodings of the same int4 weights that may part from target-only's on near-ties; logged).
        ``weight_form``: which of the target's weight forms to run ("nbits", "int8") when the bundle carries several;
        None: the one this machine measured faster (decoding/forms.py; measured on the first load, then stored).
        ``session_started``: set once the target's session starts being made (onnxruntime then packs the weights
        with the GIL released): a caller with Python work of its own to do meanwhile (a server importing its web
        stack) starts it then, so the load's own Python goes first.
        """
        if weight_form is not None and not isinstance(weight_form, str):
            raise ValueError(f"weight_form must be None or a form's name, got {weight_form!r}")
        if exact_rows is not None and not isinstance(exact_rows, bool):
            raise ValueError(f"exact_rows must be true, false or None (auto), got {exact_rows!r}")
        for name, value in (("cache_ram_mib", cache_ram_mib), ("suffix_cache_mib", suffix_cache_mib)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(kv_caches, bool) or not isinstance(kv_caches, int) or kv_caches < 1:
            raise ValueError(f"kv_caches must be an integer >= 1, got {kv_caches!r}")
        root = Path(bundle_dir)
        manifest = open_bundle(root, verify=verify, hash_cache=default_hash_cache())
        step_tokens = max(PREFILL_CHUNK, MAX_DRAFT_TOKENS + 2)
        available = _free_memory(provider)
        check_wanted(manifest.target, weight_form)
        forms = forms_of(manifest.target)
        named = forms.get(weight_form) if weight_form is not None else None
        reserved = int((cache_ram_mib + suffix_cache_mib) * 2**20)  # the RAM prompt cache and suffix store
        if max_context is None:
            max_context, reason = default_context(root, manifest, available, step_tokens, reserved, kv_caches,
                                                  target_file=named)
            log.info("max_context %d: %s", max_context, reason)
        else:
            reason = "--max-context / max_context"
        if isinstance(max_context, bool) or not isinstance(max_context, int) or not (
                2 <= max_context <= manifest.target.max_positions):
            raise ValueError(f"max_context must be an integer in 2..{manifest.target.max_positions} "
                             f"(the target's max positions), got {max_context!r}")
        # the target's weight forms that fit beside a max_context cache (all when free memory is unknown): the
        # forms' measurement chooses among them; a named form, or the smallest when none fits, is checked as before
        fitting = fitting_forms(root, manifest, available, max_context, step_tokens, kv_caches, reserved)
        bundle_runners = backend_for(provider)
        if available is not None:
            runs_first = bundle_runners is not None  # engines built from the first form (TensorRT)
            checked = named or (manifest.target.onnx_file if runs_first else None)
            if not fitting or (checked is not None and checked not in fitting.values()):
                check_fits(budget(root, manifest, max_context, step_tokens, workspace=reserved, caches=kv_caches,
                                  target_file=checked or smallest_form(root, manifest)), manifest, available,
                           max_context, caches=kv_caches)
            if weight_form is None and len(fitting) < len(forms):
                log.info("target weight form %s left out: its weights and a %d-token KV cache do not fit in %.2f GiB "
                         "free (%s runs; --max-context lowers the cache)",
                         ", ".join(str(name) for name in forms if name not in fitting), max_context,
                         available / 2**30, ", ".join(str(name) for name in fitting))
        identity = bundle_identity(manifest)
        form = None  # the target's weight form, when the bundle carries several
        making = session_started or threading.Event()  # set as the target's session (or engines) starts being made
        with ThreadPoolExecutor(1) as background:
            # the tokenizer on a thread while the target's session is made here (onnxruntime packs the weights with
            # the GIL released); the draft's session on a thread of its own once the target's is made: load returns
            # (a server answers /health) while the draft's weights are still being packed, and a pass of the draft
            # waits for them (runners/sessions.py)
            codec = background.submit(_codec_beside, inside(root, manifest.tokenizer_file), making)
            try:
                if bundle_runners is not None:  # a backend that builds the bundle's runners itself (TensorRT's engines)
                    making.set()
                    runners = bundle_runners(root, manifest, max_context)
                else:
                    # a choice stored (by an earlier load, with every form fitting) from a measurement beside other
                    # work: the CPU is watched while the target's session is made, and the forms measured again
                    # after it if other processes stayed quiet
                    noisy = (weight_form is None and len(fitting) == len(forms)
                             and noisy_choice(manifest.target, identity, provider, threads))
                    choice = choose_form(root, manifest.target, identity, provider, threads, weight_form,
                                         among=tuple(fitting))
                    form, measured = choice.form, {"target": choice.session}  # the measured session, if it won
                    watch = OtherLoad() if noisy else None
                    files = {"target": choice.onnx_file} | ({"draft": manifest.draft.onnx_file} if manifest.draft
                                                                else {})

                    def make(role: str, spec):
                        return make_runner(str(inside(root, files[role])), spec, provider, max_context, step_tokens,
                                           threads, kept_ids=load_kept_ids(root, spec),
                                           session=DEFERRED if role == "draft" else measured.pop(role, None))

                    making.set()
                    runners = {role: make(role, spec) for role, spec in manifest.models().items()}
                    if watch is not None and quiet_since(watch):
                        log.info("the weight-form choice stored here was measured beside other work and this load "
                                 "found the machine quiet: measuring the forms again")
                        runners.pop("target").reset()  # a stored choice's: no measured session beside it
                        gc.collect()
                        trim_heap()  # that session's packed weights go back before the forms are measured
                        choice = choose_form(root, manifest.target, identity, provider, threads, quiet=True,
                                             among=tuple(fitting))
                        form, files["target"], measured["target"] = choice
                        runners["target"] = make("target", manifest.target)
            finally:
                making.set()
            if getattr(runners["target"], "sessions", None) is not None:
                runners["target"].sessions.get()
            codec = codec.result()
        checks = _row_checks(runners["target"], identity, provider, threads, form) if provider == "cpu" else None
        rows_exact, pad = _one_row_choice(checks, exact_rows)
        runners["target"].pad_one_row = pad
        if checks is not None:
            width = checks["exact_width"]
            runners["target"].exact_width = width
            if width is not None and width < PREFILL_CHUNK:
                log.info("target passes of more than %d tokens round unlike narrower ones on this CPU: prefill "
                         "chunks and verify passes stay within %d tokens (outputs unchanged by the cache)", width, width)
        cache = PromptCache(int(cache_ram_mib * 2**20), identity) if cache_ram_mib else None
        key = calibration_key(identity, provider, threads, CALIBRATED_WIDTH, CALIBRATION_CONTEXT, pad, form,
                              huge_pages=provider == "cpu" and huge_pages_enabled())
        suffix = SuffixCache(int(suffix_cache_mib * 2**20)) if suffix_cache_mib else None
        decoder = cls(root, manifest, runners["target"], runners.get("draft"), codec, prompt_cache=cache,
                      calibration_key=key, suffix_cache=suffix, identity=identity)
        decoder.rows_exact = rows_exact
        decoder.weight_form = form
        decoder.context_reason = reason
        decoder.closes_draft = provider == "cpu"
        if decoder.draft_sessions is not None:  # a session opened again reads its weight file again
            decoder.draft_sessions.after_reopen = lambda: _after_load(root)
        # the weight files' read-once pages and the load's free heap (runners/resident.py): once the draft's session
        # is made when it opens on a thread (0.08-0.1 s less before load returns), else now
        if decoder.draft_sessions is not None and not decoder.draft_sessions.is_open:
            decoder.draft_opening = decoder.draft_sessions.open_in_background(then=lambda: _after_load(root))
        else:
            _after_load(root)
        return decoder

    def fork(self) -> "SpeculativeDecoder":
        """A decoder for another thread: shares this one's sessions (weights loaded once), tokenizer and
        measured costs; owns new KV caches and IO bindings (N workers cost N caches, not N models)."""
        forked = SpeculativeDecoder(self.bundle_dir, self.manifest, self.target.fork(),
                                    self.draft.fork() if self.draft is not None else None, self.codec, self._costs,
                                    self.prompt_cache, self._calibration_key, self.suffix_cache, self.probe_budget,
                                    self.identity)
        forked.rows_exact = self.rows_exact
        forked.weight_form = self.weight_form
        forked._costs_other_cores = self._costs_other_cores
        forked._costs_provisional = self._costs_provisional
        forked.context_reason = self.context_reason
        forked.closes_draft = self.closes_draft
        forked.chat_template = self.chat_template
        forked.draft_opening = self.draft_opening  # the same draft session: its calibration waits for that open too
        return forked

    def wrap_target(self, wrap) -> None:
        """Put ``wrap(target runner)`` in the target's place (a tool's instrumented or stretched runner) and forget
        the measured pass costs: ``auto`` measures them again on the wrapped passes, and never stores those."""
        with self._exclusive():
            self.target = wrap(self.target)
            self._costs = None
            self._calibration_key = None

    def costs(self, provisional: bool = False) -> Costs:
        """This machine's measured pass costs (calibrated once, on first use of "auto" or here).
        ``provisional``: where none are stored for this machine, measure coarse ones instead
        (``COARSE_CALIBRATION``: about a sixth of a full measurement's passes) and never store them:
        ``costs_provisional`` says so, and ``refine_costs`` (an idle server's) measures the full costs, uses and
        stores them. A server starts on these; pass costs only change how fast a request runs, never its output."""
        with self._exclusive():
            return self._measured_costs(provisional)

    def _measured_costs(self, provisional: bool = False) -> Costs:
        """Costs measured once per machine: from the on-disk store when a process with the same bundle, CPU,
        onnxruntime, provider and threads measured them (decoding/calibration_store.py), else now, and stored with
        the CPU other processes used meanwhile (costs measured beside other work are used and stored all the same,
        marked noisy: ``refine_costs`` measures them again when the machine is quiet). ``provisional``: see
        ``costs``."""
        if self._costs is None:
            self._costs_provisional = False
            key = self._calibration_key
            stored, other_cores = load_costs_entry(key) if key is not None else (None, 0.0)
            if stored is not None and len(stored.verify) == CALIBRATED_WIDTH and (
                    self.draft is None or stored.draft_step > 0):
                self._costs, self._costs_other_cores = stored, other_cores
            elif provisional:
                started = time.perf_counter()
                self._costs, _ = self._calibrate(coarse=True)
                self._costs_provisional = True
                log.info("provisional pass costs measured in %.1f s (one round, no deep context; the full "
                         "measurement follows once the server is idle)", time.perf_counter() - started)
            else:
                self._costs, other_cores = self._calibrate()
                self._costs_other_cores = other_cores if other_cores is not None else 0.0
                if key is not None:
                    save_costs(key, self._costs, other_cores=self._costs_other_cores)
                    if self._costs_other_cores > OTHER_CORES_LIMIT:
                        log.info("other processes used %.2f CPU cores while this machine's pass costs were measured: "
                                 "stored as noisy, measured again when the machine is quiet (refine_costs: an idle "
                                 "server does it)", self._costs_other_cores)
        return self._costs

    def _calibrate(self, stop=None, coarse: bool = False) -> tuple:
        """(costs measured now on this decoder's runners, the cores other processes used meanwhile or None).
        ``coarse``: one timed round of each width after the warm-up, at the shallow context only."""
        if self.draft_opening is not None:  # the draft's session packed on a thread, then the pages released after it
            self.draft_opening.join()  # beside the timed passes they would time them slow (and stored so)
        settle()  # a pass timed while the weights are being moved to 2 MiB pages would be timed slow
        other = OtherLoad()
        try:
            with ExitStack() as holds:
                if self.draft_sessions is not None:
                    holds.enter_context(self.draft_sessions.held())  # timed passes: never closed under them
                costs = calibrate(self.target, self.draft, max_tokens=CALIBRATED_WIDTH, stop=stop,
                                  **(COARSE_CALIBRATION if coarse else {}))
            return costs, other.cores()
        finally:
            for runner in filter(None, (self.target, self.draft)):
                runner.release_cache()  # the calibration's random rows
            trim_heap()  # the calibration's temporaries (its random rows before they are copied in)

    @property
    def costs_noisy(self) -> bool:
        """Whether the pass costs in use were measured while other processes used the CPU (and are stored)."""
        return (self._costs is not None and self._calibration_key is not None
                and self._costs_other_cores > OTHER_CORES_LIMIT)

    @property
    def costs_provisional(self) -> bool:
        """Whether the pass costs in use are ``costs(provisional=True)``'s coarse ones (not stored)."""
        return self._costs is not None and self._costs_provisional

    @property
    def costs_to_refine(self) -> bool:
        """Whether ``refine_costs`` would measure: the costs in use are provisional or noisy."""
        return self.costs_provisional or self.costs_noisy

    @property
    def costs_other_cores(self) -> float:
        """The CPU cores other processes used while the pass costs in use were measured."""
        return self._costs_other_cores

    def refine_costs(self, stop=None) -> Costs | None:
        """Measure the pass costs in full if the ones in use are provisional (``costs_provisional``: always kept and
        stored, as ``costs`` stores a first measurement) or noisy (``costs_noisy``: kept and stored when measured
        on a quieter CPU). Returns the costs now in use when they changed, else None. ``stop``: asked before each
        timed pass; when it returns true the measurement ends at once (None returned, nothing changed). Forks keep
        their costs: give them the result with ``use_costs``."""
        with self._exclusive():
            if not self.costs_to_refine:
                return None
            try:
                measured, other_cores = self._calibrate(stop)
            except CalibrationStopped:
                return None
            provisional = self.costs_provisional
            if not provisional and (other_cores is None or other_cores >= self._costs_other_cores):
                return None  # noisy costs give way only to a quieter measurement
            other_cores = other_cores if other_cores is not None else 0.0
            if self._calibration_key is not None:
                save_costs(self._calibration_key, measured, other_cores=other_cores)
            log.info("pass costs measured again beside %.2f other cores (were %s)", other_cores,
                     "provisional" if provisional else f"measured beside {self._costs_other_cores:.2f}")
            self.use_costs(measured, other_cores)
            return measured

    def use_costs(self, costs: Costs, other_cores: float = 0.0) -> None:
        """Use ``costs`` (measured beside ``other_cores`` of other work) from now on: a fork given its parent's."""
        self._costs, self._costs_other_cores, self._costs_provisional = costs, other_cores, False

    # ----------------------------------------------------------------- public API
    def generate(self, prompt, options: GenerationOptions | None = None, **changes) -> GenerationResult:
        """Generate after ``prompt`` (text or token ids) with ``options`` (a ``GenerationOptions``; keywords build
        or change one: ``generate(prompt, max_new_tokens=64, seed=7)``). Every option is described on
        ``GenerationOptions`` (decoding/options.py); a bad one raises a one-line GenerationError naming it."""
        stats = GenerationStats()
        pieces = self.stream(prompt, options, stats=stats, **changes)
        text = "".join(pieces)
        return GenerationResult(text=text, token_ids=pieces.token_ids, stats=stats, finish_reason=pieces.finish_reason,
                                logprobs=pieces.logprobs, sources=list(pieces.sources), stop_string=pieces.stop_string)

    def stream(self, prompt, options: GenerationOptions | None = None, *, stats: GenerationStats | None = None,
               on_prefill: Callable[[PrefillProgress], None] | None = None, **changes) -> "TextStream":
        """Text pieces as rounds complete; the same tokens and text as ``generate`` with the same options.

        Options are validated now (a bad one raises here, not at the first ``next``). After the
        stream is exhausted, ``.token_ids`` holds the token ids and ``.finish_reason`` the finish reason (None
        while it runs), as on ``GenerationResult``; ``stats``: a GenerationStats to fill as it runs;
        ``on_prefill``: called (on the thread reading the stream, within its first ``next``) with a
        ``PrefillProgress`` before the prompt's first chunk is computed, after each, and once the prompt is read
        (llama-server's ``return_progress``); ``.close()`` stops the request between rounds (a client that went
        away)."""
        request = self.validate(prompt, options, **changes)
        if stats is not None and not isinstance(stats, GenerationStats):
            raise GenerationError.bad("stats", f"must be a GenerationStats, got {type(stats).__name__}")
        if on_prefill is not None and not callable(on_prefill):
            raise GenerationError.bad("on_prefill", f"must be callable, got {type(on_prefill).__name__}")
        state = RequestState(request, self.codec, self.eos_ids, self.limits.vocab_size,
                             stats=stats if stats is not None else GenerationStats())
        return TextStream(self._pieces(state, on_prefill), state)

    def infill(self, prefix: str, suffix: str, options: GenerationOptions | None = None, *, extra=(),
               prompt: str = "", **changes) -> GenerationResult:
        """Fill in the middle between ``prefix`` and ``suffix`` (code before and after the cursor).

        extra: other files as ``[{"filename": ..., "text": ...}]`` (repository-level context); prompt: text
        that continues the prefix (llama.cpp's ``prompt``). ``options`` / keywords are ``generate``'s; the answer
        ends at EOS or at the tokenizer's FIM markers. Laid out as llama.cpp's server does (decoding/text/infill.py)."""
        ids, options = self.infill_request(prefix, suffix, GenerationOptions.build(options, **changes), extra, prompt)
        return self.generate(ids, options)

    def stream_infill(self, prefix: str, suffix: str, options: GenerationOptions | None = None, *, extra=(),
                      prompt: str = "", **changes) -> "TextStream":
        """``infill`` as text pieces (``stream``'s iterator)."""
        ids, options = self.infill_request(prefix, suffix, GenerationOptions.build(options, **changes), extra, prompt)
        return self.stream(ids, options)

    def infill_prompt(self, prefix: str, suffix: str, *, extra=(), prompt: str = "", max_new_tokens: int = 128,
                      tree=None) -> list:
        """The token ids ``infill`` would decode from (fitted to the context)."""
        from specdec.decoding.text.infill import fim_tokens, infill_prompt

        longest = MAX_TREE_NODES if tree is not None else MAX_DRAFT_TOKENS
        room = self.max_context - max_new_tokens - longest - 1 if isinstance(max_new_tokens, int) else None
        return infill_prompt(self.codec, fim_tokens(self.manifest, self.codec), prefix, suffix, extra, prompt, room)

    def infill_request(self, prefix: str, suffix: str, options: GenerationOptions, extra=(), prompt: str = "") -> tuple:
        """(the FIM prompt's token ids, ``options`` that also stop at the FIM markers)."""
        from specdec.decoding.text.infill import fim_stop_ids, fim_tokens

        ids = self.infill_prompt(prefix, suffix, extra=extra, prompt=prompt, max_new_tokens=options.max_new_tokens,
                                 tree=options.tree)
        stops = options.stop_token_ids + fim_stop_ids(fim_tokens(self.manifest, self.codec))
        return ids, options.replace(stop_token_ids=stops)

    def clear_cache(self) -> int:
        """Forget what this decoder's own KV caches hold (the next request prefills from token 0; the shared
        RAM prompt cache is untouched); returns how many tokens the target's held. For measuring cold starts and
        llama-server's slot erase; never needed for correctness."""
        with self._exclusive():
            held = self.target.length
            for runner in filter(None, (self.target, self.draft)):
                runner.reset()
            return held

    def save_caches(self, path) -> tuple:
        """Write both models' KV caches (token ids and keys/values) to the file ``path`` (atomically), keyed by
        this bundle's identity; (target tokens saved, bytes written). decoding/slot_file.py has the format."""
        from specdec.decoding.slot_file import save_slot

        with self._exclusive():
            return save_slot(self, path)

    def restore_caches(self, path) -> tuple:
        """Load a file ``save_caches`` wrote into this decoder's caches; (target tokens restored, bytes read). A
        file of another bundle, a damaged or truncated one is refused (``SlotFileError``) with nothing loaded."""
        from specdec.decoding.slot_file import restore_slot

        with self._exclusive():
            return restore_slot(self, path)

    def cached_prefix(self, token_ids) -> int:
        """How many leading ``token_ids`` the target's cache holds now (what a request on them would not
        compute again). For routing a request to the worker that shares the most; takes no lock."""
        return self.target.held_prefix(list(token_ids))

    def validate(self, prompt, options: GenerationOptions | None = None, **changes) -> Request:
        """The checks ``generate`` makes, without generating (a one-line GenerationError naming the option)."""
        return make_request(self.codec, self.limits, prompt, GenerationOptions.build(options, **changes))

    def chat(self, messages, options: GenerationOptions | None = None, **changes) -> GenerationResult:
        """``generate`` on the bundle's chat template around ``messages``; stops at the end-of-turn token.
        Chat's own keywords (``tools``, ``tool_choice``, ``template_variables``): decoding/text/chat.py."""
        from specdec.decoding.text.chat import chat

        return chat(self, messages, options, **changes)

    def stream_chat(self, messages, options: GenerationOptions | None = None, **changes) -> "TextStream":
        """``stream`` on the bundle's chat template around ``messages``."""
        from specdec.decoding.text.chat import stream_chat

        return stream_chat(self, messages, options, **changes)

    # ----------------------------------------------------------------- the loop
    def _exclusive(self):
        decoder = self

        class _Guard:
            def __enter__(self):
                if not decoder._busy.acquire(blocking=False):
                    raise RuntimeError(
                        "this SpeculativeDecoder is already generating in another thread: "
                        "use one decoder per thread (decoder.fork() shares the loaded weights)"
                    )

            def __exit__(self, *exc):
                decoder._busy.release()

        return _Guard()

    def _pieces(self, state: RequestState, on_prefill=None) -> Iterator[str]:
        with self._exclusive(), ExitStack() as holds:
            holds.enter_context(requests_running())  # the background move to 2 MiB pages waits meanwhile
            request, stats = state.request, state.stats
            proposer = None

            def on_pass(role: str, tokens: int, seconds: float, all_logits: bool) -> None:
                if role == "target":
                    stats.verify_seconds += seconds
                    stats.target_forwards += 1
                else:
                    stats.draft_seconds += seconds
                    stats.draft_forwards += 1
                if proposer is not None and all_logits:  # what the cost model knows: passes with every row's logits
                    proposer.observe_pass(role, tokens, seconds)
                    for observer in self.pass_observers:
                        observer(role, tokens, seconds)

            if request.auto and request.tree is None and request.num_draft_tokens != 0:
                self._measured_costs()  # auto lengths need this machine's pass costs: measured before the prefill,
                # which a first calibration would otherwise wipe (it times passes on the runners' own caches)
            target = TimedRunner(self.target, "target", on_pass)
            draft = TimedRunner(self.draft, "draft", on_pass) if self.draft is not None else None
            started = time.perf_counter()
            leave = 1 if request.max_new_tokens == 0 else 2  # a warm-up holds all but the last token
            cannot_pay = proposer_entries()[request.proposer].draft_cannot_pay
            if cannot_pay is not None:  # before the prefill's peak memory
                self._close_draft_if_it_cannot_pay(cannot_pay, request, self._resources(draft, state.tokens, leave),
                                                   len(state.tokens))
            report = _ProgressReport(on_prefill, len(state.tokens), leave, started) if on_prefill else None
            stats.cached_tokens = reuse_cache(target, state.tokens, leave, self.prompt_cache, progress=report)
            self._observe_prefill(len(state.tokens) - leave - stats.cached_tokens, time.perf_counter() - started)
            proposer = make_proposer(request, self._resources(draft, state.tokens, leave))
            stats.draft_skipped = proposer.draft_skipped
            uses_draft = proposer.uses_draft_model
            if uses_draft and self.draft_sessions is not None:
                holds.enter_context(self.draft_sessions.held())  # no other worker closes it under this request
            if uses_draft:
                # auto hybrid: the draft reads the prompt in the first round that uses it (never the first)
                stats.draft_cached_tokens = reuse_cache(draft, state.tokens, leave, self.prompt_cache,
                                                        compute=not proposer.lazy_draft_prefill)
            for runner in filter(None, (self.target, self.draft)):  # an earlier, longer conversation's rows
                runner.release_rows_from(len(state.tokens))
            if report is not None:
                report.read()
            stats.prefill_seconds = time.perf_counter() - started
            stats.prefill_forwards = stats.target_forwards
            stats.verify_seconds = stats.draft_seconds = 0.0
            started = time.perf_counter()
            rule = TokenRule(request.sampling, request.acceptance, state.noise, state.rng, state.guide, state.logprobs,
                             request.logprobs or 0)
            while not state.finish:
                tokens = state.tokens
                room = self.max_context - len(tokens) - 1
                if target.exact_width is not None:  # a proposal and the pending token within the exact width
                    room = min(room, target.exact_width - 1)
                proposal = proposer.propose(RoundInput(state, rule, state.budget, room,
                                                       len(tokens) - target.length))
                played = verify(target, state, rule, proposal)
                proposer.observe(proposal, played)
                stats.rounds += 1
                stats.proposed += played.proposed
                stats.accepted += played.accepted
                stats.rejected_rounds += played.accepted < played.proposed
                if proposal is not None:
                    stats.rounds_by_source[played.source] = stats.rounds_by_source.get(played.source, 0) + 1
                    stats.tree_nodes += played.nodes
                piece = state.commit(played.tokens, played.source)
                stats.decode_seconds = time.perf_counter() - started
                if piece:
                    yield piece
            tail = state.text.finish()
            if tail:
                yield tail
            proposer.finish(state.output)
            if self.prompt_cache is not None:  # after the last piece: a client never waits for the copy
                self.prompt_cache.store("target", self.target)
                if uses_draft:
                    self.prompt_cache.store("draft", self.draft)

    def _close_draft_if_it_cannot_pay(self, cannot_pay, request, resources: ProposerResources, context: int) -> None:
        """Free the draft's session (its weights: 0.38 GiB of the 1.5B pair) when this conversation's context is so
        long that the draft's catch-up would cost more than it could save even if the answer filled the rest of the
        context: follow-ups only make the context longer. A later request that runs the draft opens it again (its
        open priced like the catch-up: the proposer's ``draft_cannot_pay``). Outputs never change: only proposals."""
        sessions = self.draft_sessions
        if not self.closes_draft or sessions is None or not sessions.is_open:
            return
        if cannot_pay(request, resources, self.max_context - context):
            sessions.close(f"a {context:,}-token context of {self.max_context:,}: the draft's catch-up costs more "
                           "than it could save")

    def _observe_prefill(self, computed: int, seconds: float) -> None:
        """Keep a running estimate of the target's prefill seconds per token (from prefills of 32+ tokens)."""
        if computed >= 32:
            rate = seconds / computed
            self._prefill_per_token = rate if self._prefill_per_token is None else 0.7 * self._prefill_per_token + 0.3 * rate

    def _resources(self, draft, tokens: list, leave: int) -> ProposerResources:
        """What this request's proposer may use: the draft's timed runner, the costs (measured on first use), the
        shared stores, and how many prompt tokens the draft's caches lack (what its prefill would compute)."""
        missing = None
        if draft is not None:
            missing = len(tokens) - leave - draft.held_prefix(tokens)
            if self.prompt_cache is not None:
                missing = min(missing, len(tokens) - leave - self.prompt_cache.peek("draft", tokens))
            missing = max(missing, 0)
        context = len(tokens)  # the costs at this request's depth (attention grows with it: cost_model.Costs.at)
        sessions = self.draft_sessions
        reopen = sessions.open_seconds if sessions is not None and not sessions.is_open else 0.0
        return ProposerResources(self.max_context, draft, lambda: self._measured_costs().at(context),
                                 self.suffix_cache, self.probe_budget, missing, self._prefill_per_token, reopen)


def reuse_cache(runner: TimedRunner, tokens: list, leave: int = 2, prompt_cache: PromptCache | None = None,
                compute: bool = True, progress=None) -> int:
    """Keep the longest prefix of ``tokens`` the runner's cache holds, then compute the rest (but the last
    one or two, which the first round feeds; ``compute=False``: left to the round that next uses the runner).
    Returns the number of prompt tokens reused. ``progress(length)``: called with the tokens the cache holds once
    the prefix is kept, and after each chunk computed.

    The last token is never reused: the first round needs its logits, so it runs again. Rows are computed
    by the same graph whatever the pass width (verify rows equal one-token rows bit for bit, checked at
    export), so a warm cache gives the same tokens as a cold one."""
    held = min(runner.held_prefix(tokens), len(tokens) - 1)
    if prompt_cache is not None:  # another request's snapshot may share more than this cache does
        entry, shared = prompt_cache.lookup(runner.role, tokens[: len(tokens) - 1], better_than=held)
        if entry is not None:
            runner.restore(entry, shared)
            held = shared
    runner.truncate(held)
    if progress is not None:
        progress(held)
    if compute:
        catch_up(runner, tokens, leave, after_chunk=progress)
    return held


class _ProgressReport:
    """A request's ``PrefillProgress`` reports from the target's prefill (``reuse_cache``'s ``progress``): the first
    call gives the tokens reused, each later one the tokens held after a chunk; a chunk that leaves only the tokens
    the first round computes reports the whole prompt read; ``read()`` reports it read if no chunk did."""

    def __init__(self, send, total: int, leave: int, started: float):
        self.send, self.total, self.leave, self.started = send, total, leave, started
        self.cached = self.processed = None

    def __call__(self, held: int) -> None:
        if self.cached is None:
            self.cached = held
        else:
            held = self.total if held >= self.total - self.leave else held
        self._send(held)

    def read(self) -> None:
        if self.processed != self.total:
            self._send(self.total)

    def _send(self, processed: int) -> None:
        self.processed = processed
        self.send(PrefillProgress(self.total, self.cached, processed, time.perf_counter() - self.started))


class TextStream:
    """The iterator ``stream`` returns: text pieces; then ``token_ids`` and ``finish_reason`` (as ``GenerationResult``)."""

    def __init__(self, pieces: Iterator[str], state: RequestState):
        self._pieces = pieces
        self._state = state

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop the request now (between rounds); the decoder is free for the next one."""
        self._pieces.close()

    @property
    def token_ids(self) -> list:
        return self._state.output

    @property
    def logprobs(self) -> list | None:
        """With ``logprobs``: one TokenLogprob per token in ``token_ids`` so far (else None)."""
        return self._state.output_logprobs

    @property
    def sources(self) -> list:
        """Per token in ``token_ids``: the proposer whose accepted proposal it was ("draft", "suffix", "lookup"),
        or "target" (the target's own token: a bonus or a correction, or decoding without a proposal)."""
        return self._state.sources

    @property
    def finish_reason(self) -> str | None:
        """None while the request runs; then "eos", "stop" or "length"."""
        return self._state.finish or None

    @property
    def stop_string(self) -> str | None:
        """The stop string the text ended at (finish reason "stop" by a stop string), else None."""
        return self._state.text.matched if self._state.finish == "stop" else None

    @property
    def stats(self) -> GenerationStats:
        return self._state.stats


def _free_memory(provider: str) -> int | None:
    """Bytes a load may take: host RAM available, or the GPU's free memory for the GPU providers (None: unknown)."""
    available = available_host_memory()
    if backend(provider).device_memory:
        try:
            from specdec.runners.cuda_memory import free_device_memory

            available = free_device_memory()
        except (ValueError, RuntimeError):
            pass  # no cuda-python: the provider check reports what is missing
    return available

# The tokenizer's parse (tokenizers' from_file: 0.3-0.4 s for Qwen2.5's 151k-token vocabulary) holds the GIL. Started
# at once, it kept the load's own Python (choosing the form, onnxruntime's model parse) from reaching onnxruntime's
# session initialization, which packs the weights with the GIL released: so it starts once the target's session is
# being made, and after the model parse (30-50 ms). Measured on the real pair (2-core Zen 5, quiet, 4 loads each):
# load 1.15-1.26 s instead of 1.35-1.48 s. A caller's own GIL work (``session_started``) waits as long.
AFTER_SESSION_START = 0.05  # seconds


def _codec_beside(path: Path, making: threading.Event) -> TextCodec:
    making.wait()
    time.sleep(AFTER_SESSION_START)
    return TextCodec(path)


def _row_checks(target, identity: str, provider: str, threads: int | None, form: str | None = None) -> dict:
    """This machine's row checks of the target (runners/row_parity.py): ``{"one_row", "two_rows"}``, the largest
    logit gaps of an unpadded one-token pass and of a two-row pass from a verify row (None: the cache is too small to
    tell), and ``exact_width``. Measured once per bundle, CPU, onnxruntime and thread count, then read from the
    store (decoding/calibration_store.py): they depend on the kernels only."""
    key = machine_key(identity, provider, threads, checks="rows", step_tokens=target.max_step_tokens,
                      deep=target.max_context >= DEEP + max(WIDTHS) + 1, **({"form": form} if form else {}))
    stored = load_row_checks(key)
    if stored is not None:
        return stored
    target.pad_one_row = False
    gaps = row_gaps(target)
    checks = {"one_row": None if gaps is None else gaps["one_row"], "two_rows": None if gaps is None else gaps["two_rows"],
              "exact_width": exact_width(target)}
    target.release_cache()  # the checks' random rows
    if gaps is not None:
        save_row_checks(key, checks)
    return checks


def _one_row_choice(checks: dict | None, exact_rows: bool | None) -> tuple:
    """(whether the target's one-token pass, as it will run, equals a verify row bit for bit: None when unknown;
    whether one-token passes run as two rows) from the row checks and the caller's ``exact_rows``."""
    if checks is None or checks["one_row"] is None:
        return None, exact_rows is True
    unpadded = checks["one_row"] == 0.0 and checks["two_rows"] == 0.0
    pad = exact_rows is True or (exact_rows is None and not unpadded)
    exact = checks["two_rows"] == 0.0 if pad else unpadded
    if exact_rows is None and pad:
        log.info("on this CPU a one-token pass of the target rounds unlike a row of a wider pass (%.3g): one-token "
                 "passes run as two rows, so greedy speculation stays token-identical to target-only decoding "
                 "(exact_rows=False / --no-exact-rows runs them as one row, faster, exact only off near-ties)",
                 checks["one_row"])
    elif exact_rows is False and not unpadded:
        log.warning("on this CPU a one-token pass of the target rounds unlike a row of a wider pass: greedy "
                    "speculation may part from target-only decoding on near-ties (exact_rows=None, the default, "
                    "runs one-token passes as two rows and keeps it exact)")
    if pad and not exact:
        log.warning("on this CPU a two-row pass of the target rounds unlike a row of a wider pass: greedy speculation "
                    "may part from target-only decoding on near-ties")
    return exact, pad
