"""Pure asyncio routing, no Ray and no HTTP: the engine pool, the placement policy, the router and its streams."""
