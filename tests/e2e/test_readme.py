"""The README's main command brings the stack up, and its curl, `tandem health` (in the activated
venv), openai and gRPC examples work as written (only the ports differ, so the test does not
collide with a stack already running); the install overrides of docs/installing.md pick torch's
index as it says; the security guide's TLS example runs; every .md file the docs name exists."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"  # what `make install` made: the README's venv


def block_after(marker: str, lang: str, text: str = README) -> str:
    """The first fenced code block of `lang` after `marker` in `text` (the README by default)."""
    start = text.index(marker)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    assert m, f"no {lang} block after {marker!r}"
    return m.group(1)


def test_readme_is_a_front_page():
    """README: what Tandem is, the two commands, an example of each API and links; the rest is
    in the guides under docs/."""
    assert len(README.splitlines()) <= 250


def test_readme_two_commands_are_make_targets():
    block = block_after("## Two commands", "bash")
    assert "make up" in block and "make test" in block
    makefile = (ROOT / "Makefile").read_text()
    assert "tandem up" in makefile and "pytest" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_tandem_up_and_readme_examples(tmp_path):
    http, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli.main", "up", "--http-port",
                           str(http), "--grpc-port", str(grpc_port)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    reader = threading.Thread(target=output.extend, args=(up.stdout,), daemon=True)
    try:
        # What a user waits for: the banner, printed once the router (which polled every worker
        # first) wrote its ready file; or the end of the output, `tandem up` having failed.
        for line in up.stdout:
            output.append(line)
            if "Ctrl-C stops everything" in line:
                break
        assert "OpenAI HTTP" in "".join(output), "".join(output)
        reader.start()  # the rest of the output, kept for the failure messages below
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=30) as r:
            assert r.status == 200

        curl = block_after("With it running, from another shell", "bash")
        curl = curl.replace("127.0.0.1:8000", f"127.0.0.1:{http}").replace("\\\n", " ")
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        body = json.loads(out)
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"]
        assert body["usage"]["completion_tokens"] == 16
        # The answer the README quotes (greedy: the same every time).
        quoted = re.search(r"answers `(\".*?\")`", README).group(1)
        assert body["choices"][0]["text"] == json.loads(quoted)

        # In a new shell: the venv activated, then `tandem` (from ROOT, where .venv is).
        health = block_after("activate it first", "bash")
        assert health.startswith("source .venv/bin/activate\n")
        health = health.replace("127.0.0.1:50051", f"127.0.0.1:{grpc_port}")
        clean = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        clean["PATH"] = "/usr/bin:/bin"  # no tandem but the venv's
        res = subprocess.run(["bash", "-c", health], capture_output=True, text=True, timeout=60,
                             cwd=ROOT, env=clean)
        printed = re.search(r'# prints "(.*)"', health).group(1)  # what the README says
        assert res.returncode == 0 and res.stdout.strip() == printed, res

        # hello.py, run by the venv's python.
        snippet = block_after("through the `openai` client", "python")
        (tmp_path / "hello.py").write_text(snippet.replace("127.0.0.1:8000",
                                                           f"127.0.0.1:{http}"))
        res = subprocess.run([str(VENV_PYTHON), "hello.py"], capture_output=True, text=True,
                             timeout=60, env=env, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "The capital of France is Paris.", res.stdout

        # The gRPC example: the same greedy answer as curl's, then a stream.
        snippet = block_after("## Calling it over gRPC", "python")
        (tmp_path / "grpc_hello.py").write_text(snippet.replace("127.0.0.1:50051",
                                                                f"127.0.0.1:{grpc_port}"))
        res = subprocess.run([str(VENV_PYTHON), "grpc_hello.py"], capture_output=True, text=True,
                             timeout=60, env=env, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines()[0] == json.loads(quoted).strip(), res.stdout
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C: drain and stop everything
        code = up.wait(60)
        if reader.is_alive():
            reader.join()
    assert code == 0, "".join(output)


def _make_install_commands(env: dict[str, str], *overrides: str) -> list[str]:
    """The commands `make install` would run (make -n: nothing runs), as given to pip."""
    out = subprocess.run(["make", "-n", "-B", ".venv/.installed", f"PY={sys.executable}",
                          *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [line for line in out.splitlines() if "pip install" in line]


def test_make_install_takes_cpu_torch_from_the_index_the_readme_names():
    index = re.search(r"the Makefile takes torch from the\s+PyTorch CPU index, `(\S+)`",
                      (DOCS / "installing.md").read_text()).group(1)
    plain = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    plain["PIP_CONFIG_FILE"] = os.devnull  # a machine where pip has no sources configured
    torch_line = next(c for c in _make_install_commands(plain) if "torch==" in c)
    assert f"--index-url '{index}'" in torch_line, torch_line
    # Where pip has its own sources (a local wheel cache, as in CI), only those are asked.
    cached = {**plain, "PIP_FIND_LINKS": "/opt/wheels"}
    torch_line = next(c for c in _make_install_commands(cached) if "torch==" in c)
    assert "--index-url" not in torch_line, torch_line
    # The README's override.
    torch_line = next(c for c in _make_install_commands(plain, "TORCH_INDEX=file:///mirror")
                      if "torch==" in c)
    assert "--index-url 'file:///mirror'" in torch_line, torch_line
    assert all("-qq" in c for c in _make_install_commands(plain))  # quiet unless it fails


def test_readme_tls_example_runs_as_written(tmp_path):
    """The security guide's `tandem up` with TLS and an API key: its commands in a shell (the
    venv first on PATH, as once activated), only the ports changed."""
    http, grpc_port = free_port(), free_port()
    guide = (DOCS / "security.md").read_text()
    start = block_after("## With `tandem up`", "bash", guide)
    calls = block_after("With it running, from another shell in the same directory", "bash",
                        guide)
    up_line = next(line for line in start.splitlines() if line.startswith("tandem up "))
    ports = f" --http-port {http} --grpc-port {grpc_port}"
    setup = start.replace(up_line, up_line.split("#")[0].rstrip() + ports + " > up.log 2>&1 &")
    calls = calls.replace("127.0.0.1:8000", f"127.0.0.1:{http}").replace(
        "127.0.0.1:50051", f"127.0.0.1:{grpc_port}")
    printed = re.search(r'# prints "(.*)"', calls).group(1)
    script = "\n".join([
        "set -e", setup, "UP=$!", "trap 'kill -INT $UP; wait $UP' EXIT",
        # The banner follows the router's ready file.
        "until grep -q 'Ctrl-C stops everything' up.log; do kill -0 $UP; sleep 0.2; done",
        calls])
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{VENV_PYTHON.parent}:/usr/bin:/bin"
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    log = (tmp_path / "up.log").read_text() if (tmp_path / "up.log").exists() else ""
    assert res.returncode == 0, (res.stderr, log[-3000:])
    # `tandem certs`' line, curl's body (no newline after it), the health line.
    out = res.stdout[res.stdout.index("{"):]
    models, end = json.JSONDecoder().raw_decode(out)
    assert models["data"][0]["id"] == "smollm2-135m-instruct", res.stdout
    assert out[end:].strip() == printed.replace("50051", str(grpc_port)), res.stdout
    assert "API key:     required on both public ports" in log
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == sorted(
        ["ca.pem", *(f"{role}.{ext}" for role in ("both", "decode", "prefill", "router")
                     for ext in ("key", "pem"))])


def test_docs_name_only_files_the_repository_has():
    """Every .md name in README.md, docs/*.md, BENCHMARKS.md and benchmarks/README.md (a link's
    target relative to its file; a bare name relative to the repository root), every relative
    link's target (any file), and every link's #anchor in a Markdown file, exists."""
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "README.md",
            *sorted(DOCS.glob("*.md"))]
    for doc in docs:
        text = doc.read_text()
        links = {m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
                 if not m.startswith(("http://", "https://", "mailto:"))}
        for link in links:
            assert (doc.parent / link).exists(), f"{doc.name}: link to {link}"
        for name in set(re.findall(r"[\w./-]+\.md\b", text)) - links:
            assert name.startswith("http") or (ROOT / name).exists() or (
                doc.parent / name).exists(), f"{doc.name}: {name}"
        for link, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            target = doc.parent / link if link else doc
            if target.suffix == ".md" and target.exists():
                assert anchor in _anchors(target), f"{doc.name}: link to {link}#{anchor}"


def _anchors(md: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.strip().lower()).replace(" ", "-")
            for m in re.findall(r"^#+ (.+)$", md.read_text(), re.M)}
