"""Why a request cannot be routed, typed; the front maps each kind to an HTTP status.

Two families:

  from the engines (raised by `EngineClient`s, i.e. `serving.cluster.clients`):
    RequestRejected     the engine refused the request itself (empty prompt, too
                        long, bad ids): the client's fault, never retried, never
                        counted against the engine;
    EngineUnavailable   the engine could not run it (died, unreachable, hung);
                        `died`: the actor is gone, not just this request.
  from the router (raised by `Router.open`, nothing is left running anywhere):
    RoutingError        base, with an OpenAI-style `code`;
      InvalidRequest    an engine refused the request itself (client's fault);
      NoDecodeEngine    no decode-capable engine is alive (or ready);
      NoPrefillEngine   no usable prefill engine and the fallback is `reject`;
      EngineFailed      the engine chosen failed before any output.
"""

from __future__ import annotations


class RequestRejected(Exception):
    """The engine refused the request itself (empty prompt, too long...): the client's fault."""


class EngineUnavailable(Exception):
    """The engine could not run the request (died, unreachable, hung, out of capacity)."""

    def __init__(self, message: str, died: bool = False):
        super().__init__(message)
        self.died = died  # the actor is gone (not just this request failing)


class RoutingError(Exception):
    """The request cannot be served; `code` names why (the front picks the status)."""

    code = "routing_error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequest(RoutingError):
    code = "invalid_prompt"


class NoDecodeEngine(RoutingError):
    code = "no_decode_engine"


class NoPrefillEngine(RoutingError):
    code = "no_prefill_engine"


class EngineFailed(RoutingError):
    code = "engine_error"
