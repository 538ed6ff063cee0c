"""The streaming safetensors writer (tensor_file.py) against safetensors' own reader: every dtype the
checkpoints and exports use, views and odd shapes, deferred tensors, metadata and the digest."""
import hashlib
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_trainer.tensor_file import write_safetensors


def tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 10, generator=g)
    return {"w": big, "row": big[2], "block": big[1:4, 3:7],  # views: a row, a strided block
            "bf16": torch.randn(3, 5, generator=g).bfloat16(), "half": torch.randn(7, generator=g).half(),
            "rng": torch.get_rng_state(), "ids": torch.arange(-3, 9, dtype=torch.int64).view(3, 4),
            "mask": torch.rand(9, generator=g) > 0.5, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
            "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_written_file_reads_back_with_safetensors(tmp_path):
    src = tensors()
    path = tmp_path / "a.safetensors"
    digest = write_safetensors(path, src, {"step": "3", "where": '{"box": [0]}'})
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"step": "3", "where": '{"box": [0]}'}
        assert set(f.keys()) == set(src)
        for name, t in src.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(raw(got), raw(t)), name  # bit for bit
        assert torch.equal(f.get_slice("w")[1:3], src["w"][1:3])  # ranges read by offset
    # the same tensors as safetensors' own writer stores them
    save_file({k: v.clone() for k, v in src.items()}, str(tmp_path / "b.safetensors"))  # it refuses views
    ours, theirs = load_file(str(path)), load_file(str(tmp_path / "b.safetensors"))
    assert all(torch.equal(raw(ours[k]), raw(theirs[k])) for k in src)


@dataclass
class Deferred:
    shape: tuple
    dtype: torch.dtype
    value: torch.Tensor
    reads: list

    def read(self):
        self.reads.append(self.shape)
        return self.value


def test_deferred_tensors_are_read_in_turn_in_their_dtype(tmp_path):
    reads = []
    a, b = torch.randn(4, 3), torch.randn(5)
    write_safetensors(tmp_path / "d.safetensors", {"a": Deferred((4, 3), torch.bfloat16, a, reads),
                                                   "b": Deferred((5,), torch.float32, b, reads)})
    assert reads == [(4, 3), (5,)]
    back = load_file(str(tmp_path / "d.safetensors"))
    assert back["a"].dtype == torch.bfloat16 and torch.equal(back["a"], a.bfloat16()) and torch.equal(back["b"], b)
    with pytest.raises(ValueError, match="tensor a was read with shape"):
        write_safetensors(tmp_path / "e.safetensors", {"a": Deferred((3, 4), torch.float32, a, reads)})


def test_tensor_file_reads_what_both_writers_write(tmp_path):
    from moe_trainer.tensor_file import TensorFile
    src = tensors()
    write_safetensors(tmp_path / "ours.safetensors", src, {"k": "v"})
    save_file({k: v.clone() for k, v in src.items()}, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    for name in ("ours", "theirs"):
        with TensorFile(tmp_path / f"{name}.safetensors") as f:
            assert f.metadata == {"k": "v"} and set(f.keys()) == set(src)
            for key, t in src.items():
                got = f.get(key)
                assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(raw(got), raw(t)), (name, key)


@pytest.mark.parametrize("spoil, words", [
    (lambda b: b[:5], "too short"),
    (lambda b: b[:8] + b"{not json" + b[17:], "bad safetensors header"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "runs past the end"),
    (lambda b: b.replace(b'"F32"', b'"Q32"', 1), "bad safetensors header"),
])
def test_tensor_file_refuses_a_damaged_header_in_one_sentence(tmp_path, spoil, words):
    from moe_trainer.tensor_file import TensorFile
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"w": torch.randn(4, 4), "b": torch.randn(3)})
    path.write_bytes(spoil(path.read_bytes()))
    with pytest.raises(ValueError, match=words):
        TensorFile(path)


def test_tensor_file_refuses_a_truncated_file(tmp_path):
    from moe_trainer.tensor_file import TensorFile
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"w": torch.randn(64, 64)})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="does not fit the file"):
        TensorFile(path)
