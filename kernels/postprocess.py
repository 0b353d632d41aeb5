"""On-graph post-processing of the logits: the small ONNX graph the exporter appends to every graph it builds, and
its numpy reference.

Per row of the logits [1, R, V] it returns the `top_k` best token ids and their logits (greedy verification reads
column 0, Token Recycling the first 8) and, on sampling calls, their probabilities under softmax(logits /
temperature) over the *whole* vocabulary, so the sampler turns [R, k] numbers into the distribution
(`kernels.sampling.probs_from_top`) instead of sorting [R, V] floats in numpy. Measured on the dev VM (V = 49152,
2 threads): the head costs ~0.07–0.09 ms per row on a sampling call and its `If` ~0.01 ms per greedy call, where
the numpy path it replaces costs 0.3–0.7 ms per row for a top-p or top-k cut on random logits (less on a model's
peaked ones: end to end, sampled decoding ran ×1.01–1.05 faster).

Inputs (`head_feeds` gives a greedy call's; ONNX Runtime can neither IOBind an input that has a default
initializer nor stay quiet about one, so there are none): `top_k` int64 [1] (k ≤ V), `temperature` float [1] (> 0
when sampling), `sample` bool [] (the softmax runs only when true: ONNX Runtime executes every node of a graph
whatever outputs are bound, so the softmax sits behind an `If`; a greedy call's `top_probs` is a copy of
`top_logits`).
Outputs: `top_logits` float, `top_ids` int64, `top_probs` float, each [1, R, top_k], best first, ties toward the
lower id (ONNX Runtime's TopK, as `np.argmax`).
"""
from __future__ import annotations

import numpy as np

HEAD_INPUTS = ("top_k", "temperature", "sample")
GREEDY_K = 8  # k of a greedy call: verification reads column 0, Token Recycling keeps 8 candidates


def head_feeds(k: int, temperature: float | None = None) -> dict[str, np.ndarray]:
    """The head's inputs for one call: k ids per row (k ≤ V), their probabilities when `temperature` is given."""
    return {"top_k": np.array([k], np.int64),
            "temperature": np.array([1.0 if temperature is None else temperature], np.float32),
            "sample": np.array(temperature is not None)}


def sampling_head(logits: str) -> tuple[list, list, list]:
    """Nodes, graph inputs and graph outputs (onnx protos) of the head over the tensor named `logits` [1, R, V]."""
    from onnx import TensorProto, helper, numpy_helper

    # (logits - row max) / T, the max being the TopK's first value: dividing first would round near-ties together
    # at small temperatures (x / T is large) and overflow to NaN rows at tiny ones
    then = helper.make_graph(
        [helper.make_node("Slice", ["top_logits", "head/zero", "head/one", "head/last_axis"], ["head/max"],
                          name="head/row_max"),
         helper.make_node("Sub", [logits, "head/max"], ["head/shifted"], name="head/shift"),
         helper.make_node("Div", ["head/shifted", "temperature"], ["head/scaled"], name="head/scale"),
         helper.make_node("Softmax", ["head/scaled"], ["head/probs"], name="head/softmax", axis=-1),
         helper.make_node("GatherElements", ["head/probs", "top_ids"], ["head/top_probs"], name="head/gather",
                          axis=-1)],
        "sampling", [], [helper.make_tensor_value_info("head/top_probs", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([v], np.int64), n)
                     for n, v in (("head/zero", 0), ("head/one", 1), ("head/last_axis", -1))])
    otherwise = helper.make_graph(
        [helper.make_node("Identity", ["top_logits"], ["head/no_probs"], name="head/greedy")],
        "greedy", [], [helper.make_tensor_value_info("head/no_probs", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("TopK", [logits, "top_k"], ["top_logits", "top_ids"], name="head/topk", axis=-1,
                              largest=1, sorted=1),
             helper.make_node("If", ["sample"], ["top_probs"], name="head/if_sampling", then_branch=then,
                              else_branch=otherwise)]
    inputs = [helper.make_tensor_value_info("top_k", TensorProto.INT64, [1]),
              helper.make_tensor_value_info("temperature", TensorProto.FLOAT, [1]),
              helper.make_tensor_value_info("sample", TensorProto.BOOL, [])]
    outputs = [helper.make_tensor_value_info("top_logits", TensorProto.FLOAT, [1, "R", "K"]),
               helper.make_tensor_value_info("top_ids", TensorProto.INT64, [1, "R", "K"]),
               helper.make_tensor_value_info("top_probs", TensorProto.FLOAT, [1, "R", "K"])]
    return nodes, inputs, outputs


def sampling_head_model(vocab: int):
    """The head alone, over a `logits` input [1, R, vocab] (tests and measurements)."""
    from onnx import TensorProto, helper

    nodes, inputs, outputs = sampling_head("logits")
    graph = helper.make_graph(nodes, "sampling_head",
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "R", vocab])] + inputs,
                              outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def sampling_head_reference(logits: np.ndarray, k: int, temperature: float | None) -> tuple[np.ndarray, ...]:
    """numpy reference of the head on logits [R, V]: (top_logits, top_ids, top_probs) [R, k]; temperature None is a
    greedy call (top_probs = top_logits)."""
    x = np.asarray(logits, np.float32)
    assert x.ndim == 2 and 1 <= k <= x.shape[1], (x.shape, k)
    ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # [R, k], best first, ties toward the lower id
    top = np.take_along_axis(x, ids, -1)
    if temperature is None:
        return top, ids, top.copy()
    z = (x.astype(np.float64) - x.max(-1, keepdims=True)) / temperature
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return top, ids, np.take_along_axis(p, ids, -1).astype(np.float32)
