"""``hf:`` models: building a ``transformers`` causal LM (:mod:`.model`), what it is checked for (:mod:`.check`),
and the tokenizer an ``hf:`` run keeps (:mod:`.tokenizer`)."""
