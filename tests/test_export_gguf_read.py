"""export/gguf_read.py: the fast GGUF reader gives the metadata and tensors `gguf.GGUFReader` gives, for files of
either byte order, and refuses what is not a GGUF."""
from __future__ import annotations

import numpy as np
import pytest

from export.gguf_read import GGUFFormatError, read_gguf


def _write(path, endian):
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "gemma3", endianess=endian)
    w.add_name("tiny")
    w.add_uint32("gemma3.block_count", 3)
    w.add_float32("gemma3.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_int64("test.negative", -5)
    w.add_float64("test.double", 0.1)
    w.add_token_list(["<pad>", "a", "▁b", "中", "\n\n", ""])
    w.add_token_scores([0.0, -1.0, -2.5, -3.0, -1000.0, 0.0])
    w.add_token_types([3, 1, 1, 1, 4, 1])
    w.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 4)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_same_fields_and_tensors_as_gguf_reader(tmp_path, endian):
    import gguf

    path = tmp_path / "t.gguf"
    _write(path, gguf.GGUFEndian[endian])
    ref = gguf.GGUFReader(str(path))
    got = read_gguf(path)
    assert got.version == 3 and got.data_offset == ref.data_offset
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(got.fields) == keys
    nested = got.fields["test.nested"]  # (gguf.GGUFReader flattens arrays of arrays)
    assert [a.tolist() for a in nested] == [[1, 2], [3]]
    for k in keys:
        if k == "test.nested":
            continue
        want, have = ref.fields[k].contents(), got.fields[k]
        if isinstance(have, np.ndarray):
            assert have.dtype.isnative and have.tolist() == list(want), k
        else:
            assert have == want and type(have) is type(want), k
    assert got.fields["tokenizer.ggml.tokens"][-1] == "" and got.fields["test.negative"] == -5
    assert [t.name for t in got.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(got.tensors, ref.tensors):
        assert t.tensor_type == r.tensor_type and t.shape == tuple(int(x) for x in r.shape)
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape and np.array_equal(t.data, r.data)
    # dequantize takes the views as they are
    from gguf.quants import dequantize

    q8 = got.tensors[-1]
    np.testing.assert_array_equal(dequantize(q8.data, q8.tensor_type),
                                  dequantize(ref.tensors[-1].data, ref.tensors[-1].tensor_type))
    # metadata only: the same fields, no tensors, and the arrays outlive the file's mapping
    meta = read_gguf(path, tensors=False)
    assert meta.tensors == [] and meta.fields["tokenizer.ggml.scores"].tolist() == [0.0, -1.0, -2.5, -3.0, -1000.0,
                                                                                      0.0]


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        read_gguf(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        read_gguf(empty)
    good = tmp_path / "t.gguf"
    import gguf

    _write(good, gguf.GGUFEndian.LITTLE)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(GGUFFormatError):
        read_gguf(cut, tensors=False)
    data = good.read_bytes()  # the metadata whole, the last tensor's data cut short
    cut.write_bytes(data[:-40])  # (past the padding after it)
    read_gguf(cut, tensors=False)
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        read_gguf(cut)
