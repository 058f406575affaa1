"""The launcher's watch over its engines' placement groups (`serving.cluster.node_loss`): a group Ray is
rescheduling because its node died is removed, its actor killed, and its engine started again,
retried while no node offers it; groups in other states, or of other deployments, are left alone."""

import asyncio

from serving.cluster.names import actor_name_of, placement_group_name
from serving.cluster.node_loss import NodeLossWatch, engines_to_replace


def table(**states):
    return {f"id{i}": {"name": placement_group_name(engine), "state": state}
            for i, (engine, state) in enumerate(states.items())}


def test_only_this_deployments_rescheduling_groups_are_replaced():
    t = {**table(**{"dep-both-1": "RESCHEDULING", "dep-both-0": "CREATED", "dep-prefill-12": "RESCHEDULING",
                    "other-both-1": "RESCHEDULING", "dep-decode-0": "PENDING"}),
         "x": {"name": None, "state": "RESCHEDULING"}, "y": {"name": "user-pg", "state": "RESCHEDULING"}}
    assert engines_to_replace(t, "dep") == [("both", 1), ("prefill", 12)]


def test_a_lost_engine_is_removed_once_and_started_again_until_a_node_offers_it():
    async def go():
        removed, killed, starts = [], [], []

        async def start(role, index):
            starts.append((role, index))
            if len(starts) < 3:
                raise RuntimeError("no node offers the bundle")

        state = {"dep-decode-0": "RESCHEDULING", "dep-prefill-0": "CREATED"}
        watch = NodeLossWatch("dep", start, table=lambda: table(**state), remove=removed.append,
                              kill=killed.append, retry_s=0.01)
        assert await watch.check() == [("decode", 0)]
        assert await watch.check() == []  # one replacement per engine at a time
        await asyncio.wait_for(asyncio.gather(*watch.replacing.values()), 5)
        assert removed == [placement_group_name("dep-decode-0")]
        # the actor Ray would keep restarting in the removed group goes too: the start must not get it back
        assert killed == [actor_name_of("dep-decode-0")]
        assert starts == [("decode", 0)] * 3
        assert (watch.replaced, watch.restarted, watch.replacing) == (1, 1, {})
        assert [(e.engine, e.step, e.detail) for e in watch.events] == [
            ("dep-decode-0", "replaced", ""),
            *[("dep-decode-0", "starting", ""), ("dep-decode-0", "start_failed", "RuntimeError: no node offers the bundle")] * 2,
            ("dep-decode-0", "starting", ""), ("dep-decode-0", "started", "")]
        watch.stop()

    asyncio.run(go())


def test_stop_cancels_a_replacement_waiting_for_a_node():
    async def go():
        async def start(role, index):
            raise RuntimeError("no node offers the bundle")

        watch = NodeLossWatch("dep", start, table=lambda: table(**{"dep-both-0": "RESCHEDULING"}),
                              remove=lambda name: None, kill=lambda name: None, retry_s=60)
        await watch.check()
        task = watch.replacing[("both", 0)]
        await asyncio.sleep(0.05)
        watch.stop()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and watch.replacing == {} and watch.restarted == 0

    asyncio.run(go())
