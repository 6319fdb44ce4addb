"""Pagoda's CPU kernels: the floor below the models and the attention backends.

``library`` builds the C sources of ``csrc/`` into one library for this CPU, probes what the CPU
runs, and binds every function from the one declaration of the interface,
``csrc/pagoda_kernels.h``; ``linear`` wraps the matrix products. The attention kernels' wrappers
live with the attention backends (attention_backends/cpu_kernels.py). Nothing here imports the
rest of Pagoda.

NOTE: not named ``kernels``: the repository root is the package, so a process started there finds
this folder as the top-level module ``kernels``, which is also the name of Hugging Face's kernel
package; transformers found it and failed importing its names from it.
"""
