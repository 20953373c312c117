"""gc_pauses.py's summary of the probe's files: each process by its command, only the
collections that ended once the stack was ready, by generation."""

from __future__ import annotations

from benchmarks.serving.gc_pauses import summarize


def test_collections_before_the_stack_was_ready_are_left_out(tmp_path):
    (tmp_path / "11.tsv").write_text(
        "# python -m tandem.cli.main router --model m --workers 127.0.0.1:1\n"
        "2\t180.0\t99.0\n"  # importing, before ready
        "0\t0.5\t101.0\n2\t120.0\t102.0\n2\t30.0\t103.0\n")
    (tmp_path / "12.tsv").write_text(
        "# python -c from multiprocessing.spawn import spawn_main; --multiprocessing-fork\n"
        "1\t2.0\t100.5\n")
    (tmp_path / "13.tsv").write_text("")  # a process that wrote nothing yet
    (tmp_path / "14.tsv").write_text("# python -m tandem.cli.main worker --role both\n")
    router, core, worker = summarize(tmp_path, since=100.0)
    assert (router["pid"], router["kind"], core["kind"]) == (11, "router", "engine core")
    assert worker["kind"] == "worker" and worker["gen2"]["n"] == 0
    assert router["gen2"] == {"n": 2, "total_ms": 150.0, "max_ms": 120.0}
    assert router["gen0"] == {"n": 1, "total_ms": 0.5, "max_ms": 0.5}
    assert core["gen1"]["n"] == 1 and core["gen2"] == {"n": 0, "total_ms": 0.0, "max_ms": 0.0}
