"""graphc: ahead-of-time graph compiler and thin runtime for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
