"""The runner: builds a run from the composed config and trains."""
