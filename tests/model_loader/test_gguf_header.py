"""The GGUF header reader (pagedjax/model_loader/gguf_header.py) against gguf-py's GGUFReader:
the same metadata, the same tensors (names, types, shapes, bytes), on a file written with every
value type and on SmolLM2's real file; broken files refused with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagedjax.model_loader.gguf_header import read_gguf_header  # noqa: E402


def assert_same_as_gguf_py(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    header = read_gguf_header(path)
    keys = [key for key in reader.fields if not key.startswith("GGUF.")]
    assert list(header.metadata) == keys
    for key in keys:
        field, value = reader.fields[key], header.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            expected = [field.contents(i) for i in range(len(field.data))]
            value = value.tolist() if isinstance(value, np.ndarray) else value
            assert len(value) == len(expected), key
            for got, want in zip(value, expected, strict=True):
                assert got == want and type(got) is type(want), (key, got, want)
        else:
            assert value == field.contents() and type(value) is type(field.contents()), key
    assert list(header.tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        ours = header.tensors[tensor.name]
        assert ours.type == int(tensor.tensor_type)
        assert ours.dims == tuple(int(d) for d in tensor.field.parts[3])
        assert ours.data.dtype == tensor.data.dtype and ours.data.shape == tensor.data.shape
        np.testing.assert_array_equal(ours.data, tensor.data)


def write_every_kind(path: Path, alignment: int | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo, wörld")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "ünïcode", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.empty_array", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    writer.add_tensor("norm", rng.standard_normal(7, dtype=np.float32))
    writer.add_tensor("cube", rng.standard_normal((2, 3, 4), dtype=np.float32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                  gguf.GGMLQuantizationType.Q4_1):
        weight = rng.standard_normal((6, 64), dtype=np.float32)
        writer.add_tensor(qtype.name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path, alignment) -> None:
    path = write_every_kind(tmp_path / "every.gguf", alignment)
    assert_same_as_gguf_py(path)
    header = read_gguf_header(path)
    assert header.metadata["t.strings"] == ["a", "", "ünïcode", "x" * 300]
    assert header.metadata["t.u64"] == 2**63 + 5
    assert header.tensors["Q4_0"].data.shape == (6, 2 * 18)  # 2 blocks of 18 bytes a row
    assert header.tensors["cube"].dims == (4, 3, 2)


@pytest.mark.real_model
def test_smollm2s_file_reads_as_gguf_py_reads_it() -> None:
    from pagedjax.model_loader.demo import smollm2_instruct_gguf

    path = smollm2_instruct_gguf()
    assert_same_as_gguf_py(path)
    assert len(read_gguf_header(path).metadata["tokenizer.ggml.tokens"]) == 49152


def test_broken_files_are_refused_with_the_reason(tmp_path) -> None:
    good = write_every_kind(tmp_path / "good.gguf").read_bytes()
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00{}" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_header(not_gguf)
    for cut, reason in ((40, "ends inside its GGUF header"), (len(good) - 64, "truncated")):
        short = tmp_path / f"cut_{cut}.gguf"
        short.write_bytes(good[:cut])
        with pytest.raises(ValueError, match=reason):
            read_gguf_header(short)
    v9 = tmp_path / "v9.gguf"
    v9.write_bytes(good[:4] + (9).to_bytes(4, "little") + good[8:])
    with pytest.raises(ValueError, match="GGUF version 9"):
        read_gguf_header(v9)
