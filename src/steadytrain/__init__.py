"""steadytrain: the parts of PyTorch training that quietly break runs, right by construction."""

__version__ = "0.1.0"
