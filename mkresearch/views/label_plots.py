"""Where a figure's text labels sit, as the renderer draws them: labels that overlap each other,
labels cut by the figure's edge, data labels that cross their axes' frame or sit on a line.

    drawn_texts(fig)          -> every text the figure draws (titles, axis and tick labels,
                                 legend entries, annotations), with a name saying which
    overlapping_labels(fig)   -> pairs of drawn texts whose boxes overlap
    labels_off_figure(fig)    -> drawn texts cut by the figure's edge
    labels_off_axes(fig)      -> annotations / axes texts reaching out of their axes
    labels_on_lines(fig)      -> annotations / axes texts drawn over one of their axes' lines

Tests run them over every committed figure and every notebook chart's plot function; notebooks
assert them on the charts they draw inline. The boxes are the renderer's (`get_window_extent`),
so the answer is the picture's, at the figure's own size and dpi.
"""

from __future__ import annotations

TOLERANCE_PX = 1.0  # boxes that merely touch (a pixel of antialiasing) do not count


def drawn_texts(fig) -> list[tuple[str, object]]:
    """(name, Text) for every non-empty visible text the figure draws. Tick labels are the ones
    the axis draws now (inside its view), not every Text object it keeps."""
    _renderer(fig)
    texts: list[tuple[str, object]] = []

    def add(name, text):
        if any(text is seen for _, seen in texts):
            return  # the suptitle is also one of the figure's texts
        if text is not None and text.get_visible() and text.get_text().strip():
            texts.append((f"{name} {text.get_text()!r}", text))

    suptitle = fig.get_suptitle()  # its Text is one of the figure's texts: the first of them
    for text in [t for t in fig.texts if suptitle and t.get_text() == suptitle][:1]:
        add("suptitle", text)
    for text in fig.texts:
        add("figure text", text)
    for legend in fig.legends:
        for text in legend.get_texts():
            add("figure legend", text)
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        where = f"axes {i}"
        for title in _titles(ax):
            add(f"{where} title", title)
        for axis, letter in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            if not axis.get_visible():
                continue
            add(f"{where} {letter}-label", axis.label)
            add(f"{where} {letter} offset", axis.get_offset_text())
            # the ticks it draws: inside the view only. matplotlib's one private name here: no
            # public call says which ticks are drawn (get_ticklabels returns every Tick the axis
            # keeps, outside the view too)
            for tick in axis._update_ticks():
                add(f"{where} {letter}-tick", tick.label1)
                add(f"{where} {letter}-tick", tick.label2)
        for text in ax.texts:
            add(f"{where} annotation", text)
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            add(f"{where} legend title", legend.get_title())
            for text in legend.get_texts():
                add(f"{where} legend", text)
    return texts


def _titles(ax) -> list:
    """The axes' three title Texts (center, left, right): its children that are Texts and not
    among its own texts (matplotlib's public calls give a title's string, not its Text)."""
    from matplotlib.text import Text

    texts = set(ax.texts)
    return [child for child in ax.get_children()
            if isinstance(child, Text) and child not in texts]


def _renderer(fig):
    """The figure drawn by Agg, and its renderer. A figure pyplot has closed keeps a bare
    canvas that cannot draw: it gets an Agg canvas first."""
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    if fig.stale:  # drawn once for all the checks, unless something changed since
        fig.canvas.draw()
    return fig.canvas.get_renderer()


def _boxes(fig):
    renderer = _renderer(fig)
    return [(name, text, text.get_window_extent(renderer)) for name, text in drawn_texts(fig)]


def _overlap(a, b, tolerance: float = TOLERANCE_PX) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > tolerance
            and min(a.y1, b.y1) - max(a.y0, b.y0) > tolerance)


def overlapping_labels(fig) -> list[tuple[str, str]]:
    """Pairs of drawn texts (by name) whose bounding boxes overlap: unreadable labels."""
    boxes = _boxes(fig)
    return [(name_a, name_b) for i, (name_a, _, a) in enumerate(boxes)
            for name_b, _, b in boxes[i + 1:] if _overlap(a, b)]


def labels_off_axes(fig) -> list[str]:
    """Annotations and axes texts whose box reaches out of their axes (into a title, a
    neighbour, off the figure)."""
    renderer = _renderer(fig)
    out = []
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        for text in ax.texts:
            if not (text.get_visible() and text.get_text().strip()):
                continue
            box = text.get_window_extent(renderer)
            if (box.x0 < frame.x0 - TOLERANCE_PX or box.x1 > frame.x1 + TOLERANCE_PX
                    or box.y0 < frame.y0 - TOLERANCE_PX or box.y1 > frame.y1 + TOLERANCE_PX):
                out.append(text.get_text())
    return out


def labels_off_figure(fig) -> list[str]:
    """Drawn texts (by name) cut by the figure's edge."""
    frame = fig.bbox
    return [name for name, _, box in _boxes(fig)
            if (box.x0 < frame.x0 - TOLERANCE_PX or box.x1 > frame.x1 + TOLERANCE_PX
                or box.y0 < frame.y0 - TOLERANCE_PX or box.y1 > frame.y1 + TOLERANCE_PX)]


def labels_on_lines(fig, samples: int = 64) -> list[tuple[str, str]]:
    """(text, line label) for every annotation / axes text whose box a line of its axes crosses
    (each line segment sampled at `samples` points, in pixels)."""
    import numpy as np

    renderer = _renderer(fig)
    out = []
    for ax in fig.axes:
        for text in ax.texts:
            if not (text.get_visible() and text.get_text().strip()):
                continue
            box = text.get_window_extent(renderer)
            for line in ax.lines:
                if not line.get_visible() or line.get_linestyle() in ("None", "", " "):
                    continue
                xy = line.get_transform().transform(np.column_stack(line.get_data()))
                xy = xy[np.all(np.isfinite(xy), axis=1)]
                if len(xy) < 2:
                    continue
                t = np.linspace(0.0, 1.0, samples)[:, None, None]
                points = (xy[:-1] + t * (xy[1:] - xy[:-1])).reshape(-1, 2)
                inside = ((points[:, 0] > box.x0 + TOLERANCE_PX) & (points[:, 0] < box.x1 - TOLERANCE_PX)
                          & (points[:, 1] > box.y0 + TOLERANCE_PX) & (points[:, 1] < box.y1 - TOLERANCE_PX))
                if inside.any():
                    out.append((text.get_text(), line.get_label()))
    return out


def label_problems(fig) -> list[str]:
    """Every problem of the three kinds above, one line each; empty for a readable figure."""
    return ([f"overlap: {a} and {b}" for a, b in overlapping_labels(fig)]
            + [f"cut by the figure's edge: {name}" for name in labels_off_figure(fig)]
            + [f"off its axes: {t!r}" for t in labels_off_axes(fig)]
            + [f"on a line: {t!r} over {line!r}" for t, line in labels_on_lines(fig)])
