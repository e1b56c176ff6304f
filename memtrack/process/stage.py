"""The one shape of a stage's result in `process` (memtrack.process.pipeline): besides
its tables (a subclass's own fields), the counters it adds to the run's meta.counters
and the problems it found, which become the run's warnings (each once). The pipeline's
Stages.run takes both into the summary as each stage ends, so no stage writes to the
summary itself and none of what one found is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageResult:
    counters: dict[str, int] = field(default_factory=dict, kw_only=True)
    problems: list[str] = field(default_factory=list, kw_only=True)
