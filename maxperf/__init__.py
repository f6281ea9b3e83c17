"""maxperf: ahead-of-time compilation and performance analysis of JAX LLM training steps.

Importing the package is cheap: jax and the other heavy libraries load only when a part that needs them does.
"""

__version__ = "0.1.0"
