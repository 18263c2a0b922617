"""What runs measure: the metrics vocabulary (`keys`), the training clock and window
(`window`), the JSONL + TensorBoard stream (`logger`), the progress display, the run
summary, its time to accuracy (`time_to_accuracy`) and the run's hyper-parameters for
TensorBoard's HPARAMS tab (`hparams`)."""
