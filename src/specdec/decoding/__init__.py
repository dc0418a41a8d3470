"""The speculative loop: requests, proposers, rounds, token rules, the cost model, text and chat templates,
and ``SpeculativeDecoder``. Imports ``contract``, ``sampling``, ``runners``.
"""
