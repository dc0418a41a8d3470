"""The OpenAI-compatible server: wire protocol, handlers, the worker pool, metrics, Ray Serve replicas.
Imports ``decoding`` and below; never ``bench``, ``cli`` or ``export``.
"""
