"""The worker runtime: what every worker process runs around its engine (gRPC servicer, security,
telemetry, metrics, lifecycle), shared by the prefill and decode services."""
