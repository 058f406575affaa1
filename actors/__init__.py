"""raypd actors: engines, coordinator, connector and the KV-transfer core (`actors.kv`)."""
