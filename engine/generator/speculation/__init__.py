"""Speculative decoding for the torch backend: the lossless verify step (speculative.py), model-free suffix
drafts (suffix.py), the bandit that picks the depth (bandit.py), and the drafter trained on the policy's own
rollouts while the generator is idle (drafter_training.py). Imports nothing of torch_backend/."""
