"""moetrace: correctness tracing for MoE expert-weight transport."""

__version__ = "0.1.0"
