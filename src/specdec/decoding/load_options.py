"""What ``SpeculativeDecoder.load`` takes besides the bundle, as one validated record that ``specdec serve``, the
HTTP server's ``build_app`` and Ray Serve's replicas share; and a load run on a thread of its own, so a server can
import its web stack while onnxruntime packs the weights (``specdec serve`` answers /health that much sooner)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from specdec.decoding.decoder import AFTER_SESSION_START, SpeculativeDecoder


@dataclass(frozen=True)
class LoadOptions:
    """``SpeculativeDecoder.load``'s arguments besides the bundle."""
    provider: str = "cpu"
    max_context: int | None = None
    threads: int | None = None
    verify: bool = True
    cache_ram_mib: float = 0  # a prompt cache in host RAM shared by the pool's workers (0: none)
    suffix_cache_mib: float | None = None  # recent outputs for suffix proposals (None: the decoder's default)
    exact_rows: bool | None = None  # one-token target passes as two rows (None: where the CPU needs it)
    weight_form: str | None = None  # the target's weight form to run (None: the one measured faster here)

    def __post_init__(self):
        for name in ("cache_ram_mib", "suffix_cache_mib"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or
                                      not value >= 0):
                raise ValueError(f"{name} must be a number >= 0 MiB, got {value!r}")
        if self.cache_ram_mib is None:
            raise ValueError("cache_ram_mib must be a number >= 0 MiB, got None")

    def load_kwargs(self) -> dict:
        kwargs = dict(provider=self.provider, max_context=self.max_context, threads=self.threads, verify=self.verify)
        if self.exact_rows is not None:
            kwargs["exact_rows"] = self.exact_rows
        if self.weight_form is not None:
            kwargs["weight_form"] = self.weight_form
        if self.cache_ram_mib:
            kwargs["cache_ram_mib"] = self.cache_ram_mib
        if self.suffix_cache_mib is not None:
            kwargs["suffix_cache_mib"] = self.suffix_cache_mib
        return kwargs


class BackgroundLoad:
    """``SpeculativeDecoder.load(bundle, **options.load_kwargs(), kv_caches=kv_caches)`` started on a daemon thread
    (onnxruntime makes its sessions with the GIL released); ``result()`` waits for the decoder or raises what the
    load raised. A process that exits first (a bad flag found meanwhile) does not wait for it."""

    def __init__(self, bundle, options: LoadOptions, kv_caches: int = 1):
        self._decoder, self._error = None, None
        self._session_started = threading.Event()
        self._thread = threading.Thread(target=self._load, args=(bundle, options, kv_caches), daemon=True,
                                        name="specdec-load")
        self._thread.start()

    def _load(self, bundle, options: LoadOptions, kv_caches: int) -> None:
        try:
            self._decoder = SpeculativeDecoder.load(bundle, **options.load_kwargs(), kv_caches=kv_caches,
                                                    session_started=self._session_started)
        except Exception as exc:  # handed to the caller of result()
            self._error = exc
        finally:
            self._session_started.set()

    def let_it_start(self, limit: float = 0.5) -> None:
        """Wait (at most ``limit`` seconds) until the target's session is being made, so that the caller's own
        Python (a web stack's imports) does not hold the GIL the load's Python needs until then. A load that
        failed by then (a folder that is no bundle, a context that does not fit) raises here."""
        if self._session_started.wait(limit):
            if not self._thread.is_alive() and self._error is not None:
                raise self._error
            time.sleep(AFTER_SESSION_START)

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._decoder
