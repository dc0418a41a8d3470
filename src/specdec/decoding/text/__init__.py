"""What is text, not decoding: the tokenizer's codec (``codec``), chat templates and conversations (``chat``), tool
calls in and out of text (``tools``), fill-in-the-middle prompts (``infill``)."""
