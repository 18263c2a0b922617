"""Reports built from what runs leave (summary.json, metrics.jsonl): a comparison folder
rendered as report.json, report.md, one self-contained report.html and PNG plots
(`render`), the artifacts a training command writes with --artifacts-dir (`artifacts`)
and the consolidated performance report made from them (`perf`).

    runs       a run folder read: summary, each process's records, evaluations on the clock
    digest     one process's figures from its records
    figures    a run's row in a comparison, speed-up, efficiency, rankings
    table      the table as text and Markdown, number formats
    plots      the PNG plots (matplotlib, Agg, loaded on first use)
    html       the self-contained page
    render     a comparison folder -> its report files
    advice     the predicted-scaling section (predictions passed in by the command)
    artifacts  run artifacts: written, read and checked
    perf       the performance report from artifacts
    files      JSON reading with one-line errors, atomic writes
"""

from disttrain.report.render import RenderedReport, render_comparison

__all__ = ["RenderedReport", "render_comparison"]
