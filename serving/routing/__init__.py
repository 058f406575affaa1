"""Pure asyncio routing: no Ray, no HTTP."""
