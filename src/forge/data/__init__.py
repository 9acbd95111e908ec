"""Data: the embedded corpus, tokenizers and resumable loaders."""
