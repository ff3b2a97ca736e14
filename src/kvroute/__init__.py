"""kvroute: KV-cache-aware load balancing for LLM inference fleets."""

__version__ = "0.1.0"
