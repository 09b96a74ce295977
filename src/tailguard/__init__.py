"""tailguard: serve Mistral-architecture LLMs to batch jobs without the latency tail blowing up."""

from tailguard import compiled as _compiled

__version__ = "0.1.0"

# The server's hot modules compiled with mypyc, when a build for exactly these sources exists
# (tailguard/compiled.py); pure Python otherwise.
_compiled.install()
