"""ds4pool: a multi-session LLM inference server for many coding agents on one box."""

__version__ = "0.1.0"
