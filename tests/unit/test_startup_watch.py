"""The coordinator's start-up deadlines without Ray (actors/control/startup_watch.py): an engine whose
incarnation the coordinator evicted (dead or hung) is awaited back; one that registers again clears its
deadline; one that has not registered by its deadline is killed for a restart once per deadline and
awaited anew (counted); one that left on purpose, was draining, or whose actor Ray will not restart is
not awaited."""

from __future__ import annotations

import asyncio

import ray.exceptions

from actors.control.coordinator import Coordinator
from actors.control.startup_watch import StartupWatch
from tests.unit.test_handshake import payload
from tests.unit.test_liveness import FakeActor, stop


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ray:
    """What the watch asks of Ray: each actor's state, and kills (recorded)."""

    def __init__(self):
        self.states: dict[str, str | None] = {}
        self.killed: list[str] = []

    async def state(self, handle: str) -> str | None:
        return self.states.get(handle, "ALIVE")

    def kill(self, handle: str) -> None:
        self.killed.append(handle)


def watch(deadline_s: float = 60.0) -> tuple[StartupWatch, Ray, Clock, list[tuple]]:
    ray, clock, events = Ray(), Clock(), []
    w = StartupWatch(deadline_s, kill=ray.kill, state=ray.state, clock=clock,
                     on_event=lambda kind, engine_id, **f: events.append((kind, engine_id, f)))
    return w, ray, clock, events


# ------------------------------------------------------------------ the bookkeeping alone
def test_an_engine_not_back_by_its_deadline_is_killed_once_per_deadline_and_awaited_anew():
    w, ray, clock, events = watch(60.0)
    w.expect("D", "actor-D", "hung: no answer to a ping")

    async def go():
        out = []
        for advance in (59.0, 1.0, 0.0, 30.0, 30.0):
            clock.now += advance
            out.append(await w.sweep())
        return out

    killed = asyncio.run(go())
    assert killed == [[], ["D"], [], [], ["D"]]  # at 60 s, not again at once, again 60 s later
    assert ray.killed == ["actor-D", "actor-D"]
    assert w.timeouts == {"D": 2} and w.pending() == {"D": 60.0}  # re-armed for the next incarnation
    assert [(k, e, f["missed"]) for k, e, f in events] == [("startup_timeout", "D", 1), ("startup_timeout", "D", 2)]
    assert "hung: no answer to a ping" in events[0][2]["reason"]
    assert "start-up deadline missed" in events[1][2]["reason"]


def test_a_registration_clears_the_deadline():
    w, ray, clock, _ = watch(60.0)
    w.expect("D", "actor-D", "actor died")
    w.expect("P", "actor-P", "actor died")
    w.registered("D")
    clock.now += 61.0
    assert asyncio.run(w.sweep()) == ["P"]
    assert ray.killed == ["actor-P"] and "D" not in w.pending() and w.timeouts == {"P": 1}


def test_engines_ray_will_not_restart_or_that_left_are_dropped_without_a_kill():
    w, ray, clock, _ = watch(60.0)
    for e in ("A", "B", "C"):
        w.expect(e, f"actor-{e}", "actor died")
    ray.states["actor-A"] = "DEAD"  # no restart left, or killed without restart
    w.drop("B", "shutdown")
    asyncio.run(w.sweep())
    assert w.pending() == {"C": 60.0}  # A dropped at the first sweep, before its deadline
    clock.now += 61.0
    assert asyncio.run(w.sweep()) == ["C"]
    assert ray.killed == ["actor-C"] and w.timeouts == {"C": 1}


def test_a_registration_while_ray_is_asked_wins_and_a_failed_kill_drops_the_engine():
    w, ray, clock, _ = watch(60.0)
    w.expect("D", "actor-D", "actor died")
    w.expect("P", "actor-P", "actor died")

    async def state(handle):
        await asyncio.sleep(0)
        w.registered("D")  # D registers while the sweep waits on Ray
        return "ALIVE"

    def kill(handle):
        raise ValueError("no such actor")

    w.state, w.kill = state, kill
    clock.now += 61.0
    assert asyncio.run(w.sweep()) == []
    assert w.pending() == {} and ray.killed == []  # D never killed; P's kill failed: not awaited


def test_a_changed_deadline_applies_to_engines_already_awaited():
    w, ray, clock, _ = watch(600.0)
    w.expect("D", "actor-D", "actor died")
    clock.now += 100.0
    w.deadline_s = 60.0  # configure() from a later launch
    assert asyncio.run(w.sweep()) == ["D"]


# ------------------------------------------------------------------ inside the coordinator
class _Watch:
    def __init__(self, actor: "MortalActor"):
        self.actor = actor

    def options(self, **_):
        return self

    def remote(self):
        fut = asyncio.get_running_loop().create_future()
        self.actor.watches.append(fut)
        return fut


