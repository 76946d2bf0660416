"""What the trainer learns from: prompt sources (JSONL, Parquet, `hf:NAME`, the built-in tasks), chat turns
through the tokenizer's template, and DPO's preference pairs. Imports only core/, data/ and config.py."""
