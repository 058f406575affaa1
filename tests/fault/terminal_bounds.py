"""A terminal outcome for every request (issue 25 item 6): per fault class, the bound on the time from
the fault to each affected request's terminal outcome, computed from the deployment's own config
(docs/failure-semantics.md, "Terminal outcome per fault class", derives each formula).

A terminal outcome is an answer (equal to the request's reference) or an error the client can act on:
an SSE error event followed by `[DONE]`, or an HTTP error with an OpenAI error body. A stream that ends
without `[DONE]` and without an error event (cut), or one still open at the bound, fails the test.

One test per class asserts its bound:

  hang              tests/fault/test_vllm_hang.py::test_a_lone_decode_engine_frozen_then_killed_while_restarting
  crash             tests/fault/test_vllm_faults.py::test_twenty_greedy_streams_survive_a_decode_engine_kill
  partition         tests/fault/test_transfer_faults.py::test_partition_ends_every_pulling_stream_with_an_error_event
  READ error        tests/fault/test_transfer_faults.py::test_read_error_ends_every_pulling_stream_with_an_error_event
                    (`fail`); tests/fault/test_vllm_shipped_policy.py::test_read_errors_are_recomputed_into_the_fault_free_answer
                    (`recompute`, vLLM through the Serve front)
  coordinator loss  tests/fault/test_self_healing.py::test_coordinator_killed_under_load;
                    tests/fault/test_vllm_shipped_policy.py::test_coordinator_loss_mid_stream_leaves_every_stream_whole
"""

from __future__ import annotations

import inspect

from serving.cluster.clients import RayDirectory
from serving.config import DeploymentConfig

# The router's migration loop asks the directory at most this far apart (its backoff's cap,
# serving.routing.router.Router.migration_target): the end of `migration_wait_s` is seen this late at most.
MIGRATION_POLL_S = 1.0
# What the bound does not model and a loaded 2-core CI host adds: Ray calls, event-loop turns, the
# chunk's and the SSE's way to the client, the test's own clock readings around the fault.
SLACK_S = 4.0


def coordinator_waits_s(cfg: DeploymentConfig) -> tuple[float, float]:
    """The only coordinator calls a request may wait for, each under its own timeout: a half-open
    pair's probe (router.probe_timeout_s) and a migrating stream's forced route refresh
    (RayDirectory's timeout_s, a code default), as build_router builds them."""
    def default(func, name: str) -> float:
        param = inspect.signature(func).parameters.get(name)
        assert param is not None, f"{func.__qualname__} has no {name} any more: update terminal_bounds"
        return float(param.default)

    return cfg.router.probe_timeout_s, default(RayDirectory.__init__, "timeout_s")


def hang_bound_s(cfg: DeploymentConfig) -> float:
    """A decode engine frozen mid-stream, no engine to take its streams: the first chunk deadline that
    passes finds it silent (token_s = max(token_timeout_s, deadline_margin x the engine's measured gap
    between chunks): token_timeout_s on these engines, whose gaps are far under token_timeout_s /
    deadline_margin) and ends every wait of the router on that incarnation at once; each stream waits
    up to migration_wait_s for an engine to take it over, then ends with an error event."""
    r = cfg.router
    return r.token_timeout_s + r.migration_wait_s + MIGRATION_POLL_S + SLACK_S


def crash_bound_s(cfg: DeploymentConfig, reference_s: float) -> float:
    """A decode engine killed (-9) mid-stream, another one up: Ray's death notice fails its streams at
    once (the chunk deadline, token_timeout_s, if it never came); they migrate to the other engine,
    which recomputes prompt + streamed tokens and streams the rest. The rest may take deadline_margin x
    its fault-free time (`reference_s`, measured under the same load) before the router would call the
    engine hung (busy is not hung), so that is the bound of a stream that completes."""
    r = cfg.router
    return r.token_timeout_s + r.deadline_margin * reference_s + SLACK_S


def partition_bound_s(cfg: DeploymentConfig) -> float:
    """The NIXL link between a prefill and a decode engine carries nothing (READs neither complete nor
    fail): the decode engine's pull fails at transfer.read_timeout_s (the router's first-chunk deadline
    adds the read timeout to a prefill deadline, so it comes later) and the failure policy ends the
    request at the engine's next step: `fail`: an error event after the prefill engine's first token."""
    return cfg.transfer.read_timeout_s + SLACK_S


def read_error_bound_s(cfg: DeploymentConfig) -> float:
    """A READ that ends in error fails its pull at the decode engine's next poll (milliseconds); the
    pull's read_timeout_s bounds it should the error never be reported; the policy ends the request
    as for a partition."""
    return cfg.transfer.read_timeout_s + SLACK_S


def read_error_recompute_bound_s(cfg: DeploymentConfig, local_prefill_s: float) -> float:
    """A READ that ends in error under `recompute`, from the prefill engine's first token (the pull starts
    once the prefill is out) to the decode engine's first one: the pull fails at the decode engine's next
    poll (read_timeout_s should the error never be reported), then the prompt is prefilled on the decode
    engine under its first-chunk deadline, deadline_floor_s + deadline_margin x its fault-free time
    (`local_prefill_s`: the same prompt's prefill on an engine set up alike, measured)."""
    r = cfg.router
    return cfg.transfer.read_timeout_s + r.deadline_floor_s + r.deadline_margin * local_prefill_s + SLACK_S


def coordinator_bound_s(cfg: DeploymentConfig, reference_s: float) -> float:
    """The coordinator killed (Ray restarts it, empty; the engines register again): it is on no request's
    path, so a request overlapping its absence takes its fault-free time (`reference_s`, the slowest
    answer of the same load before the kill; deadline_margin x that on a host busy with the restart),
    plus at most the longest coordinator call a request may wait for (`coordinator_waits_s`)."""
    return cfg.router.deadline_margin * reference_s + max(coordinator_waits_s(cfg)) + SLACK_S


def late(ends: dict, since: dict | float, bound_s: float) -> dict:
    """The requests of `ends` (key -> when it ended) that ended more than `bound_s` after `since` (one
    moment, or key -> moment): key -> seconds it took. Empty when every one met the bound."""
    out = {}
    for key, ended in ends.items():
        t0 = since[key] if isinstance(since, dict) else since
        if ended - t0 > bound_s:
            out[key] = round(ended - t0, 1)
    return out