class MortalActor(FakeActor):
    """An actor handle whose pending `watch()` calls fail when it dies (as Ray's do)."""

    def __init__(self):
        super().__init__()
        self.watches: list[asyncio.Future] = []

    def __getattr__(self, name):
        return _Watch(self) if name == "watch" else super().__getattr__(name)

    async def die(self) -> None:
        await asyncio.sleep(0)  # the coordinator's watchers have called watch()
        assert self.watches, "nobody watches this actor"
        for fut in self.watches:
            fut.set_exception(ray.exceptions.ActorDiedError())
        for _ in range(3):  # the coordinator's watcher sees it
            await asyncio.sleep(0)


async def coordinator(deadline_s: float = 60.0) -> tuple[Coordinator, dict[str, MortalActor], Clock, Ray]:
    c = Coordinator(hang_check_s=3600, ping_timeout_s=0.2, startup_deadline_s=deadline_s)
    handles = {"P": MortalActor(), "D": MortalActor()}
    c.liveness.kill = lambda h: setattr(h, "killed", h.killed + 1)
    ray, clock = Ray(), Clock()
    c.startups.state, c.startups.clock = ray.state, clock
    c.startups.kill = lambda h: setattr(h, "killed", h.killed + 1)
    for eid, role in (("P", "prefill"), ("D", "decode")):
        await register(c, eid, role, handles[eid])
    return c, handles, clock, ray


async def register(c: Coordinator, eid: str, role: str, handle: FakeActor, agent: str = "a") -> int:
    hs = payload(engine_id=eid, role=role, tp_rank=0, tp_size=1, agent_name=f"{eid}-{agent}").encode()
    return (await c.register_engine(eid, role, [hs], [handle])).generation


def test_a_hung_engine_killed_by_the_coordinator_is_awaited_and_killed_again_if_its_restart_hangs():
    async def go():
        c, h, clock, _ = await coordinator(60.0)
        h["D"].frozen = True
        gen = {e.engine_id: e.generation for e in await c.engines()}["D"]
        await c.engine_hung("D", gen, "missed its token deadline")
        awaited = c.startups.pending()
        clock.now += 61.0  # the restart froze before it registered: nobody probes it
        swept = await c.startups.sweep()
        stats = await c.control_stats()
        clock.now += 30.0
        await register(c, "D", "decode", h["D"], agent="b")  # the next incarnation comes back
        clock.now += 60.0
        after = (await c.startups.sweep(), await c.control_stats())
        stop(c)
        return awaited, swept, stats, after, h, c

    awaited, swept, stats, (swept_after, stats_after), h, c = asyncio.run(go())
    assert list(awaited) == ["D"]
    assert swept == ["D"] and h["D"].killed == 2  # the hang kill, then the start-up deadline's
    assert stats.startup_timeouts == {"D": 1} and list(stats.startups_awaited) == ["D"]
    assert swept_after == [] and stats_after.startups_awaited == {} and h["D"].killed == 2
    assert [e["event"] for e in c.events if e["engine_id"] == "D"][-2:] == ["startup_timeout", "registered"]


def test_an_engine_whose_actor_died_is_awaited_and_a_reregistration_clears_it():
    async def go():
        c, h, clock, _ = await coordinator()
        await h["P"].die()  # its process is gone; Ray restarts the actor
        awaited = dict(c.startups.pending())
        await register(c, "P", "prefill", h["P"], agent="b")
        stop(c)
        return awaited, c.startups.pending()

    awaited, after = asyncio.run(go())
    assert list(awaited) == ["P"] and after == {}
    # (the reason it is awaited for is the removal's: "actor died (ActorDiedError)")


def test_engines_that_leave_on_purpose_or_drain_are_not_awaited():
    async def go():
        c, h, clock, ray = await coordinator()
        await c.unregister_engine("P", "shutdown")  # left on purpose
        await c.set_draining("D")  # the autoscaler removes it...
        await h["D"].die()  # ...and it dies
        none = dict(c.startups.pending())
        c.startups.expect("X", FakeActor(), "actor died")  # a restart shut down before it registered
        await c.unregister_engine("X", "shutdown")
        stop(c)
        return none, c.startups.pending()

    none, after = asyncio.run(go())
    assert none == {} and after == {}


def test_the_coordinators_periodic_sweep_kills_a_stranded_restart_and_configure_sets_the_deadline():
    async def go():
        c = Coordinator(hang_check_s=0.01, ping_timeout_s=1.0, startup_deadline_s=3600)
        await c.configure(startup_deadline_s=0.05)  # the launcher's, from the deployment
        p = MortalActor()
        c.startups.kill = lambda h: setattr(h, "killed", h.killed + 1)
        await register(c, "P", "prefill", p)  # starts the coordinator's timers
        await p.die()
        for _ in range(500):  # until a sweep past the deadline killed it (an event, bounded)
            if p.killed:
                break
            await asyncio.sleep(0.01)
        stop(c)
        return c.startups.deadline_s, p.killed, dict(c.startups.timeouts)

    deadline_s, killed, timeouts = asyncio.run(go())
    assert deadline_s == 0.05 and killed >= 1 and timeouts["P"] == killed
