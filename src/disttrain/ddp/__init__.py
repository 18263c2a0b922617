"""`python -m disttrain.ddp`: the entry point torchrun starts as a DDP rank."""
