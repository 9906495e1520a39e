"""Text in, text out: ``dt.generate`` and ``distrib-train generate`` over ``generation/``'s sampler.

- ``text``: the tokenizer as a codec, prompt records into ids, end ids, stop
  strings.
- ``generate``: completions of text prompts from a run's model or a Hugging
  Face one, written as JSONL or streamed.
"""
