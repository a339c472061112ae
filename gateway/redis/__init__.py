"""Redis: the connection (single server or cluster), the auto-pipeline, the store
and its Lua scripts, sharded pub/sub readers and the agent inbox."""
