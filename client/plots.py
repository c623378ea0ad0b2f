"""Charts of a run's series (R2): in the terminal with plotext, to a PNG file with matplotlib.

A series may hold millions of points, more than a terminal has columns or a chart pixels: each line is
first thinned to at most a few thousand points, keeping in every bucket of steps its least and greatest
value, so a spike still shows. plotext and matplotlib are imported when a chart is drawn, never when the
CLI starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from libs.contracts.operations.planning import SimulationPoint
from libs.contracts.operations.runs import SeriesPoint

Line = tuple[list[float], list[float]]  # x (step, or the order of logging), y
TERMINAL_POINTS = 2_000
PNG_POINTS = 20_000


def lines_of(points: Iterable[SeriesPoint]) -> dict[str, Line]:
    """One line per task and rank (`rank 0`, or `task 1 rank 0` in a batch job), x the point's step, or
    the order it was logged in where it has none; a step logged again by a later attempt replaces the
    earlier value."""
    by_line: dict[str, dict[float, float]] = {}
    for point in points:
        label = f"rank {point.rank}" if point.task == 0 else f"task {point.task} rank {point.rank}"
        values = by_line.setdefault(label, {})
        values[float(point.step) if point.step is not None else float(len(values))] = point.value
    return {label: (sorted(values), [values[x] for x in sorted(values)]) for label, values in by_line.items()}


def thinned(line: Line, most: int) -> Line:
    """At most `most` points of a line: in each of `most // 2` buckets, its least and greatest value in the
    order they come."""
    xs, ys = line
    if len(xs) <= most:
        return line
    buckets = max(1, most // 2)
    size = len(xs) / buckets
    out_x: list[float] = []
    out_y: list[float] = []
    for bucket in range(buckets):
        start, end = int(bucket * size), int((bucket + 1) * size)
        if start >= end:
            continue
        low = min(range(start, end), key=ys.__getitem__)
        high = max(range(start, end), key=ys.__getitem__)
        for index in sorted({low, high}):
            out_x.append(xs[index])
            out_y.append(ys[index])
    return out_x, out_y


def terminal_chart(lines: Mapping[str, Line], title: str, *, width: int | None = None,
                   height: int | None = None, color: bool = False) -> str:
    """The lines drawn for a terminal (plotext), as text; in colour for a terminal that shows it."""
    import plotext

    plotext.clear_figure()
    plotext.theme("pro" if color else "clear")
    if width and height:
        plotext.plotsize(width, height)
    for label, line in lines.items():
        xs, ys = thinned(line, TERMINAL_POINTS)
        plotext.plot(xs, ys, label=label, marker="braille")
    plotext.title(title)
    plotext.xlabel("step")
    chart: str = plotext.build()
    return chart if color else str(plotext.uncolorize(chart))


def png_chart(lines: Mapping[str, Line], title: str, path: Path) -> None:
    """The lines drawn to a PNG file (matplotlib, without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(10, 5), dpi=100)
    try:
        for label, line in lines.items():
            xs, ys = thinned(line, PNG_POINTS)
            axes.plot(xs, ys, label=label, linewidth=1)
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if len(lines) > 1:
            axes.legend()
        figure.tight_layout()
        figure.savefig(path)
    finally:
        pyplot.close(figure)


def chart_title(job_id: str, name: str, labels: Sequence[str]) -> str:
    return f"{name} of {job_id}" + (f" ({labels[0]})" if len(labels) == 1 else "")


def simulation_png(points: Sequence[SimulationPoint], title: str, path: Path) -> None:
    """`trainyard simulate --png`: the queue's length and the share of CPUs held over the window, real beside
    simulated, in two panels sharing the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (queue, busy) = pyplot.subplots(2, 1, figsize=(10, 6), dpi=100, sharex=True)
    try:
        times = [point.at for point in points]
        queue.plot(times, [p.queued_real for p in points], label="real", linewidth=1.2)
        queue.plot(times, [p.queued_simulated for p in points], label="simulated", linewidth=1.2, linestyle="--")
        queue.set_ylabel("jobs waiting")
        queue.set_title(title)
        busy.plot(times, [100 * p.busy_real for p in points], label="real", linewidth=1.2)
        busy.plot(times, [100 * p.busy_simulated for p in points], label="simulated", linewidth=1.2, linestyle="--")
        busy.set_ylabel("CPUs held (%)")
        busy.set_ylim(0, 105)
        for axes in (queue, busy):
            axes.grid(alpha=0.3)
            axes.legend()
        figure.autofmt_xdate()
        figure.tight_layout()
        figure.savefig(path)
    finally:
        pyplot.close(figure)
