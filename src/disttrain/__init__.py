"""disttrain: train one PyTorch model four ways and measure what each strategy costs."""

__version__ = "0.1.0"
