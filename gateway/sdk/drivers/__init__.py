"""Agents the gateway drives: each a Turn handler built from a remote agent's address;
nothing server-side. The worker (:class:`gateway.sdk.agent.AgentWorker`) runs one as it runs
any handler, so durability, resume, cancels and takeover after a crash are the same."""
