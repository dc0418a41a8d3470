"""The HTTP server: one module per wire dialect (``dialects/``) over shared job streaming (``jobs.py``), chat
turns (``turns.py``), the worker pool, metrics, Ray Serve replicas. Imports ``decoding`` and below; never
``bench``, ``cli`` or ``export``.
"""
