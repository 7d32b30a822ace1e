"""Point labels that do not overlap: each goes to the first of a ring of places around its point where it
covers no other label, no other point and stays inside the axes; points that coincide share one label.

    boxes = place_labels(ax, [(x, y, "fp8"), (x2, y2, "int8")])   # display-pixel boxes of the labels drawn
"""

from __future__ import annotations

# offsets in points from the point, with the text's alignment: right, left, above, below, then wider rings
_RING = [
    ((7, 5), "left", "bottom"),
    ((7, -5), "left", "top"),
    ((-7, 5), "right", "bottom"),
    ((-7, -5), "right", "top"),
    ((0, 9), "center", "bottom"),
    ((0, -9), "center", "top"),
]
OFFSETS = [((dx * k, dy * k), ha, va) for k in (1, 2.2, 3.6) for (dx, dy), ha, va in _RING]
MARKER_PX = 6  # half the size of a marker, in pixels


def _overlap(a, b) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def group_coinciding(ax, points: list[tuple[float, float, str]], px: float = 4.0) -> list[tuple[float, float, str]]:
    """Points drawn within `px` pixels of each other become one label naming them all ("awq · gptq")."""
    trans = ax.transData.transform
    groups: list[list] = []
    for x, y, text in points:
        dx, dy = trans((x, y))
        for g in groups:
            if abs(g[0] - dx) <= px and abs(g[1] - dy) <= px:
                g[2].append(text)
                break
        else:
            groups.append([dx, dy, [text], x, y])
    return [(g[3], g[4], " · ".join(g[2])) for g in groups]


def place_labels(
    ax, points: list[tuple[float, float, str]], fontsize: float = 8, avoid: list[tuple[float, float]] = ()
) -> list[list[float]]:
    """Draw a label per (grouped) point where it overlaps nothing placed before it; return the labels' display boxes."""
    fig = ax.figure
    fig.canvas.draw()  # the renderer knows text extents only after a draw
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    limits = (frame.x0 + 2, frame.y0 + 2, frame.x1 - 2, frame.y1 - 2)
    trans = ax.transData.transform
    pts = group_coinciding(ax, points)
    markers = [(*trans((x, y)),) for x, y, _ in pts] + [tuple(trans(p)) for p in avoid]
    marker_boxes = [(mx - MARKER_PX, my - MARKER_PX, mx + MARKER_PX, my + MARKER_PX) for mx, my in markers]
    placed: list[list[float]] = []
    # the most crowded points first: they have the fewest free places
    order = sorted(
        range(len(pts)),
        key=lambda i: (
            -sum(
                1
                for j in range(len(pts))
                if abs(markers[i][0] - markers[j][0]) + abs(markers[i][1] - markers[j][1]) < 40
            )
        ),
    )
    for i in order:
        x, y, text = pts[i]
        best = None
        for (dx, dy), ha, va in OFFSETS:
            ann = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                ha=ha,
                va=va,
                fontsize=fontsize,
                zorder=6,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
            )
            bb = ann.get_window_extent(renderer)
            box = [bb.x0, bb.y0, bb.x1, bb.y1]
            outside = (
                max(0.0, limits[0] - box[0])
                + max(0.0, box[2] - limits[2])
                + max(0.0, limits[1] - box[1])
                + max(0.0, box[3] - limits[3])
            )
            cost = (
                sum(_overlap(box, p) for p in placed)
                + sum(_overlap(box, m) for k, m in enumerate(marker_boxes) if k != i)
                + 50 * outside
            )
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, ann, box, (dx, dy))
            else:
                ann.remove()
            if cost == 0:
                break
        _, ann, box, (dx, dy) = best
        if abs(dx) > 10 or abs(dy) > 12:  # far from its point: a thin leader line says whose label it is
            ax.annotate(
                "",
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                arrowprops={"arrowstyle": "-", "color": "#888", "lw": 0.6, "shrinkA": 0, "shrinkB": 4},
                zorder=5,
            )
        placed.append(box)
    return placed
