"""The processes of a parameter-server run: the launcher, the `ps-server` and `ps-worker`
processes, the end of a run, and what the run reports of its progress and failures."""
