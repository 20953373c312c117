"""Where a model's files come from: the built-in demo, a packaged GGUF model, a local directory
or GGUF file, or the Hugging Face hub. Everything downstream (config, weights, tokenizer) reads
one local directory."""

from __future__ import annotations

from pathlib import Path

from tandem.engine import gguf_checkpoint
from tandem.engine.demo import DEMO_NAME, demo_model_dir
from tandem.errors import ModelLoadError

# Only what serving needs: configs, weights, tokenizer files (not *.bin / *.pth duplicates).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]


def resolve_model(name_or_path: str) -> Path:
    """The local checkpoint directory for `name_or_path`.

    - "tandem-demo": the demo checkpoint, built on first use.
    - "smollm2-135m-instruct" (and other names in gguf_checkpoint.PACKAGED): the GGUF file a
      Python package ships, as below. Built-in names are matched whatever their case.
    - a GGUF file, or a directory holding one and no config.json: a checkpoint directory
      made from it in the cache on first use (engine/gguf_checkpoint.py).
    - an existing local directory: itself; it must contain config.json.
    - anything else: a Hugging Face hub id, downloaded (configs, safetensors, tokenizer files)
      into the hub cache. Fails with ModelLoadError where there is no network.
    """
    builtin = builtin_name(name_or_path)
    if builtin == DEMO_NAME:
        return demo_model_dir()
    if builtin is not None:
        return gguf_checkpoint.checkpoint_dir(gguf_checkpoint.packaged_file(builtin))
    path = Path(name_or_path).expanduser()
    gguf_file = gguf_checkpoint.find_gguf(path)
    if gguf_file is not None:
        return gguf_checkpoint.checkpoint_dir(gguf_file)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model: directory {str(path)!r} has no config.json")
        return path
    if path.exists():
        raise ModelLoadError(f"model: {name_or_path!r} is a file, neither a checkpoint directory "
                             "nor a .gguf file")
    # Something spelled as a path ("/x", "./x", "~/x") is never a hub id: say what is missing
    # instead of reporting a confusing hub error.
    if path.is_absolute() or name_or_path.startswith((".", "~")):
        raise ModelLoadError(f"model: no such directory {str(path)!r}")
    return _download(name_or_path)


def builtin_name(name: str) -> str | None:
    """The built-in model `name` means, in its own spelling ("SmolLM2-135M-Instruct" ->
    "smollm2-135m-instruct": the case of a built-in name does not matter, unless a local path
    is spelt so); None for any other name."""
    builtins = [DEMO_NAME, *gguf_checkpoint.PACKAGED]
    if name in builtins:
        return name
    if name.lower() in builtins and not Path(name).expanduser().exists():
        return name.lower()
    return None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only for hub ids

        local = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # no network, unknown repo, gated, malformed id: all mean "can't get it"
        raise ModelLoadError(
            f"model: {repo_id!r} is not a local directory or .gguf file, a built-in name "
            f"({', '.join([DEMO_NAME, *gguf_checkpoint.PACKAGED])}), or a reachable hub id "
            f"({type(e).__name__}: {' '.join(str(e).split())})") from e
    if not (local / "config.json").is_file():
        raise ModelLoadError(f"model: hub repo {repo_id!r} has no config.json")
    return local


def served_name(name_or_path: str) -> str:
    """The model id clients send by default: a local checkpoint's own name without its path
    ("/models/Llama-3.1-8B-Instruct/" -> "Llama-3.1-8B-Instruct"; a file: its stem); the demo
    name or a hub id as given (a hub id keeps its organization, as vLLM serves it); a built-in
    name in its own spelling."""
    builtin = builtin_name(name_or_path)
    if builtin is not None:
        return builtin
    path = Path(name_or_path).expanduser()
    if not path.exists():
        return name_or_path
    path = path.resolve()
    return path.stem if path.is_file() else path.name
