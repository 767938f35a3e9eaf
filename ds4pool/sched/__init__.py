"""Scheduling: a fair priority queue feeding one batched decode worker."""
