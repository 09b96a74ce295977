"""tailguard: serve Mistral-architecture LLMs to batch jobs without the latency tail blowing up."""

__version__ = "0.1.0"
