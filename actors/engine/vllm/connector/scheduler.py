"""Scheduler side of RayNixlConnector (runs in vLLM's EngineCore process).

It decides what the worker half does each step: the prefills whose blocks it holds under leases,
the loads it starts (synchronous for pulls of at most `sync_load_max_tokens`, else asynchronous),
the loads it abandons and the leases it releases, and it reports how each lease and each failed
pull ended to the EngineActor through the step's connector stats. Invariants: the last prompt
token is never counted as external (vLLM needs one token to compute); malformed params never reach
the worker (the request is computed locally); a failed pull's reasons reach the EngineActor once,
before any output of a later step. The life cycle of a request as this half sees it:
`ConnectorScheduler`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from actors.engine.vllm.connector.metadata import (
    LeaseEnds,
    LeaseEndStats,
    RayNixlMetadata,
    RecvSpec,
    SendSpec,
)
from actors.engine.vllm.leases import EXPIRED, READ, RELEASED
from actors.transfer_params import TransferParams, TransferParamsError

logger = logging.getLogger("raypd.connector")

# kv_transfer_params of a release request (vLLM's `notify_kv_transfer_request_rejected`):
# the vLLM id of the held prefill whose blocks must be freed now.
RELEASE_KEY = "raypd_release"


def _flat_block_ids(block_ids: Any) -> list[int]:
    if block_ids and isinstance(block_ids, (tuple, list)) and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in (block_ids or [])]


class ConnectorScheduler:
    """Life cycle of a request as this half sees it:

      prefill engine (params has do_remote_decode)
        request_finished     finished normally -> its blocks are held (delay free),
                             the worker gets them under a lease, and the transfer
                             params go back to the caller; aborted -> freed now;
        release              nobody will read it (the router or the ledger let go):
                             the EngineActor submits an aborted request through
                             vLLM's rejection hook whose params name it
                             (`RELEASE_KEY`); its request_finished puts the id on
                             the next step's release list, the workers drop the
                             lease in that step;
        worker finished_sending   the readers notified, the lease expired or was
                             released -> vLLM frees the blocks; once vLLM reports it
                             finished on every rank, `update_connector_output`
                             names how it ended (expired or released when a rank's
                             `LeaseEnds` said so, else read: the readers' notices)
                             and the step's connector stats (`lease_ends`) carry
                             that to the EngineActor, whose held leases end then.
      decode engine (params has do_remote_prefill)
        get_num_new_matched_tokens   the remote prompt tokens count as external
                             (never the last token: vLLM needs one token to
                             compute); a pull of at most `sync_load_max_tokens`
                             loads synchronously, a larger one asynchronously;
        update_state_after_alloc     the local blocks to fill are known -> recv;
        async: worker finished_recving   the request is scheduled; a failure comes
                             with failed_recving + invalid blocks and vLLM applies
                             kv_load_failure_policy (recompute or fail);
        sync: scheduled at once; the workers pull before the step's forward (no
                             scheduler step spent waiting); a failure comes as
                             invalid blocks only (vLLM recomputes or fails the
                             request), and `update_connector_output` marks its
                             prefill stats as not pulled, so the first delta's
                             `num_cached_tokens` tells the engine what happened;
        either: failed       the ranks' reasons (their `LeaseEnds`) go to the
                             EngineActor with the step's connector stats, once per
                             request, before any output of a later step;
        request_finished     aborted before loading -> abandon (producer freed).

    Malformed params never reach the worker: they are logged and the request is
    computed locally.
    """

    def __init__(self, engine_id: str, tp_size: int, pp_size: int, dcp_size: int, block_size: int,
                 lease_ttl_s: float, clock=time.time, sync_load_max_tokens: int = 0):
        self.engine_id = engine_id
        self.tp_size, self.pp_size, self.dcp_size = tp_size, pp_size, dcp_size
        self.block_size = block_size
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self.sync_load_max_tokens = sync_load_max_tokens
        # decode requests not yet allocated: their params, the local prefix hit (tokens), sync or not
        self._pending_params: dict[str, tuple[TransferParams, int, bool]] = {}
        # sync loads until their request finishes: the request and the blocks the workers fill
        self._sync: dict[str, tuple[Any, frozenset[int]]] = {}
        self._meta = RayNixlMetadata()
        # leases some rank let expire / dropped for the release list, until vLLM reports them finished
        self._expired: set[str] = set()
        self._dropped: set[str] = set()
        self._ended = LeaseEndStats()  # leases finished on every rank since the last step's stats
        self.stats = {"held": 0, "loads": 0, "sync_loads": 0, "async_loads": 0, "sync_failures": 0,
                      "bad_params": 0, "abandoned": 0, "released": 0,
                      "leases_read": 0, "leases_expired": 0, "leases_released": 0, "pulls_failed": 0}

    # ---------------------------------------------------------------- decode
    def _params(self, request: Any) -> TransferParams | None:
        raw = request.kv_transfer_params
        if not raw or not raw.get("do_remote_prefill"):
            return None
        try:
            return TransferParams.parse(raw)
        except TransferParamsError as exc:
            self.stats["bad_params"] += 1
            logger.warning("request %s: %s; computing it locally", request.request_id, exc)
            raw["do_remote_prefill"] = False
            return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)
        if params is None:
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        # The decode prompt may carry the first token the prefill engine already
        # sampled; the remote KV then covers the whole original prompt.
        usable = params.num_tokens if prompt_len > params.num_tokens else prompt_len - 1
        count = usable - num_computed_tokens
        if count <= 0:
            return 0, False
        # vLLM calls update_state_after_alloc before it sets request.num_computed_tokens: keep
        # the local prefix hit now, or cached blocks would be overwritten and later ones left unread
        sync = count <= self.sync_load_max_tokens
        self._pending_params[request.request_id] = (params, num_computed_tokens, sync)
        return count, not sync

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pending = self._pending_params.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        params, computed, sync = pending  # tokens the local prefix cache already holds
        local_ids = list(blocks.get_block_ids()[0])
        end = computed + num_external_tokens
        # With DCP a block id covers block_size tokens on each of dcp ranks.
        local_span, remote_span = self.block_size * self.dcp_size, params.block_size * params.dcp_size
        # Prefix-cached blocks are not read again, except for token-sharded reads (dcp
        # sizes differ), which address tokens from the first block on.
        first = computed // local_span if self.dcp_size == params.dcp_size else 0
        last = math.ceil(end / local_span)
        ratio = local_span // remote_span if local_span % remote_span == 0 else 0
        if ratio == 0 and self.dcp_size == params.dcp_size:  # refused up front by the coordinator
            logger.warning("request %s: remote block size %d does not divide %d", request.request_id,
                           params.block_size, self.block_size)
        remote_end = min(len(params.remote_block_ids), math.ceil(end / remote_span))
        self._meta.recv[request.request_id] = RecvSpec(
            params=params,
            local_block_ids=tuple(local_ids[first:last]),
            remote_block_ids=tuple(params.remote_block_ids[first * max(ratio, 1):remote_end]),
            num_tokens=end,
            sync=sync,
        )
        if sync:
            self._sync[request.request_id] = (request, frozenset(local_ids[first:last]))
        request.kv_transfer_params["do_remote_prefill"] = False  # a retry must not pull again
        self.stats["loads"] += 1
        self.stats["sync_loads" if sync else "async_loads"] += 1

    def update_connector_output(self, output: Any) -> None:
        """How the leases vLLM now frees ended; a sync load that failed (its blocks invalid): vLLM
        recomputes it as a running request, whose prefill stats were set at admission; say it
        pulled nothing past its local hit."""
        self._leases_ended(output)
        invalid = getattr(output, "invalid_block_ids", None)
        if not invalid or not self._sync:
            return
        for req_id, (request, blocks) in list(self._sync.items()):
            if blocks & invalid:
                del self._sync[req_id]
                self.stats["sync_failures"] += 1
                stats = getattr(request, "prefill_stats", None)
                if stats is not None:
                    local = min(int(request.num_computed_tokens), stats.num_prompt_tokens)
                    stats.set(stats.num_prompt_tokens, local, 0)

    def _leases_ended(self, output: Any) -> None:
        """finished_sending is merged over the ranks (vLLM reports a lease once every rank ended
        it); a rank's `LeaseEnds` comes with its own report, so never after the merged one."""
        ranks = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(ranks, LeaseEnds):
            self._expired |= ranks.expired
            self._dropped |= ranks.released
            failed: dict[str, str] = {}
            for req_id, reason in ranks.failed_pulls:  # one per request: the first rank's reason
                failed.setdefault(req_id, reason)
            for req_id, reason in failed.items():
                self._ended.pull_failed(req_id, reason)
                self.stats["pulls_failed"] += 1
        for req_id in getattr(output, "finished_sending", None) or ():
            how = EXPIRED if req_id in self._expired else RELEASED if req_id in self._dropped else READ
            self._expired.discard(req_id)
            self._dropped.discard(req_id)
            self._ended.add(how, req_id)
            self.stats[f"leases_{how}"] += 1

    def lease_ends(self) -> LeaseEndStats | None:
        """The leases finished since the last call, by how they ended (vLLM asks once per step, after
        `update_connector_output`, and carries them to the EngineActor in the step's stats)."""
        if self._ended.is_empty():
            return None
        ended, self._ended = self._ended, LeaseEndStats()
        return ended

    # --------------------------------------------------------------- prefill
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        raw = request.kv_transfer_params
        if not raw:
            return False, None
        req_id = request.request_id
        self._sync.pop(req_id, None)
        release = raw.get(RELEASE_KEY)
        if release:
            self._meta.release.add(str(release))
            self.stats["released"] += 1
            return False, None
        if raw.get("do_remote_prefill"):
            # Finished (aborted) before it ever pulled: let the producer free now.
            pending = self._pending_params.pop(req_id, None)
            params = pending[0] if pending is not None else None
            if params is None:
                try:
                    params = TransferParams.parse(raw)
                except TransferParamsError:
                    params = None
            if params is not None:
                self._meta.abandon[req_id] = params
                self.stats["abandoned"] += 1
            return False, None
        if not raw.get("do_remote_decode"):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        ids = _flat_block_ids(block_ids)
        if status != "FINISHED_LENGTH_CAPPED" or not ids:  # stopped: nothing left to decode
            return False, None
        ttl = float(raw.get("lease_ttl_s", self.lease_ttl_s))
        self._meta.send[req_id] = SendSpec(tuple(ids), ttl)
        self.stats["held"] += 1
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,  # vLLM's own (suffixed) id: readers' notices must name it
            "remote_block_ids": ids,
            "num_tokens": int(request.num_computed_tokens),
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dcp_size": self.dcp_size,
            "block_size": self.block_size,
            "lease_expiry": self._clock() + ttl,
        }

    # ------------------------------------------------------------------ step
    def build_connector_meta(self) -> RayNixlMetadata:
        meta, self._meta = self._meta, RayNixlMetadata()
        return meta
