"""Side workers: dedicated encoder models (embedding, reranking) served beside or instead of
the chat engine. Each worker owns its checkpoint, tokenizer and forward pass."""
