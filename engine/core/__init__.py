"""Shared types and utilities, imported by several roles from below: samples and loss types, model and
tokenizer loading, weights and drafter state, metrics, what a run says to its user, start-up checks,
reward-function combination and the gc freeze. Imports nothing of engine/ but core/ and config.py."""
