"""A measured card run held against what its published row publishes and what echobench predicts
for it (a reference workload: `echobench reproduce`, the dashboard's Reference workloads): step
time, tokens/s per GPU and MFU under the row's own FLOP convention, the differences, and whether
the published MFU lies beyond the run's own spread.

The spread is the run's step-time p10-p90 (its measured steps, each at its slowest rank) turned
into MFU and tokens/s per GPU: the figure at the p90 step to the figure at the p10 step. A step
time compares with the published one only where each GPU takes the published tokens a step (the
same micro-batch, accumulation and TP width: a row run as published, or scaled down by reproduce);
tokens/s per GPU and MFU compare at any batch. Each MFU is against its own hardware's peak: the
record's for the measured and predicted, the row convention's for the published.
"""

from __future__ import annotations

from dataclasses import dataclass

from echobench.records.run_figures import mfu_of
from echobench.records.states import RunState


def pct(x: float | None) -> str:
    """An MFU as a percentage to 3 figures (a CPU's 0.437%, a GPU's 46.4%), `-` for none."""
    return "-" if x is None else f"{x * 100:.3g}%"


def relative(a: float | None, b: float | None) -> float | None:
    return a / b - 1 if a is not None and b else None


@dataclass
class ReferenceRow:
    """One card run beside its row's published figures and its prediction (reference_row)."""

    run_id: str
    label: str  # the row id (a card file: its stem)
    source: str  # FILE#ROW (or the card file)
    ran: str  # framework, parallelism and GPUs it ran on
    gpus: int
    status: str
    convention: str | None  # the row's FLOP convention (its formula's text), None for a card file
    steps: int = 0
    step_s: float | None = None  # measured: the median step
    p10_s: float | None = None
    p90_s: float | None = None
    tokens_per_s_per_gpu: float | None = None  # over the measured window
    mfu: float | None = None  # under the row's convention, over the measured window, at the record's peak
    mfu_spread: tuple[float, float] | None = None  # at the p90 and p10 steps
    tokens_spread: tuple[float, float] | None = None
    published: dict | None = None  # validate.published_figures
    same_step: bool = False  # each GPU takes the published tokens a step: the step times compare
    predicted_step_s: float | None = None
    predicted_mfu: float | None = None  # under the row's convention at the record's peak
    predicted_tokens_per_s_per_gpu: float | None = None

    @property
    def published_gpus(self) -> int | None:
        return (self.published or {}).get("gpus")

    def pub(self, key: str) -> float | None:
        return (self.published or {}).get(key)

    @property
    def step_diff(self) -> float | None:
        """measured / published step - 1, where the steps compare (same_step)."""
        return relative(self.step_s, self.pub("step_s")) if self.same_step else None

    @property
    def tokens_diff(self) -> float | None:
        return relative(self.tokens_per_s_per_gpu, self.pub("tokens_per_s_per_gpu"))

    @property
    def mfu_diff(self) -> float | None:
        """measured - published MFU (a fraction: x 100 for percentage points)."""
        p = self.pub("mfu")
        return self.mfu - p if self.mfu is not None and p is not None else None

    def within(self, value: float | None, what: str = "mfu") -> bool | None:
        """Whether `value` (an MFU, or tokens/s per GPU) lies inside the run's spread; None without one."""
        spread = self.mfu_spread if what == "mfu" else self.tokens_spread
        if value is None or spread is None:
            return None
        return spread[0] <= value <= spread[1]

    @property
    def verdict(self) -> str | None:
        """Whether the published figure is "within" or "beyond" the run's spread: its MFU where both have
        one, else its tokens/s per GPU; None where neither compares."""
        inside = self.within(self.pub("mfu")) if self.mfu is not None and self.pub("mfu") is not None else \
            self.within(self.pub("tokens_per_s_per_gpu"), "tokens")
        return None if inside is None else "within" if inside else "beyond"

    def sentence(self) -> str:
        """One line: what the reference reaches against what it published, and whether that is beyond
        the run's spread."""
        if self.status != RunState.OK:
            return f"{self.label}: not measured (status {self.status})"
        if self.ratio is None:
            return (f"{self.label}: measured {self.tokens_per_s_per_gpu:.4g} tokens/s per GPU; no published figure to "
                    "hold it against")
        return f"{self.label}: the reference {self.reaches()}"

    def reaches(self) -> str:
        """"reaches X of its published Y (Z% of it), beyond / within the run's spread (...)": its MFU where
        both have one, else its tokens/s per GPU (a run with a figure to hold against: ratio)."""
        scaled = (f"; on {self.gpus} of its published {self.published_gpus} GPUs"
                  if self.published_gpus and self.published_gpus != self.gpus else "")
        spread = f"at its {self.steps} steps' p90 .. p10 step time"
        if self.mfu is not None and self.pub("mfu") is not None:
            lo, hi = self.mfu_spread or (self.mfu, self.mfu)
            return (f"reaches {pct(self.mfu)} MFU of its published {pct(self.pub('mfu'))} ({self.ratio:.0%} of it), "
                    f"{self.verdict} the run's spread ({pct(lo)}-{pct(hi)} {spread}){scaled}")
        lo, hi = self.tokens_spread or (self.tokens_per_s_per_gpu,) * 2
        return (f"reaches {self.tokens_per_s_per_gpu:.4g} tokens/s per GPU of its published "
                f"{self.pub('tokens_per_s_per_gpu'):.4g} ({self.ratio:.0%} of it), {self.verdict} the run's spread "
                f"({lo:.4g}-{hi:.4g} {spread}){scaled}")

    @property
    def ratio(self) -> float | None:
        """measured / published: its MFU where both have one, else its tokens/s per GPU; None without."""
        if self.mfu is not None and self.pub("mfu"):
            return self.mfu / self.pub("mfu")
        return None if self.tokens_diff is None else self.tokens_diff + 1

    @property
    def stands(self) -> bool | None:
        """Whether the reference stands where it was published (the cluster and the stack are fine):
        within its spread, or at NEAR of its published figure or more; None where nothing compares."""
        if self.status != RunState.OK or self.ratio is None:
            return None
        return self.verdict == "within" or self.ratio >= NEAR

    def beside(self, echo) -> str:
        """One sentence: Echo's MFU on the same device (`echo`: a Record, the best_echo of its records;
        None: none there) next to how the reference stands against its published figure, and what
        that says of an Echo gap."""
        head = (f"Echo {echo.scale} reaches {pct(echo.mfu)} MFU here ({echo.framework} {echo.parallelism}, "
                f"{echo.nodes} x {echo.gpus_per_node}: the best Echo run on {echo.env.device_name})"
                if echo is not None else "no Echo run on its device beside it")
        if self.status != RunState.OK or self.ratio is None:
            return f"{head}; the reference {self.sentence()}"
        verdict = ("the cluster and the stack are fine, the gap is the model's" if self.stands and echo is not None
                   else "the cluster and the stack are fine" if self.stands else "look at the cluster first")
        return f"{head}; the reference {self.label} {self.reaches()}: {verdict}"


