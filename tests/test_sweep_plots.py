"""Plots that cannot mislead: missing points are marked, seeds give a mean and a spread, the
subtitle names what the numbers depend on, the legend sits outside the data."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402

from experiments import plots  # noqa: E402


def _frame(rows):
    return pl.DataFrame(rows, schema={"x": pl.Utf8, "attention": pl.Utf8, "seed": pl.Utf8, "status": pl.Utf8,
                                      "m": pl.Float64}, orient="row")


def _capture(monkeypatch):
    """Keep the last figure instead of closing it."""
    figs = []
    monkeypatch.setattr(plots.plt, "close", lambda fig: figs.append(fig))
    return figs


def test_missing_points_are_marked_and_seeds_averaged(tmp_path, monkeypatch):
    figs = _capture(monkeypatch)
    df = _frame([
        ("256", "jagged", "0", "OK", 1.0), ("256", "jagged", "1", "OK", 3.0),
        ("512", "jagged", "0", "OK", 2.0), ("512", "jagged", "1", "OK", 2.0),
        ("256", "sdpa", "0", "OK", 1.5), ("256", "sdpa", "1", "OK", 1.5),
        ("512", "sdpa", "0", "OOM", None), ("512", "sdpa", "1", "OOM", None),
    ])
    path = plots.line_plot(df, "x", ["256", "512", "1024"], ["attention", "seed"], "m", "metric (units)", "T",
                           tmp_path / "p.png", subtitle="H100 | data paper | 300 steps | commit abc", seeds="seed")
    assert path.is_file()
    fig = figs[-1]
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("NOT RUN") == 2 and texts.count("OOM") == 1  # 1024 for both; 512 for sdpa
    labels = ax.get_legend().get_texts()
    assert any("mean of 2 seeds" in t.get_text() for t in labels)
    # the jagged line is the seed mean (2.0 at both x), its error bar spans min to max (1 to 3)
    jagged = [c for c in ax.containers if c.get_label().startswith("jagged (mean")][0]
    assert list(jagged.lines[0].get_ydata()) == [2.0, 2.0]
    (bars,) = jagged.lines[2]
    assert [list(seg[:, 1]) for seg in bars.get_segments()] == [[1.0, 3.0], [2.0, 2.0]]
    assert any("commit abc" in t.get_text() for t in fig.texts)
    # the legend is outside the axes (anchored right of them)
    assert ax.get_legend().get_bbox_to_anchor().x0 >= ax.get_window_extent().x1 - 1


def test_ratio_panels_say_which_way_and_mark_gaps(tmp_path, monkeypatch):
    figs = _capture(monkeypatch)
    ratios = {"jagged / sdpa": {"x": ["256", "512"], "throughput": [2.0, None], "memory": [1.5, None],
                                "note": ["", "sdpa OOM"]}}
    plots.ratio_plot(ratios, "x", ["256", "512", "1024"], "t", tmp_path / "r.png", baseline="jagged")
    speed, memory = figs[-1].axes[:2]
    assert "above 1: jagged faster" in speed.get_ylabel() and "above 1: jagged leaner" in memory.get_ylabel()
    assert [t.get_text() for t in speed.texts] == ["sdpa OOM", "NOT RUN"]
    plt.close("all")


def test_seeds_as_x_draw_one_column_per_series_not_a_line_across_seeds(tmp_path, monkeypatch):
    figs = _capture(monkeypatch)
    df = _frame([
        ("a", "jagged", "0", "OK", 1.0), ("a", "jagged", "1", "OK", 3.0), ("a", "jagged", "2", "OK", 2.0),
        ("a", "sdpa", "0", "OK", 1.5), ("a", "sdpa", "1", "KILLED", None), ("a", "sdpa", "2", "OK", 2.5),
    ]).drop("x")
    path = plots.line_plot(df, "seed", ["0", "1", "2"], ["attention", "seed"], "m", "metric (units)", "T",
                           tmp_path / "p.png", seeds="seed")
    assert path.is_file()
    ax = figs[-1].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["jagged (3)", "sdpa (2)"]  # each column's seeds
    assert [t.get_text() for t in ax.texts] == ["KILLED"]  # sdpa's missing seed is said, under its column
    assert [c.lines[0].get_ydata()[0] for c in ax.containers] == [2.0, 2.0]  # the means, in column order
    assert sorted(ax.lines[0].get_ydata()) == [1.0, 2.0, 3.0]  # jagged's dots
    _, labels = ax.get_legend_handles_labels()  # one entry per kind of mark (and per gap), not per column
    assert labels == ["one dot per seed (how many: beside the name)", "sdpa: no number (KILLED)", "mean, bar min to max"]


def test_a_categorical_axis_draws_points_not_a_line_between_categories(tmp_path, monkeypatch):
    """Variants (baseline, heads_1, ...) have no order: a line through them would suggest a trend;
    a numeric axis keeps its line."""
    figs = _capture(monkeypatch)
    rows = [("baseline", "jagged", "0", "OK", 1.0), ("heads_1", "jagged", "0", "OK", 2.0),
            ("layers_0", "jagged", "0", "OK", 1.5)]
    plots.line_plot(_frame(rows), "x", ["baseline", "heads_1", "layers_0"], ["attention"], "m", "metric (units)",
                    "T", tmp_path / "c.png")
    (drawn,) = [ln for ln in figs[-1].axes[0].lines if ln.get_label() == "jagged"]
    assert drawn.get_linestyle() == "None" and list(drawn.get_ydata()) == [1.0, 2.0, 1.5]
    plots.line_plot(_frame(rows), "x", ["baseline", "heads_1", "layers_0"], [], "m", "metric (units)", "T",
                    tmp_path / "one.png")
    assert figs[-1].axes[0].get_legend() is None  # one series without a name: no legend saying "all"
    numeric = [(x, *r[1:]) for x, r in zip(["64", "256", "1024"], rows)]
    plots.line_plot(_frame(numeric), "x", ["64", "256", "1024"], ["attention"], "m", "metric (units)", "T",
                    tmp_path / "n.png")
    (drawn,) = [ln for ln in figs[-1].axes[0].lines if ln.get_label() == "jagged"]
    assert drawn.get_linestyle() == "-"
    ratios = {"jagged / sdpa": {"x": ["a", "b"], "throughput": [2.0, 3.0], "memory": [1.5, 1.2], "note": ["", ""]}}
    plots.ratio_plot(ratios, "x", ["a", "b"], "t", tmp_path / "r.png")
    assert all(ln.get_linestyle() == "None" for ax in figs[-1].axes[:2] for ln in ax.lines if ln.get_label() == "vs sdpa")
    plt.close("all")


def test_pareto_front_keeps_the_runs_no_other_beats_on_both():
    pts = [(100.0, 0.70), (50.0, 0.72), (80.0, 0.69), (30.0, 0.72), (10.0, 0.75)]
    assert plots.pareto_front(pts) == [(100.0, 0.70), (50.0, 0.72), (10.0, 0.75)]


def test_pareto_plot_draws_every_finished_run_and_the_oracle_of_each_length(tmp_path, monkeypatch):
    figs = _capture(monkeypatch)
    df = pl.DataFrame({"max_seq_len": ["1024", "4096", "4096", "4096"], "attention": ["dense", "dense", "s2", "s2h"],
                       "status": ["OK", "OK", "OK", "OOM"], "speed": [900.0, 300.0, 600.0, None],
                       "test/auc": [0.70, 0.74, 0.73, None]})
    oracle = {"auc": 0.85, "auc_recent_0": 0.6, "auc_recent_1024": 0.77, "auc_recent_4096": 0.84, "auc_recent_16384": 0.85}
    path = plots.pareto_plot(df, "max_seq_len", ["max_seq_len", "attention"], "speed", tmp_path / "p.png", oracle)
    assert path.is_file()
    ax = figs[-1].axes[0]
    dots = {tuple(line.get_xydata()[0]) for line in ax.lines if line.get_label() in ("dense", "s2")}
    assert (600.0, 0.73) in dots and (900.0, 0.70) in dots
    texts = [t.get_text() for t in ax.texts]
    assert "oracle, last 1024 items" in texts and "oracle, last 4096 items" in texts
    assert "oracle, last 16384 items" not in texts  # no run at that length
    assert "max_seq_len=4096" in texts and ax.get_xscale() == "log"
    front = [line for line in ax.lines if line.get_label().startswith("Pareto")][0]
    assert [tuple(p) for p in front.get_xydata()] == [(900.0, 0.70), (600.0, 0.73), (300.0, 0.74)]
    assert plots.pareto_plot(df.with_columns(status=pl.lit("OOM")), "max_seq_len", ["attention"], "speed",
                             tmp_path / "q.png") is None


def test_a_saved_plot_is_a_palette_png_with_its_text_and_exact_flat_colours(tmp_path):
    from PIL import Image

    from experiments.figures import save_png

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_facecolor((1.0, 0.0, 0.0))
    for k in range(40):  # more shades than a plot needs, fewer than the palette's 256
        ax.plot([0, 1], [k, k + 1], color=(k / 40, 0.5, 1 - k / 40))
    path = save_png(fig, tmp_path / "p.png", dpi=80, metadata={"Title": "T", "Description": "commit abc"})
    assert not plt.fignum_exists(fig.number)  # closed
    with Image.open(path) as im:
        assert im.mode == "P" and im.text["Title"] == "T" and im.text["Description"] == "commit abc"
        rgb = im.convert("RGB")
        colours = {c for _, c in rgb.getcolors(256)}
    assert (255, 0, 0) in colours  # flat areas keep their colour: no dithering, no shift


def test_a_long_subtitle_is_broken_to_the_figure_width(tmp_path, monkeypatch):
    figs = _capture(monkeypatch)
    df = _frame([("256", "jagged", "0", "OK", 1.0)])
    long = " | ".join(f"commit {c}{c}{c}{c}abc" for c in "0123456789abcdef")  # ~300 characters
    plots.line_plot(df, "x", ["256"], ["attention", "seed"], "m", "metric", "T", tmp_path / "p.png", subtitle=long)
    (text,) = [t.get_text() for t in figs[-1].texts if "commit" in t.get_text()]
    assert text.replace("\n", " ") == long and text.count("\n") >= 1  # every word kept, on several lines
