"""The alpha-beta fits of `echobench calibrate --comm`'s collective points (echobench.calibrate.commbench
measures them): fit_alpha_beta of one set of points, fit_links of a profile's links per kind of
group. No torch import: predict and the tests fit without it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from echobench.hardware.nccltuning import least_latency_s
from echobench.hardware.profile import AlphaBeta, CommPoint, bus_factor


# ---- the alpha-beta fit ----

def fit_alpha_beta(points: Sequence[CommPoint], op: str) -> tuple[float, float, float]:
    """(alpha_s, bus_gbps, rel_rms) of time = alpha + bus_bytes / (bus_gbps * 1e9) over `points`,
    bus_bytes = hwprofile.bus_factor(op, group_size) * nbytes.

    Least squares of the RELATIVE residuals ((fit - t) / t): plain least squares would let the
    milliseconds of the largest messages decide alpha, the microseconds of the small ones being
    noise to it; relative residuals weigh both ends, so alpha comes from the small messages and the
    bandwidth from the large. A negative alpha (noise) is refitted as zero; a non-positive slope
    (time did not grow with size over the measured range) gives the fastest bus rate seen.
    rel_rms: the root mean square of the relative residuals."""
    if not points:
        raise ValueError("fit_alpha_beta: no points")
    x = [bus_factor(op, p.group_size) * p.nbytes for p in points]
    t = [p.seconds for p in points]
    alpha, beta = 0.0, 0.0
    if len(set(x)) >= 2:
        a = np.array([[1 / ti, xi / ti] for xi, ti in zip(x, t)])
        (alpha, beta), *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        alpha, beta = float(alpha), float(beta)
    if beta <= 0:  # no growth with size: the fastest bus rate seen, then the latency that fits with it
        beta = min(ti / xi for xi, ti in zip(x, t))
        alpha = sum((1 - beta * xi / ti) / ti for xi, ti in zip(x, t)) / sum(1 / ti ** 2 for ti in t)
    if alpha < 0:  # latency below the noise: bandwidth alone
        r = [xi / ti for xi, ti in zip(x, t)]
        alpha, beta = 0.0, sum(r) / sum(ri * ri for ri in r)  # argmin of sum((beta x / t - 1)^2)
    rms = math.sqrt(sum(((alpha + beta * xi) / ti - 1) ** 2 for xi, ti in zip(x, t)) / len(t))
    return alpha, 1 / beta / 1e9, rms


def fit_links(points: dict[tuple[str, str, int], list[CommPoint]], source: str, nccl: bool = False
              ) -> tuple[dict[str, dict[str, AlphaBeta]], dict[str, dict[str, list[AlphaBeta]]]]:
    """(links, link_kinds) of a profile from points per (link, op, ranks per node): one fit per kind
    of group, never pooled (a one-rank-per-node group runs through one NIC, a group of every rank of
    its nodes through all of them). links holds each (link, op)'s fit of the most ranks per node
    (the node's every rank: how data-parallel groups over all ranks run), link_kinds the others
    (hwprofile.pick_fit takes the fit of a group's kind). Each fit records its kind (per_node) and
    its largest group (group_size: where its alpha is taken). `nccl`: the points of smaller groups
    are first moved to the largest by NCCL's latency difference between the two (nccltuning's least
    latency, what a small message pays), so that alpha is the largest group's and not an average
    over the hop counts measured. `source`: the text every fit's source starts with."""
    links: dict[str, dict[str, AlphaBeta]] = {}
    kinds: dict[str, dict[str, list[AlphaBeta]]] = {}
    pooled: dict[tuple[str, str, int], list[CommPoint]] = {}
    for (link, op, per_node), pts in points.items():  # within a node every group is of one kind: pooled
        pooled.setdefault((link, op, per_node if link == "inter" else 0), []).extend(pts)
    for (link, op, per_node), pts in sorted(pooled.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        alpha, gbps, rms = fit_alpha_beta([_at_largest(p, pts, op, link) for p in pts] if nccl else pts, op)
        groups = sorted({p.group_size for p in pts})
        where = f", {per_node} per node" if per_node else ""
        fit = AlphaBeta(alpha_s=alpha, bus_gbps=gbps, rel_rms=rms, group_size=max(groups), per_node=per_node or None,
                        points=sorted(pts, key=lambda p: (p.group_size, p.nbytes)),
                        source=f"{source}, float32 messages {min(p.nbytes for p in pts)} B .. {max(p.nbytes for p in pts)} B, "
                               f"groups of {', '.join(map(str, groups))} ranks{where}); fit: "
                               "commbench.fit_alpha_beta (least squares of relative residuals)")
        if op not in links.setdefault(link, {}):
            links[link][op] = fit
        else:
            kinds.setdefault(link, {}).setdefault(op, []).append(fit)
    return links, kinds


def _at_largest(point: CommPoint, points: Sequence[CommPoint], op: str, link: str) -> CommPoint:
    """`point` as if taken on the largest group of `points`: plus NCCL's latency difference (never
    below half its time)."""
    def latency(p: CommPoint) -> float:
        ppn = p.per_node if link == "inter" and p.per_node else p.group_size
        return least_latency_s(op, p.group_size, max(1, p.group_size // ppn))

    largest = max(points, key=lambda p: p.group_size)
    return point.model_copy(update={"seconds": max(point.seconds / 2, point.seconds + latency(largest) - latency(point))})
