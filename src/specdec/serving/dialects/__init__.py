"""The wire dialects the server speaks, one module each; every module has ``mount(app, engine, server)``.

A dialect module turns its request bodies into ``GenerationOptions`` and chat turns, runs them through the
shared ``Engine`` (serving/jobs.py) and writes the answers in its own shapes. A module that answers errors in a
shape other than OpenAI's also has ``owns_errors(path)`` and ``error_response(status, message, ...)``.
"""

from specdec.serving.dialects import anthropic, llama, openai, responses

DIALECTS = (openai, responses, anthropic, llama)
