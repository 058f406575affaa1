"""What travels between the front, the router, the engines and the coordinator, typed and
picklable over Ray: a request's types (`request`), an engine's stats (`stats`), its registration
(`registration`) and the `Backend` an engine actor runs (`backend`). Import from those modules."""
