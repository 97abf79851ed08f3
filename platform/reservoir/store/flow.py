"""Flow control between explorers and trainers: Reverb's SampleToInsertRatio, in counters.

Each run keeps two counters in its `runs` row: `rows_inserted` (experiences written) and
`rows_sampled` (experiences handed to a trainer and not handed back). With a target
`samples_per_insert` (SPI) and a `tolerance` (Reverb's error_buffer), the quantity

    diff = rows_inserted * SPI - rows_sampled

must stay within `tolerance` of SPI * min_ready (Reverb centres the window there, so the
first min_ready rows can go in before anything is sampled). A trainer that runs ahead of the
explorers drives diff down and is made to wait; explorers that run ahead drive diff up and are
made to wait. A request larger than the window (2 * tolerance) could never be granted: that
would deadlock, so it is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from reservoir.errors import FlowControlTimeout


@dataclass(frozen=True)
class RateLimit:
    samples_per_insert: float
    tolerance: float
    min_ready: int = 1

    @property
    def centre(self) -> float:
        return self.samples_per_insert * self.min_ready

    def diff(self, inserted: int, sampled: int) -> float:
        return inserted * self.samples_per_insert - sampled

    def can_sample(self, inserted: int, sampled: int, n: int) -> bool:
        return self.diff(inserted, sampled + n) >= self.centre - self.tolerance

    def can_insert(self, inserted: int, sampled: int, n: int) -> bool:
        return self.diff(inserted + n, sampled) <= self.centre + self.tolerance

    def check_sample_size(self, n: int) -> None:
        if n > 2 * self.tolerance:
            raise FlowControlTimeout(
                f"a lease of {n} rows can never satisfy samples_per_insert="
                f"{self.samples_per_insert} with spi_tolerance={self.tolerance}: it would "
                f"deadlock; raise spi_tolerance to at least {n / 2:g}"
            )

    def check_insert_size(self, n: int) -> None:
        if n * self.samples_per_insert > 2 * self.tolerance:
            raise FlowControlTimeout(
                f"writing {n} rows at once can never satisfy samples_per_insert="
                f"{self.samples_per_insert} with spi_tolerance={self.tolerance}: it would "
                f"deadlock; raise spi_tolerance to at least {n * self.samples_per_insert / 2:g}"
            )
