"""One trace per HTTP request, whatever FastAPI and Starlette the ranges admit: the router's
HTTP API served with tracing on (tests/http_trace_check.py, a process of its own) leaves, for a
completion, a streamed one, a refused one (400) and ones refused for their API key (401), the
spans of one trace, rooted in the router's span (or continuing the caller's traceparent); a
401 is traced and logged with its trace id. Run against the versions installed and against the
oldest the ranges admit (`make install` puts them in .venv/oldest-web; Makefile OLDEST_WEB)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "http_trace_check.py"
OLDEST = ROOT / ".venv" / "oldest-web"


def oldest_pins() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    pins = re.search(r"^OLDEST_WEB := (.+)$", text, re.M).group(1).split()
    return dict(p.split("==") for p in pins)


def test_the_oldest_pins_are_the_ranges_lower_bounds() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    (fastapi_min,) = re.findall(r'"fastapi>=([\d.]+)', pyproject)
    pins = oldest_pins()
    assert pins["fastapi"].startswith(fastapi_min) and pins["fastapi"].count(".") == 2
    if OLDEST.exists():  # the Starlette pin is the lowest that FastAPI release admits
        meta = next(OLDEST.glob("fastapi-*.dist-info")) / "METADATA"
        (req,) = [line for line in meta.read_text().splitlines()
                  if line.startswith("Requires-Dist: starlette")]
        assert f">={pins['starlette']}" in req, req


@pytest.mark.parametrize("versions", ["installed", "oldest"])
def test_one_trace_per_http_request(versions) -> None:
    env = {**os.environ}
    if versions == "oldest":
        if not OLDEST.exists():
            pytest.fail(f"{OLDEST} is missing: `make install` puts the oldest FastAPI and "
                        "Starlette the ranges admit there")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(OLDEST),
                                                          env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.splitlines()[-1])
    if versions == "oldest":
        assert (r["fastapi"], r["starlette"]) == tuple(oldest_pins().values())
    cases = r["cases"]
    for name, case in cases.items():
        assert case["traces"] == 1, (r["fastapi"], name, case)
        assert len(case["roots"]) == 1, (r["fastapi"], name, case)
    assert [cases[n]["status"] for n in ("completion", "streamed", "refused_400")] == \
        [200, 200, 400]
    assert cases["streamed"]["done"]
    for name in ("completion", "streamed", "refused_400", "refused_401"):
        assert cases[name]["roots"] == ["text_completion m"], (name, cases[name])
        assert cases[name]["root_kinds"] == ["SERVER"], (name, cases[name])
    assert cases["traceparent"]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert cases["refused_400"]["error_types"] == ["INVALID_ARGUMENT"]
    for name in ("refused_401", "refused_401_models"):
        assert cases[name]["status"] == 401 and cases[name]["error_types"] == \
            ["UNAUTHENTICATED"], (name, cases[name])
    assert r["unauthenticated_log_lines"] == r["log_lines_with_trace_id"] == 2
