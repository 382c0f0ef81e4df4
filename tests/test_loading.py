"""
Loading Hugging Face checkpoints: every layout the hub has, written here by hand, loads with the same
logits; wrong, corrupt, missing and half-downloaded checkpoints are refused, naming what is wrong; a
bfloat16 checkpoint loads exactly.
"""
import ctypes
import io
import json
import random
import struct
import urllib.error
import urllib.request

import pytest
import torch

import model as model_py
from model import GPT
from tests.common import random_prompt, tiny_gpt, worst


# ---------------------------------------------------------------------------------------------
# Loading Hugging Face checkpoints, written here by hand

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture(scope="module")
def saved():
    """A float32 GPT to save. Heads of 64 dimensions, as in GPT-2, so that it loads without a
    config.json too (the head count is in no tensor's shape)."""
    return tiny_gpt(dtype=torch.float32, seed=1, n_head=2, n_embd=128)


def hf_tensors(model, prefix="", buffers=True, lm_head=False):
    """The model's parameters named and laid out as Hugging Face stores GPT-2."""
    tensors = {}
    for name, p in model.named_parameters():  # the tied LM head's weight as wte; Conv1D's weights (in, out)
        name = "wte.weight" if name == "lm_head.weight" else name.removeprefix("transformer.")
        tensors[prefix + name] = (p.t() if name.endswith(CONV1D) else p).detach().contiguous().clone()
    if buffers:  # the causal-mask buffers that old checkpoints carry
        n = model.config.block_size
        for i in range(model.config.n_layer):
            tensors[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
            tensors[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if lm_head:
        tensors["lm_head.weight"] = tensors[prefix + "wte.weight"].clone()
    return tensors


def write_safetensors(path, tensors):
    """The safetensors format by hand: 8 bytes of header length, a JSON header, then raw bytes."""
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = ctypes.string_at(t.data_ptr(), t.nbytes)  # the tensor's memory, byte for byte, no numpy
        dtype = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16"}[t.dtype]
        header[name] = dict(dtype=dtype, shape=list(t.shape), data_offsets=[offset, offset + len(raw)])
        chunks.append(raw)
        offset += len(raw)
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(chunks))
    return header


LAYOUTS = {  # name: (file, key prefix, causal-mask buffers, lm_head.weight, config.json)
    "hub safetensors": ("model.safetensors", "", True, False, True),
    "safetensors, transformer. keys, no config": ("model.safetensors", "transformer.", True, True, False),
    "bin, transformer. keys": ("pytorch_model.bin", "transformer.", True, True, True),
    "bin, bare keys, no buffers, no config": ("pytorch_model.bin", "", False, False, False),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_hf_checkpoint(saved, tmp_path, layout):
    """A checkpoint in each layout the hub has loads, from its directory or its file, into the saved
    model: same sizes, same logits. Square Conv1D weights (c_proj) left untransposed would still
    fit their shapes: only the logits catch that."""
    filename, prefix, buffers, lm_head, config_json = LAYOUTS[layout]
    tensors = hf_tensors(saved, prefix, buffers, lm_head)
    if filename.endswith(".safetensors"):
        write_safetensors(tmp_path / filename, tensors)
    else:
        torch.save(tensors, tmp_path / filename)
    c = saved.config
    if config_json:
        config = dict(n_positions=c.block_size, vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                      n_embd=c.n_embd, model_type="gpt2")
        (tmp_path / "config.json").write_text(json.dumps(config))
    idx = torch.tensor([random_prompt(random.Random(8), 12)])
    with torch.no_grad():
        want = saved(idx)
        for source in (tmp_path, tmp_path / filename):
            loaded = GPT.from_pretrained(source).eval()
            assert loaded.config == saved.config
            got = loaded(idx)
            assert torch.allclose(got, want, rtol=0, atol=1e-6), f"{source.name}: {worst(got, want)}"


@pytest.mark.parametrize("damage, message", [
    ("missing tensor", r"missing.*h\.1\.mlp\.c_fc\.bias"),
    ("unexpected tensor", r"unexpected.*h\.0\.attn\.rotary\.weight"),
    ("wrong shape", r"h\.0\.ln_1\.weight.*127.*128"),  # both shapes, the file's and the model's
    ("untied lm_head", r"lm_head\.weight"),
])
def test_wrong_tensors_are_refused(saved, tmp_path, damage, message):
    """A checkpoint with a tensor missing, extra, misshapen, or an lm_head that is not wte is refused
    with a ValueError that names the tensor: never loaded half."""
    tensors = hf_tensors(saved)
    if damage == "missing tensor":
        del tensors["h.1.mlp.c_fc.bias"]
    elif damage == "unexpected tensor":
        tensors["h.0.attn.rotary.weight"] = torch.zeros(4)
    elif damage == "wrong shape":
        tensors["h.0.ln_1.weight"] = tensors["h.0.ln_1.weight"][:127].clone()
    else:
        tensors["lm_head.weight"] = tensors["wte.weight"] + 1
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["garbage header", "header not an object", "header cut short",
                                    "absurd header length", "data cut short", "offsets past the end"])
def test_corrupt_safetensors_are_refused(tmp_path, damage):
    """A damaged file is a ValueError naming what is wrong, not a crash deep inside torch or json."""
    path = tmp_path / "model.safetensors"
    header = write_safetensors(path, {"wte.weight": torch.randn(10, 8), "wpe.weight": torch.randn(4, 8)})
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    message = "header"
    if damage == "garbage header":
        data = data[:8] + b"\xff" * header_len + data[8 + header_len:]
    elif damage == "header not an object":
        data = struct.pack("<Q", 8) + b"[1, 2]  "
    elif damage == "header cut short":
        data = data[:8 + header_len // 2]
    elif damage == "absurd header length":
        data = struct.pack("<Q", 2**62) + data[8:]
    elif damage == "data cut short":  # the last tensor's bytes run past the end
        data, message = data[:-4], "wpe.weight"
    else:
        begin, end = header["wte.weight"]["data_offsets"]
        header["wte.weight"]["data_offsets"] = [begin + len(data), end + len(data)]
        header_bytes = json.dumps(header).encode()
        data = struct.pack("<Q", len(header_bytes)) + header_bytes + data[8 + header_len:]
        message = "wte.weight"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(path)


@pytest.mark.parametrize("damage", ["empty .bin", "text .bin", "pickled code", "both key layouts",
                                    "config.json garbled", "n_head does not divide n_embd"])
def test_other_bad_checkpoints_are_refused(saved, tmp_path, damage):
    """More ways a checkpoint can be wrong, each a ValueError with the path in it, never a traceback
    from deep inside torch, and never code run from the file."""
    tensors = hf_tensors(saved)
    path = tmp_path / "pytorch_model.bin"
    if damage == "empty .bin":
        path.write_bytes(b"")
    elif damage == "text .bin":
        path.write_text("hello world")
    elif damage == "pickled code":  # weights_only=True must refuse to call anything
        torch.save({"wte.weight": torch.zeros(2, 2), "trap": Trap()}, path)
    else:
        path = tmp_path / "model.safetensors"
        if damage == "both key layouts":
            tensors["transformer.h.0.ln_1.weight"] = torch.zeros_like(tensors["h.0.ln_1.weight"])
        write_safetensors(path, tensors)
        if damage == "config.json garbled":
            (tmp_path / "config.json").write_text("{n_head: 4")
        elif damage == "n_head does not divide n_embd":
            (tmp_path / "config.json").write_text(json.dumps({"n_head": 3}))
    with pytest.raises(ValueError, match=str(tmp_path)):
        GPT.from_pretrained(path)
    assert not Trap.called, "loading ran code from the file"


class Trap:
    """Unpickling this calls Trap.spring: a stand-in for code hidden in a checkpoint."""
    called = False

    def __reduce__(self):
        return (Trap.spring, ())

    @staticmethod
    def spring():
        Trap.called = True


def test_missing_checkpoint(tmp_path):
    """A path that is not there, or a directory without weights, is a FileNotFoundError."""
    with pytest.raises(FileNotFoundError):
        GPT.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        GPT.from_pretrained(tmp_path)


def test_download_checkpoint(saved, tmp_path, monkeypatch):
    """A name is fetched from HF_URL into the cache, the file appearing only once whole. Here HF_URL
    points at a local file, so nothing leaves the machine."""
    hub = tmp_path / "hub" / "gpt2"
    hub.mkdir(parents=True)
    write_safetensors(hub / "model.safetensors", hf_tensors(saved))
    monkeypatch.setattr(model_py, "HF_URL", f"file://{tmp_path}/hub/{{name}}/model.safetensors")
    path = model_py.download_checkpoint("gpt2", tmp_path / "cache")
    assert path.read_bytes() == (hub / "model.safetensors").read_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"], "a .partial file was left behind"
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(path)(idx), saved(idx))
    monkeypatch.setattr(model_py, "HF_URL", "file:///nowhere/{name}")  # a second call downloads nothing
    assert model_py.download_checkpoint("gpt2", tmp_path / "cache") == path


class DroppedConnection(io.BytesIO):
    """A response that delivers 10 bytes, then loses the connection."""
    headers = {"Content-Length": "1000"}

    def read(self, size=-1):
        if self.tell():
            raise TimeoutError("the connection dropped")
        return super().read(10)


class EndedEarly(DroppedConnection):
    """A response that delivers 10 of its 1000 bytes, then ends as if complete: http.client does
    exactly this when the server closes the connection early, without raising anything."""

    def read(self, size=-1):
        return b"" if self.tell() else super().read(10)


@pytest.mark.parametrize("failure", ["no network", "dropped midway", "ended early"])
def test_failed_download(tmp_path, monkeypatch, failure):
    """Offline, or cut off halfway: a one-line ConnectionError, and no file, partial or whole, left."""
    def urlopen(url, timeout=None):
        if failure == "no network":
            raise urllib.error.URLError("Name or service not known")
        return (DroppedConnection if failure == "dropped midway" else EndedEarly)(b"x" * 1000)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(ConnectionError) as error:
        GPT.from_pretrained("gpt2", cache_dir=tmp_path)
    assert "gpt2" in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []

# ---------------------------------------------------------------------------------------------
# A bfloat16 checkpoint, every weight the very bfloat16 value


def test_load_a_bfloat16_safetensors_checkpoint(tmp_path):
    """Fine-tuned GPT-2s are often saved in bfloat16. Such a .safetensors file loads into a float32
    model with every weight the very bfloat16 value (bfloat16 to float32 is exact). Its bits read as
    float16 instead would be other numbers altogether."""
    saved = tiny_gpt(dtype=torch.bfloat16, seed=1, n_head=2, n_embd=128)
    header = write_safetensors(tmp_path / "model.safetensors", hf_tensors(saved, buffers=False))
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    loaded = GPT.from_pretrained(tmp_path / "model.safetensors")
    assert loaded.config == saved.config
    for (name, got), want in zip(loaded.named_parameters(), saved.parameters()):
        assert got.dtype == torch.float32 and torch.equal(got, want.float()), f"{name}: {worst(got, want.float())}"
