"""What runs measure: the metrics vocabulary (`keys`), the training clock and window
(`window`), the JSONL + TensorBoard stream (`logger`), the progress display and the run
summary."""
