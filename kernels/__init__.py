"""Pure array math for edgespec: sampling, verification, tree layouts and KV gathers, and the small ONNX head the
exporter appends to the logits (:mod:`kernels.postprocess`).

No sessions, no files: numpy in, numpy out, randomness only through an explicit ``rng``.
Notation (p, q, accepted / recovered / bonus tokens) is defined in :mod:`kernels.verify`.
"""

from kernels.sampling import make_sampler, probs_from_top, process_logits, sample_from
from kernels.tree import (
    TreeLayout,
    chain_parents,
    kv_gather_indices,
    topological_order,
    verify_greedy_tree,
    verify_sampling_tree,
)
from kernels.verify import (
    recovered_distribution,
    scatter_trimmed,
    verify_greedy,
    verify_sampling,
)

__all__ = [
    "TreeLayout",
    "chain_parents",
    "kv_gather_indices",
    "make_sampler",
    "probs_from_top",
    "process_logits",
    "recovered_distribution",
    "sample_from",
    "scatter_trimmed",
    "topological_order",
    "verify_greedy",
    "verify_greedy_tree",
    "verify_sampling",
    "verify_sampling_tree",
]
