"""The shared core every layer stands on: errors, logging, fault injection, addresses,
child processes and checkpoint files. It imports nothing else of the project."""
