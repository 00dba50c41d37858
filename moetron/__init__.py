"""moetron: Mixture-of-Experts training, readable and correct in every parallel layout."""

__version__ = "0.1.0"
