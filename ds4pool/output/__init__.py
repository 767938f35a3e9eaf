"""Model output → typed deltas (text, reasoning, tool-call parts, finish) for the API renderers."""
