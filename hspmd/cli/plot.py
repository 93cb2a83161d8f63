"""`hspmd plot LOG.jsonl [MORE.jsonl ...] -o loss.png`: the loss and the throughput of runs.

Reads the JSON lines `hspmd run --log` writes (`{"step": k, "loss": x, "time_s": t, ...}`) and
draws, with matplotlib's Agg backend (no display needed), two panels over the steps: the loss,
and the throughput in steps per second (`1 / time_s`), one line per log. A missing file, a
line that is not a JSON object with a step and a loss, or a log without steps is one message
(`PlotError`), never a traceback.
"""

from __future__ import annotations

import json
import math
import os


class PlotError(Exception):
    """A log cannot be plotted (missing, malformed, empty), or matplotlib is not installed."""


def read_log(path: str) -> list[dict]:
    """Return the records of log `path` (objects with a numeric `step` and `loss`)."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PlotError(f"{path}:{number}: not JSON ({err.msg}); expected a log of 'hspmd run --log'") from None
            if not isinstance(record, dict) or not all(
                    isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)
                    for k in ("step", "loss")):
                raise PlotError(f"{path}:{number}: expected an object with a numeric 'step' and 'loss', "
                                f"as 'hspmd run --log' writes")
            records.append(record)
    if not records:
        raise PlotError(f"{path}: the log holds no steps")
    return records


def _throughput(records: list[dict]) -> tuple[list[float], list[float]]:
    """Return (steps, steps per second) of the records that have a positive `time_s`."""
    steps, rates = [], []
    for r in records:
        t = r.get("time_s")
        if isinstance(t, (int, float)) and t > 0 and math.isfinite(t):
            steps.append(r["step"])
            rates.append(1.0 / t)
    return steps, rates


def plot_logs(paths: list[str], output: str) -> str:
    """Draw the logs at `paths` into image `output`; return a line saying what was written."""
    logs = [(path, read_log(path)) for path in paths]
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise PlotError(f"-o {output}: its directory does not exist")
    try:
        import matplotlib
    except ImportError:
        raise PlotError("hspmd plot needs matplotlib: pip install 'hspmd[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for path, records in logs:
        label = path
        loss_ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=label)
        steps, rates = _throughput(records)
        if steps:
            rate_ax.plot(steps, rates, label=label)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("training loss")
    rate_ax.set_ylabel("steps / s")
    rate_ax.set_xlabel("step")
    rate_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rate_ax.set_title("throughput (from time_s)")
    for ax in (loss_ax, rate_ax):
        ax.grid(True, alpha=0.3)
        if len(logs) > 1 or ax.get_lines():
            ax.legend(loc="best")
    fig.tight_layout()
    try:
        fig.savefig(output)
    except ValueError as err:  # a format matplotlib cannot write
        raise PlotError(f"-o {output}: {err}") from None
    finally:
        plt.close(fig)
    return f"wrote {output} ({len(logs)} log{'s' if len(logs) > 1 else ''}, {sum(len(r) for _, r in logs)} steps)"