# A reference at 90% of its published figure or more stands where it was published even outside its
# own spread: a re-run on other software versions (and, scaled down, over fewer ranks) moves a few percent.
NEAR = 0.9


def best_echo(records: list, device: str | None):
    """The Echo run (no card) on `device` with the highest MFU, among the ok ones; None without one."""
    echo = [r for r in records if not r.card and r.status == RunState.OK and r.mfu is not None
            and r.env.device_name == device]
    return max(echo, key=lambda r: (r.mfu, r.run_id), default=None)


def reference_row(record, published: dict | None = None, predicted_step_s: float | None = None,
                  predicted_mfu: float | None = None) -> ReferenceRow:
    """A card run's record (a Record with `card`) beside the published figures (its card section's,
    else `published`) and its prediction (step time, MFU under the row's convention)."""
    card = record.card or {}
    published = card.get("published") or published
    seq = card.get("seq") or 0
    per_gpu_step = record.global_batch * seq / record.world_size if record.world_size else None
    row = ReferenceRow(run_id=record.run_id, label=card.get("label") or record.scale, source=str(card.get("source", "")),
                       ran=f"{record.framework} {record.parallelism}, {record.nodes} x {record.gpus_per_node}",
                       gpus=record.world_size, status=record.status, convention=card.get("row_convention"),
                       published=published)
    row.same_step = bool(published and per_gpu_step and abs(published["tokens_per_gpu_step"] - per_gpu_step) < 1e-9)
    if predicted_step_s and per_gpu_step:
        row.predicted_step_s = predicted_step_s
        row.predicted_tokens_per_s_per_gpu = per_gpu_step / predicted_step_s
    row.predicted_mfu = predicted_mfu
    if record.status != RunState.OK or not record.step_time_s:
        return row
    row.steps = len(record.step_times_s or [])
    row.step_s, row.p10_s, row.p90_s = record.step_time_s, record.step_time_p10_s, record.step_time_p90_s
    row.tokens_per_s_per_gpu, row.mfu = card.get("tokens_per_s_per_gpu"), card.get("row_mfu")
    if row.p10_s and row.p90_s and per_gpu_step:
        row.tokens_spread = (per_gpu_step / row.p90_s, per_gpu_step / row.p10_s)
        flops, peak = card.get("row_flops_per_token"), record.peak_tflops
        if flops and peak:
            row.mfu_spread = tuple(mfu_of(flops * t, 1, 1, peak) for t in row.tokens_spread)
    return row
