"""The Ray side of serving: cluster init and auth, engine placement and start-up, autoscaling, Ray-backed clients, the Serve app."""
