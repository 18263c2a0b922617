"""`python -m disttrain.torchrun`: the entry point torchrun (or `disttrain ddp`'s elastic
agent) starts as one DDP rank; typed by hand outside an agent, the same as `disttrain ddp`."""
