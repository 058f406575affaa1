"""vLLM's own engine metrics (`vllm:*`), exported through Ray's metrics agent, per engine.

vLLM ships `RayPrometheusStatLogger`: its Prometheus metrics recorded with
`ray.util.metrics`, so Ray's per-node metrics port serves them (Ray sanitizes
and prefixes the names: `vllm:time_to_first_token_seconds` is scraped as
`ray_vllm_time_to_first_token_seconds`). Here every series also carries the
raypd engine's id and role (`engine_id`, `role`), so prefill and decode
engines stay apart in one scrape. Runs in the EngineActor's process (vLLM's
stat loggers live in the AsyncLLM front-end process).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.ray_wrappers import (
    RayCounterWrapper,
    RayGaugeWrapper,
    RayHistogramWrapper,
    RayKVConnectorProm,
    RayPerfMetricsProm,
    RayPrometheusMetric,
    RayPrometheusStatLogger,
    RaySpecDecodingProm,
)

ENGINE_TAGS = ("engine_id", "role")


def engine_stat_logger(engine_id: str, role: str) -> type:
    """A vLLM stat-logger class whose every metric is tagged with this engine's id and role."""
    extra = {"engine_id": engine_id, "role": role}

    def tagged(base: type) -> type:
        class Tagged(base):
            def __init__(self, *args: Any, **kwargs: Any):
                super().__init__(*args, **kwargs)
                self._tags.update(extra)

            def _get_tag_keys(self, labelnames: list[str] | None) -> tuple[str, ...]:
                return RayPrometheusMetric._get_tag_keys(labelnames) + ENGINE_TAGS

            def _build_tags(self, *labels: Any, **labelskwargs: Any) -> dict[str, str]:
                # positional labels name vLLM's own label names, which come first in the tag keys
                labelskwargs.update(zip(self.metric._tag_keys, labels))
                return {**RayPrometheusMetric._build_tags(self, **labelskwargs), **extra}

        Tagged.__name__ = f"Engine{base.__name__}"
        return Tagged

    gauge, counter, histogram = tagged(RayGaugeWrapper), tagged(RayCounterWrapper), tagged(RayHistogramWrapper)

    class EngineKVConnectorProm(RayKVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = gauge, counter, histogram

    class EngineSpecDecodingProm(RaySpecDecodingProm):
        _counter_cls = counter

    class EnginePerfMetricsProm(RayPerfMetricsProm):
        _counter_cls = counter

    class EngineStatLogger(RayPrometheusStatLogger):
        _gauge_cls, _counter_cls, _histogram_cls = gauge, counter, histogram
        _spec_decoding_cls = EngineSpecDecodingProm
        _kv_connector_cls = EngineKVConnectorProm
        _perf_metrics_cls = EnginePerfMetricsProm

    return EngineStatLogger
