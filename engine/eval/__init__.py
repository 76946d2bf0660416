"""Evaluation: what an evaluation is (suite.py: prompts, work, pass@k, figures), shared by the trainer's
in-run evaluation (trainer/in_run_eval.py), and `tailrace eval --checkpoint DIR` (main.py, an entry point)."""
