"""`hspmd plot`: the loss and throughput of --log files drawn into an image; a missing or malformed
log is one message, never a traceback."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from hspmd.cli.plot import PlotError, plot_logs, read_log

PNG = b"\x89PNG\r\n\x1a\n"


def _log(path, steps: int = 4, with_time: bool = True) -> str:
    with open(path, "w") as f:
        for k in range(1, steps + 1):
            record = {"step": k, "loss": 3.0 / k, "ranks": 2}
            if with_time:
                record["time_s"] = 0.01 * k
            f.write(json.dumps(record) + "\n")
    return str(path)


def test_plot_writes_a_png_of_several_logs(tmp_path):
    a, b = _log(tmp_path / "a.jsonl"), _log(tmp_path / "b.jsonl", 6, with_time=False)
    out = tmp_path / "loss.png"
    proc = run_cli("hspmd", "plot", a, b, "-o", str(out), check=True)
    assert "wrote" in proc.stdout and str(out) in proc.stdout
    assert out.read_bytes().startswith(PNG)


def test_plot_in_process_writes_other_formats(tmp_path):
    out = tmp_path / "loss.svg"
    plot_logs([_log(tmp_path / "a.jsonl")], str(out))
    assert "<svg" in out.read_text()


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("not json\n", ":1: not JSON"),
    ('{"step": 1, "loss": 2.0}\n[1, 2]\n', ":2: expected an object with a numeric 'step' and 'loss'"),
    ('{"step": 1}\n', ":1: expected an object"),
    ("\n", "holds no steps"),
])
def test_bad_logs_are_one_message(tmp_path, content, needle):
    path = tmp_path / "log.jsonl"
    if content is not None:
        path.write_text(content)
    proc = run_cli("hspmd", "plot", str(path), "-o", str(tmp_path / "x.png"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hspmd: error: ") and needle in lines[0], proc.stderr
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(PlotError):
        read_log(str(path))


def test_bad_output_is_one_message(tmp_path):
    log = _log(tmp_path / "a.jsonl")
    for output, needle in ((tmp_path / "no" / "x.png", "directory does not exist"), (tmp_path / "x.nope", "nope")):
        proc = run_cli("hspmd", "plot", log, "-o", str(output))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
